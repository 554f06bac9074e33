"""CPU optimizer micro-benchmarks (pytest-benchmark): the native AdamW step (``zeropp.optim.native.adam_step``), alone
and writing the bf16 copy in the same pass, beside torch's fused step and a copy of the same 28 bytes per element
(``bench/optimizer.py``'s rows: its docstring has the byte model and the settings).

    pytest bench/test_bench_optimizer.py --benchmark-only          # see bench/test_bench_kernels.py for baselines

2^22 fp32 elements on ``torch.get_num_threads()`` threads, ``ROUNDS`` timed steps after ``WARMUP`` untimed ones
(host clock). The native rows are
skipped, saying why, where the native library does not load; tests/optim/test_native_adam.py checks its bits.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from optimizer import rows_for
from zeropp.optim import native

NUMEL = 2**22
ROWS = {"native": 28, "native + bf16 out": 30, "torch fused": 28, "copy_ (28 B/elem)": 28}
"""The rows timed, with the bytes per element each moves."""
ROUNDS, WARMUP = 10, 2


@pytest.fixture(scope="module")
def fns() -> dict[str, Callable[[], object]]:
    """``bench/optimizer.py``'s functions over ``NUMEL`` elements, by row name (without DeepSpeed)."""
    return rows_for(NUMEL, None)[0]


@pytest.mark.parametrize("row", ROWS)
def test_adam_step(benchmark, fns: dict[str, Callable[[], object]], row: str) -> None:
    if row not in fns:
        pytest.skip(f"the native CPU library does not load: {native.unavailable_reason()}")
    benchmark.group = f"AdamW step, 2^22 fp32, {torch.get_num_threads()} threads"
    benchmark.extra_info.update(bytes=ROWS[row] * NUMEL, numel=NUMEL, threads=torch.get_num_threads())
    benchmark.pedantic(fns[row], rounds=ROUNDS, warmup_rounds=WARMUP)
