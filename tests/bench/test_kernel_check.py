"""``bench/kernels.py --check`` and ``--sweep`` (with ``bench/kernel_check.py``) on the CPU: the check finds a wrong
value, a wrong byte or a crash and says where; the windows past 2^31 (here scaled down) compare the right bytes; the
Triton kernels under the interpreter pass the check; the sweep runs every tile plus the default one.

In-process runs use the torch backend (fast: the "device" result is the reference itself, so only a fault injected
here can make a row fail); the interpreter runs are subprocesses at toy sizes (~10 s)."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import exact_triton

import zeropp.quant as zq
from zeropp.quant import BlockFormat

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def load(name: str):
    """A bench/ script as a module (kernels.py finds kernel_check.py next to it by itself)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up; kernels.py imports kernel_check by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


kernel_check = load("kernel_check")
kernels = load("kernels")


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")


def run_main(args: list[str], tmp_path: Path) -> tuple[int, list[dict[str, str]]]:
    out = tmp_path / "rows.csv"
    rc = kernels.main([*args, "--device", "cpu", "--reps", "1", "--warmup", "0", "--quiet", "--csv", str(out)])
    return rc, list(csv.DictReader(open(out)))


def test_compare_tells_codes_scales_and_values_apart():
    fmt = BlockFormat(8, 128)
    x = torch.randn(3 * 256)
    want = zq.quantize_chunks(x, fmt, 3)  # 3 packs of 2 blocks
    layout = kernel_check.PackLayout(fmt, 3, 256)
    assert kernel_check.compare(want.clone(), want, layout) is None
    got = want.clone()
    pack = fmt.packed_bytes(256)
    got[pack + 130] ^= 1  # pack 1, block 1, a code byte
    got[2 * pack + fmt.code_bytes(256) + 4] ^= 1  # pack 2, block 1, a scale byte
    note = kernel_check.compare(got, want, layout)
    assert "codes: 1 of" in note and "first in pack 1 block 1" in note, note
    assert "scales: 1 of" in note and "first in pack 2 block 1" in note, note
    values = torch.tensor([1.0, float("nan"), 3.0])
    assert kernel_check.compare(values.clone(), values) is None  # NaN where NaN
    bad = values.clone()
    bad[2] = -3.0
    assert "1 of 3 values differ, first at element 2" in kernel_check.compare(bad, values)
    assert "got torch.float16" in kernel_check.compare(values.half(), values)


def test_check_passes_and_then_finds_a_wrong_value(torch_backend, tmp_path, monkeypatch):
    args = ["--sizes", "2^12", "--dtype", "bf16", "--block-size", "128", "--check", "--world", "2",
            "--ranks-per-node", "2"]
    rc, rows = run_main(args, tmp_path)
    assert rc == 0 and len(rows) == 27 and {r["check"] for r in rows} == {"PASS"}, rows

    original = zq.dequantize_chunks

    def off_by_one(buf, fmt, chunks, chunk_numel, out):  # one element one ulp off
        original(buf, fmt, chunks, chunk_numel, out)
        out.view(-1).view(torch.int16)[5] += 1  # bf16: the next float away from zero
        return out

    monkeypatch.setattr(zq, "dequantize_chunks", off_by_one)
    rc, rows = run_main(args, tmp_path)
    failed = {r["kernel"]: r["detail"] for r in rows if r["check"] == "FAIL"}
    assert rc == 1
    assert set(failed) == {"dequantize int8", "dequantize int4", "dequantize int2", "dequantize gathered int8 x2"}, failed
    assert all("1 of 4,096 values differ, first at element 5" in d for d in failed.values()), failed


