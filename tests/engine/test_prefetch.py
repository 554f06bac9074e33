"""Stage-3 prefetch (``stage3_prefetch_bucket_size``) and overlapped gradient reduction (``overlap_comm``) change when
collectives run, never what they compute: on 4 gloo ranks (2 emulated nodes of 2) the runs with them off and on give
bit-identical losses and fp32 masters, exact and with full ZeRO++ (qwZ, hpZ, qgZ with error feedback). The
prefetcher learns the forward order of the tiny GPT (root, blocks.0, blocks.1) and starts, per step after the first,
the gathers of blocks.0 and blocks.1 from the root's pre-forward and blocks.0's from blocks.1's backward (3) with an
unbounded bucket, and stops at the bucket bound otherwise. Every unit is freed after its forward here (no persistent
units, reuse distance 0: ``EVERY_GATHER``), so that every gather happens; ``test_reuse`` covers the units kept
whole.
"""

from __future__ import annotations

import pytest
import torch

from engine_launch import launch, launch_cases

EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
FULL = {**EVERY_GATHER, "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
        "zeropp": {"error_feedback": True}}


ZEROS = {"exact": EVERY_GATHER, "zeropp": FULL}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every run of both ``ZEROS`` in one launch."""
    runs = {
        "off": {"stage3_prefetch_bucket_size": 0, "overlap_comm": False},
        "on": {},  # defaults: 5e7-element prefetch bucket, overlap_comm true at stage 3
        "one-unit": {"stage3_prefetch_bucket_size": 1, "reduce_bucket_size": 1},  # waits for each reduction at once
    }
    return launch_cases("prefetch_workers:prefetch_runs", 4, tmp_path_factory.mktemp("prefetch"),
                        {name: {"zero": zero} for name, zero in ZEROS.items()}, env={"ZEROPP_RANKS_PER_NODE": "2"},
                        timeout=300, runs=runs)


@pytest.mark.parametrize("zero", list(ZEROS))
def test_prefetch_and_overlap_are_bit_identical(results, zero) -> None:
    for res in results[zero]:
        off = res["off"]
        assert off["started"] == [0, 0, 0, 0]
        for name in ("on", "one-unit"):
            assert res[name]["losses"] == off["losses"], name
            for key, want in off["masters"].items():
                assert torch.equal(res[name]["masters"][key], want), (name, key)
        on = res["on"]
        assert on["order"] == ["", "blocks.0", "blocks.1"]
        assert on["started"] == [0, 3, 3, 3]
        # a bucket of one element is smaller than every unit: nothing is started ahead
        assert res["one-unit"]["started"] == [0, 0, 0, 0]
        # reused gradient buffers, as many of each size as were in flight at once. The one-element bucket sends each
        # unit alone, two at a time, which needs two block buffers (blocks.1 is in flight when blocks.0 starts) and
        # one of the root's size. The default reduce_bucket_size (5e8) holds the three units until the end of
        # backward and sends them in one bucket of their rows in all (world x the units' shard sizes), with or
        # without overlap, exact and under qgZ with error feedback alike (comm.BucketErrorFeedback).
        sizes = on["unit_numel"]
        block, root = sizes["blocks.0"], sizes[""]
        assert res["one-unit"]["pooled"] == sorted([block, block, root])
        assert off["pooled"] == on["pooled"] == [on["bucket_numel"]]
        if zero == "exact":
            assert on["bucket_numel"] == 2 * block + root


def test_prefetch_bucket_bounds_the_look_ahead(tmp_path) -> None:
    sizes = launch("prefetch_workers:prefetch_runs", 2, tmp_path, zero=EVERY_GATHER, runs={"probe": {}}, steps=1)[0]
    block = sizes["probe"]["unit_numel"]["blocks.0"]
    # room for exactly one block unit: the root starts blocks.0 only, blocks.0 starts blocks.1, and the backward of
    # blocks.1 starts blocks.0
    res = launch("prefetch_workers:prefetch_runs", 2, tmp_path / "b", zero=EVERY_GATHER,
                 runs={"bounded": {"stage3_prefetch_bucket_size": block}}, steps=3)
    for r in res:
        assert r["bounded"]["started"] == [0, 3, 3]


def test_prefetch_budget_counts_frozen_elements() -> None:
    """The look-ahead budget counts what a gather moves: a unit's trainable and frozen elements. Plain objects with
    the members the prefetcher reads stand in for units (no collectives involved)."""
    from types import SimpleNamespace

    from zeropp.engine.prefetch import Prefetcher

    def unit(trainable: int, frozen: int) -> SimpleNamespace:
        u = SimpleNamespace(full=torch.empty(trainable), gathered=False, gathers=0, secondary_in_flight=False,
                            frozen=SimpleNamespace(full=torch.empty(frozen)) if frozen else None)
        u.gather = lambda wait=True: setattr(u, "gathers", u.gathers + 1)
        return u

    for budget, expected in ((150, 0), (160, 1)):  # the next unit moves 100 + 60 elements
        first, nxt = unit(10, 0), unit(100, 60)
        p = Prefetcher(budget)
        for u in (first, nxt):
            p.after_forward_gather(u)  # the first forward records the order
        p.begin_forward()
        p.after_forward_gather(first)
        assert nxt.gathers == expected, (budget, nxt.gathers)


def test_prefetch_lands_one_unit_whose_delta_is_in_flight() -> None:
    """Of the units whose weight-delta part is in flight (``Unit.secondary_in_flight``), one look-ahead starts only
    the first (its gather lands the part); the next in flight waits for the next look-ahead, the units after it that
    are not in flight are started. Plain objects stand in for units, as above; a gather lands the part."""
    from types import SimpleNamespace

    from zeropp.engine.prefetch import Prefetcher

    def unit() -> SimpleNamespace:
        u = SimpleNamespace(full=torch.empty(10), gathered=False, frozen=None, secondary_in_flight=False)

        def gather(wait: bool = True) -> None:
            u.gathered, u.secondary_in_flight = True, False

        u.gather = gather
        return u

    units = [unit() for _ in range(4)]
    p = Prefetcher(1000)
    for u in units:
        p.after_forward_gather(u)  # the first forward records the order
    p.begin_forward()
    for u in units:
        u.gathered = False
    units[1].secondary_in_flight = units[2].secondary_in_flight = True
    units[0].gathered = True
    p.after_forward_gather(units[0])
    assert [u.gathered for u in units] == [True, True, False, True]
    assert units[2].secondary_in_flight
    p.after_forward_gather(units[1])
    assert all(u.gathered for u in units)
