"""bench/swap.py runs on a small case and reports consistent rows (the numbers themselves are the disk's)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_swap_bench_rows(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "swap.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "swap.py"), "--dir", str(disk), "--sizes", "8", "--aio", "65536:2:1",
         "131072:1:2", "--repeats", "1", "--region-mib", "3", "--buffer-mib", "1", "--check-mib", "1",
         "--csv", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    keys = [(r["MiB"], r["block_size"], r["queue_depth"], r["intra_op_parallelism"], r["CRC-32C"]) for r in rows]
    assert keys == [("8", "65536", "2", "1", "on"), ("8", "65536", "2", "1", "off (timing only)"),
                    ("8", "131072", "1", "2", "on")]
    for r in rows:
        assert r["O_DIRECT"] == "True"
        for kind in ("write", "read"):
            assert math.isclose(float(r[f"{kind} vs raw"]),
                                float(r[f"swap {kind} MB/s"]) / float(r[f"raw {kind} MB/s"]), rel_tol=1e-9)
            assert float(r[f"{kind} CPU s/GiB"]) > 0
    assert "crc32c.crc32c (SwapSpace)" in proc.stdout and "zlib.crc32" in proc.stdout
    assert os.listdir(disk) == []  # measure_disk's and SwapSpace's files are gone
