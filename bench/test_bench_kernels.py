"""CPU kernel micro-benchmarks (pytest-benchmark): the native CPU library's quantize and dequantize (int8, int4),
fused reduce-requantize (qgZ step 3, d = 2), fused reduce-dequantize (qgZ step 5) and the 32-element Hadamard
rotation and its inverse (``zeropp.quant.rotation``; the forward row has torch widen its bf16 input to float32
first, the inverse rotates float32), each beside a copy of the same bytes (the floor: ``bytes`` read and written
once, half each; see ``bench/kernels.py``, whose rows these are).

    pytest bench/ --benchmark-only                                         # the tables, one group per kernel
    pytest bench/ --benchmark-only --benchmark-storage=file://bench/baselines --benchmark-save=MACHINE
    pytest bench/ --benchmark-only --benchmark-storage=file://bench/baselines \\
        --benchmark-compare --benchmark-compare-fail=min:25%               # fails where 25% slower

Each row is 2^22 bf16 elements (block size zeropp's default), checked once against the torch reference (the same
bytes and floats) before it is timed, on ``torch.get_num_threads()`` threads; pytest-benchmark times ``ROUNDS`` calls
after ``WARMUP`` untimed ones with the host clock (fixed counts: a second or two per row). On a shared machine compare
the minimum (``--benchmark-compare-fail=min:25%``), which other load disturbs least. Not part of the test suite
(pyproject.toml's testpaths is ``tests``); where the native library is not built the rows are skipped, saying why.
``bench/baselines/`` holds saved runs (machine and load in bench/RESULTS.md): compare only on the machine that saved
them.
"""

from __future__ import annotations

import pytest
import torch

from kernel_check import Reference
from kernels import build_cases, check_case, copy_of
from zeropp import quant
from zeropp.quant import DEFAULT_BLOCK_SIZE, native

NUMEL = 2**22
DTYPE = torch.bfloat16
ROWS = ("quantize int8", "dequantize int8", "quantize int4", "dequantize int4", "reduce_requantize int4 d=2",
        "reduce_dequantize int4 g=2", "hadamard_rotate s=32", "hadamard_unrotate s=32")
CPU = torch.device("cpu")
ROUNDS, WARMUP = 20, 2


@pytest.fixture(scope="module")
def cases() -> dict:
    """``bench/kernels.py``'s rows named in ``ROWS``, by name (2 nodes, as its defaults)."""
    if not native.available():
        pytest.skip(f"the native CPU library does not load: {native.unavailable_reason()}")
    built = build_cases(NUMEL, DTYPE, DEFAULT_BLOCK_SIZE, world=8, nodes=2, rpn=8, device=CPU, ds=None,
                        ref=Reference(), keep=ROWS.__contains__)
    return {case.name: case for case in built}


@pytest.mark.parametrize("what", ["kernel", "copy"])
@pytest.mark.parametrize("row", ROWS)
def test_kernel(benchmark, cases: dict, row: str, what: str) -> None:
    case = cases[row]
    dtype = "fp32" if row.startswith("hadamard_unrotate") else "bf16"  # the inverse rotates float32 values
    benchmark.group = f"{row}, 2^22 {dtype}, {torch.get_num_threads()} threads"
    benchmark.extra_info.update(bytes=case.nbytes, numel=NUMEL, threads=torch.get_num_threads())
    if what == "kernel":
        assert quant.backend_name(case.output) == "native"
        status, detail = check_case(case)
        assert status == "PASS", detail
        fn = case.fn
    else:
        fn = copy_of(case.nbytes, CPU)
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=WARMUP)
