"""The collective benchmark runs under torchrun on gloo and writes its CSV and table."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from zeropp.quant import DEFAULT_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]


def test_bench_collectives_under_torchrun(tmp_path):
    out_csv = tmp_path / "rows.csv"
    env = dict(os.environ, ZEROPP_QUANT_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "zeropp.bench.collectives", "--ranks-per-node", "2", "--min-bytes", "16K", "--max-bytes", "64K",
           "--iters", "1", "--warmup", "0", "--csv", str(out_csv), "--plot", str(tmp_path / "bw.png")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "busbw" in proc.stdout
    rows = list(csv.DictReader(open(out_csv)))
    assert len(rows) == 2 * 2 * 3  # ops x sizes x (exact, int8, int4)
    by = {(r["op"], r["mode"], int(r["size"])): r for r in rows}
    # wire bytes per rank: exact all-gather of 64 KiB over 4 ranks = 3/4 of it; int4 is about a quarter of bf16
    assert int(by[("all_gather", "exact", 65536)]["wire"]) == 65536 * 3 // 4
    ratio = int(by[("all_gather", "int4", 65536)]["wire"]) / int(by[("all_gather", "exact", 65536)]["wire"])
    assert 0.25 <= ratio < 0.3
    # qgZ int4 across nodes (2 nodes x 2): numel / (2 d) * (n - 1) / n plus scales, numel = 32768
    inter = int(by[("reduce_scatter", "int4", 65536)]["inter"])
    block = DEFAULT_BLOCK_SIZE
    assert inter == 32768 // 4 // 2 * (block // 2 + 4) // (block // 2)
    assert (tmp_path / "bw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
