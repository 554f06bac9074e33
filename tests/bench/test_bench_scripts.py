"""The benchmark scripts run on a CPU and report numbers that agree with independent formulas."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, tmp_path: Path) -> list[dict[str, str]]:
    out = tmp_path / f"{name}.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ZEROPP_QUANT_BACKEND"] = "torch"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args, "--csv", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return list(csv.DictReader(open(out)))


def test_accuracy_report(tmp_path):
    rows = run_script("accuracy", "--numel", "65536", "--block-sizes", "32", "128", tmp_path=tmp_path)
    by = {(r["dist"], int(r["bits"]), int(r["block_size"])): r for r in rows}
    assert set(by) == {(d, b, s) for d in ("gaussian", "student-t3") for b in (8, 4) for s in (32, 128)}
    for (dist, bits, block), r in by.items():
        assert float(r["bits_per_el"]) == bits + 32 / block  # codes plus one float32 scale per block
        assert float(r["ratio_vs_bf16"]) == 16 / (bits + 32 / block)
    for dist in ("gaussian", "student-t3"):
        for block in (32, 128):
            assert float(by[dist, 8, block]["rel_l2"]) * 8 < float(by[dist, 4, block]["rel_l2"])
        # smaller blocks, smaller error (the heavy tails make the gap large)
        assert float(by[dist, 4, 32]["rel_l2"]) < float(by[dist, 4, 128]["rel_l2"])
    # Gaussian int8: the error of a uniform quantizer of step absmax/127 (absmax of 128 Gaussians is ~2.6-3)
    assert 0.004 < float(by["gaussian", 8, 128]["rel_l2"]) < 0.009
    # codes of the exact product x * r against float32 division's: they differ only at rare near-ties
    assert all(0 <= float(r["vs_div"]) < 1e-4 for r in rows)


def test_kernel_benchmark_on_cpu(tmp_path):
    n = 1 << 12
    rows = run_script("kernels", "--sizes", "2^12", "--threads", "1", "--reps", "1", "--warmup", "0", "--quiet",
                      "--block-size", "128", tmp_path=tmp_path)
    by = {r["kernel"]: r for r in rows}
    packed8 = n + 4 * (n // 128)  # int8 codes + one float32 scale per 128 elements
    assert int(by["quantize int8"]["bytes"]) == 2 * n + packed8  # fp16 read once, pack written once
    assert int(by["dequantize int8"]["bytes"]) == packed8 + 2 * n
    assert all(float(r["ms"]) > 0 and float(r["copy ms"]) > 0 for r in rows)
    assert {"swizzle_quantize int4 2x8", "reduce_requantize int4 d=8", "reduce_dequantize int4 g=2"} <= set(by)

