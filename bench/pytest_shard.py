"""A pytest plugin that runs one contiguous share of the collected tests, for spreading a suite over several pytest
processes where pytest-xdist is not installed (``bench/gpu_check.sh tests``)::

    PYTEST_SHARD=2/3 python -m pytest -p pytest_shard tests/quant/test_kernels.py    # bench/ on PYTHONPATH

Shard ``i`` of ``k`` (1-based) keeps items ``[(i - 1) * n // k, i * n // k)`` of the ``n`` collected, in collection
order, so the parametrizations of one test (which share compiled kernels) mostly stay in one process; the others are
reported as deselected. Without ``PYTEST_SHARD`` nothing changes.
"""

from __future__ import annotations

import os

import pytest


def shard_bounds(spec: str, count: int) -> tuple[int, int]:
    """``(start, stop)`` of shard ``spec`` (``"i/k"``) among ``count`` items."""
    i, k = (int(v) for v in spec.split("/"))
    if not 1 <= i <= k:
        raise ValueError(f"PYTEST_SHARD={spec!r}: want i/k with 1 <= i <= k")
    return (i - 1) * count // k, i * count // k


@pytest.hookimpl(trylast=True)  # after -k and -m deselect: shard what is left
def pytest_collection_modifyitems(config, items) -> None:
    spec = os.environ.get("PYTEST_SHARD")
    if not spec:
        return
    start, stop = shard_bounds(spec, len(items))
    dropped = items[:start] + items[stop:]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = items[start:stop]
