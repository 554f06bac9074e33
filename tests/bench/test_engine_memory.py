"""bench/engine_memory.py at world size 1 on the tiny GPT: the engine's measured buffers are exactly the ZeRO formulas
(no padding at world 1 with exact collectives), and with qwZ/qgZ exactly the formulas plus the block padding of the
unit layout, computed here from the parameter shapes (every parameter starts on the 128-element grid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zeropp.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "memory.json"
    env = {**os.environ, "ZEROPP_QUANT_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_memory.py"), "--preset", "tiny", *args, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| fp32 master" in proc.stdout
    return json.loads(out.read_text())


def test_world1_buffers_match_the_formulas(tmp_path):
    r = run(tmp_path, "--dtype", "bf16")
    psi = GPT(GPTConfig.preset("tiny")).num_params()  # the tied head counted once
    assert r["psi"] == psi and r["world"] == 1 and r["padding_elements"] == 0
    rows = {row["buffer"]: row["measured"] for row in r["rows"]}
    assert rows["compute shard"] == 2 * psi
    assert rows["fp32 grad shard"] == 4 * psi
    assert rows["fp32 master"] == 4 * psi
    assert rows["optimizer states"] == 8 * psi
    assert r["measured_state"] == (2 + 4 + 12) * psi == r["ours_formula"]
    assert r["deepspeed_formula"] == (2 + 2 + 12) * psi
    assert rows["reduce buffer (largest unit, transient)"] == 0  # one rank: no flat buffer
    assert rows["full params (largest unit, transient)"] == 0  # one rank: the whole params are the compute shard


def test_world1_block_padding(tmp_path):
    r = run(tmp_path, "--dtype", "fp32", "--quantized")
    padded = sum(-(-p.numel() // 128) * 128 for p in GPT(GPTConfig.preset("tiny")).parameters())
    assert r["align"] == 128 and r["shard_elements"] == padded and r["padding_elements"] == padded - r["psi"] > 0
    rows = {row["buffer"]: row["measured"] for row in r["rows"]}
    assert rows["compute shard"] == 4 * padded
    assert rows["fp32 grad shard"] == rows["fp32 master"] == 4 * padded
    assert rows["optimizer states"] == 8 * padded