def test_check_finds_a_wrong_byte_and_a_crash(torch_backend, tmp_path, monkeypatch):
    original = zq.swizzle_quantize

    def flip(x, fmt, nodes, ranks_per_node, *, out=None):
        out = original(x, fmt, nodes, ranks_per_node, out=out)
        out[fmt.packed_bytes(zq.chunk_numel(x.numel(), nodes * ranks_per_node)) - 1] ^= 0x80  # pack 0's last scale
        return out

    def crash(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(zq, "swizzle_quantize", flip)
    monkeypatch.setattr(zq, "reduce_requantize", crash)
    rc, rows = run_main(["--sizes", "2^12", "--block-size", "128", "--check", "--world", "2", "--ranks-per-node", "2"],
                        tmp_path)
    by = {r["kernel"]: r for r in rows}
    assert rc == 1
    assert by["swizzle_quantize int4 2x2"]["check"] == "FAIL"
    assert "scales: 1 of" in by["swizzle_quantize int4 2x2"]["detail"]
    assert "codes" not in by["swizzle_quantize int4 2x2"]["detail"]
    assert {by[f"reduce_requantize int4 d={d}"]["check"] for d in (2, 4, 8)} == {"ERROR"}
    assert "boom" in by["reduce_requantize int4 d=2"]["detail"]
    assert by["quantize int4"]["check"] == by["reduce_dequantize int4 g=2"]["check"] == "PASS"


def test_far_windows_compare_the_right_bytes(torch_backend, monkeypatch):
    numel, far = 4 * 3 * 2048, 20_000  # scaled down: 4 packs of 6144 elements, "2^31" at element 20000 (pack 3)
    results = kernel_check.far_checks(numel, torch.float16, 128, torch.device("cpu"), far=far, window_numel=512)
    assert len(results) == 7 and all(diff is None for _, diff in results), results
    windows = kernel_check.windows(3 * 6144, 6144, BlockFormat(4, 128), far, 4)
    assert windows == [(0, 4), (12, 16), (44, 48)]  # start, around element 20000 (block 12 of pack 3), end
    assert kernel_check.windows(2 * 6144, 6144, BlockFormat(4, 128), far, 4) == [(0, 4), (44, 48)]

    original = zq.reduce_dequantize

    def spoil(buf, fmt, groups, chunk_numel, out, *, divisor=1.0):  # a value in the window around element `far`
        original(buf, fmt, groups, chunk_numel, out, divisor=divisor)
        out[far - 3 * 6144 + 7] = 1e4
        return out

    monkeypatch.setattr(zq, "reduce_dequantize", spoil)
    results = dict(kernel_check.far_checks(numel, torch.float16, 128, torch.device("cpu"), far=far, window_numel=512))
    assert [name for name, diff in results.items() if diff] == ["reduce_dequantize int8 g=4"], results
    assert "first at element" in results["reduce_dequantize int8 g=4"]


def test_sweep_times_every_tile_and_the_default(torch_backend, tmp_path):
    rc, rows = run_main(["--sweep", "--sizes", "2^12", "--block-size", "128", "--check", "--kernels", "quantize int8",
                         "--tile-elements", "64", "256", "--tile-warps", "2"], tmp_path)
    assert rc == 0
    by = {(r["kernel"], int(r["elements"]), int(r["warps"])): r for r in rows}
    # Exactly the row named (not "dequantize int8" too); 64 elements is less than a block: one block (128) per program
    tiles = ((128, 2), (256, 2), (8192, 4))
    assert set(by) == {("quantize int8", e, w) for e, w in tiles}
    assert all(r["check"] == "PASS" and float(r["floor/time"]) > 0 for r in rows)
    assert {k[1:] for k, r in by.items() if r["default"] == "yes"} == {(8192, 4)}


def test_kernels_are_chosen_by_exact_name(torch_backend, tmp_path, capsys):
    """``--kernels`` selects the rows of exactly those names (``row_names``, which names every row ``build_cases``
    makes); an unknown name, such as a mere part of one, is an error listing the valid names."""
    names = kernels.row_names(3, 2, 4)
    built = kernels.build_cases(1 << 10, torch.float16, 128, 3, 2, 4, torch.device("cpu"), None,
                                kernel_check.Reference())
    assert [c.name for c in built] == names and len(set(names)) == 27
    assert "dequantize gathered int8 x3" in names and "swizzle_quantize int4 2x4" in names
    assert "hadamard_rotate s=32" in names and "reduce_requantize int8->int2 d=2" in names
    assert "swizzle_quantize_rotated int4 2x4 s=32" in names and "reduce_dequantize_rotated int4 g=2 s=32" in names
    assert "swizzle_quantize_rotated int4 2x4 s=32 seeded" in names
    rc, rows = run_main(["--sizes", "2^12", "--block-size", "128", "--kernels", "dequantize int4",
                         "reduce_dequantize int4 g=2"], tmp_path)
    assert rc == 0 and [r["kernel"] for r in rows] == ["dequantize int4", "reduce_dequantize int4 g=2"]
    with pytest.raises(SystemExit) as exit_info:
        kernels.main(["--device", "cpu", "--kernels", "quantize int8", "reduce"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no row is named 'reduce';" in err and "'reduce_requantize int4 d=8'" in err  # only the unknown one


def test_triton_kernels_pass_the_check_under_the_interpreter(tmp_path):
    """The real kernels (interpreted) through the whole --check path: chosen rows, the far windows (scaled down), a
    two-tile sweep of one row."""
    exact_triton("cpu")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = [
        ["--sizes", "2^12", "--block-size", "2048", "--world", "2", "--ranks-per-node", "2", "--far-numel", "24576",
         "--kernels", "quantize int8", "dequantize gathered int8 x2", "reduce_requantize int4 d=2",
         "reduce_dequantize int4 g=2"],
        ["--sizes", "2^12", "--block-size", "128", "--sweep", "--kernels", "dequantize int8", "--tile-elements", "1024",
         "--tile-warps", "2"],
    ]
    for i, args in enumerate(runs):
        out = tmp_path / f"rows{i}.csv"
        proc = subprocess.run(
            [sys.executable, str(BENCH / "kernels.py"), "--backend", "triton", "--check", "--reps", "1",
             "--warmup", "0", "--quiet", "--csv", str(out), *args],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        rows = list(csv.DictReader(open(out)))
        assert rows and {r["check"] for r in rows} == {"PASS"}, rows
        assert {r["backend"] for r in rows if r["op"] != "far"} == {"triton"}
    assert len([r for r in csv.DictReader(open(tmp_path / "rows0.csv")) if r["op"] == "far"]) == 7


def test_gpu_timer_uses_do_bench_median_and_quantiles(monkeypatch):
    """The CUDA branch of the timer, with do_bench and the synchronization stood in for (no GPU here)."""
    import triton.testing

    calls = []

    def fake_do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        calls.append({"warmup": warmup, "rep": rep, "quantiles": quantiles, "return_mode": return_mode})
        fn()
        return [1.0, 0.5, 2.0]

    def old_do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, fast_flush=True):
        return [3.0, 2.0, 4.0]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    runs = []
    timer = kernels.Timer(torch.device("cuda"), 25, 100)
    assert timer(lambda: runs.append(1)) == (1e-3, 5e-4, 2e-3)
    assert calls == [{"warmup": 25, "rep": 100, "quantiles": [0.5, 0.2, 0.8], "return_mode": "median"}]
    assert len(runs) == 2  # one run first (compilation), then do_bench's own
    monkeypatch.setattr(triton.testing, "do_bench", old_do_bench)  # a triton without return_mode
    assert kernels.Timer(torch.device("cuda"), 25, 50, "min")(lambda: None) == (3e-3, 2e-3, 4e-3)
