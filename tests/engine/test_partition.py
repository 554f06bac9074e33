"""The grouped points in the engine (``zeropp.engine.partition``: MiCS ``(k, k, k)`` at stage 3, ``(1, 1, k)`` at
stage 1, ``(1, k, k)`` and ``(1, g, o)`` with ``g < o`` at stage 2) on real gloo processes: world 4 as 2 x 2
emulated nodes (groups of 2) and world 8 as 2 x 4 (groups of 4 and 2) and 4 x 2 (groups of 2 and 4), one launch per
layout running every point; the grouped resident points ``(p, g, o)``, ``2 <= p < o`` (``(k, k, o)``, ``(p, k, k)``,
``(p, g, o)`` with ``p < g < o``) bit for bit against ``(1, g, o)`` or MiCS over ``g`` in the same launches, at 4 x 2
also with the parameters over two whole nodes: ``(4, 4, 8)`` against ``(1, 4, 8)``, ``(4, 8, 8)`` against ZeRO-3.

Against plain single-process training (engine_workers.py's reference) with the bars of test_engine.py, not bit for
bit: each point averages each gradient element over its group of ``k`` ranks (gloo's sum, one division) and then
over the ``W / k`` groups (another sum, another division), while the reference sums the whole batch in one backward; the
float32 sums differ in order, so they round differently (a few ulps of each gradient element per step), which Adam
turns into relative weight differences of about 1e-6 after a few steps (``(1, g, o)``: three averages, over ``g``,
the ``o / g`` groups and the ``W / o`` replicas; measured 2e-7 norm-wise, 7.5e-6 element-wise). Every rank ends
with the same weights.

MiCS with qwZ (int8) and qgZ (int4, the cross-group all-reduce quantized too), 4 AdamW steps (lr 1e-3) on random
tokens, against the exact MiCS run and single-process training by ``||theta - theta_exact|| / ||theta_exact -
theta_0||`` of the fp32 masters (test_zeropp.py's yardstick): measured 0.36 (world 4, k = 2), 0.35 and 0.39 (world
8 as 2 x 4, k = 4 and 2); bar ``QUANTIZED_BAR``; an unrelated update gives about 1.4. Every rank ends with the
same weights (the replicas dequantize the same packs). The quantized cross-group all-reduce alone, on fresh inputs
in int8, int4 and int2, stays within ``zeropp.comm.all_reduce``'s bound (measured worst error / bound: 0.97 with one
hop, 0.72 with two) with bit-identical outputs on every replica; its bytes equal the formula.

bf16 and fp16 (3 steps; world 4 with k = 2, world 8 as 2 x 4 with k = 2, groups inside a node, and as 4 x 2 with
k = 4, groups of two nodes): MiCS, ``(1, 1, k)`` and ``(1, k, k)`` in bf16 against the same stage over the world in
bf16, bar ``BF16_BAR``; fp16 at the same three points and at the resident point ``(node, W, W)`` with an Inf on one
rank of one group skips that step on every rank (``check_precision``; the resident point bit for bit as fp16
ZeRO-3); the cross-group all-reduce sends fp32 in both (4 bytes an element).
"""

from __future__ import annotations

import pytest
from engine_launch import launch
from partition_workers import resident_sizes

QUANTIZED_BAR = 0.5
BF16_BAR = 1e-2
"""A grouped point against the same stage over the world in bf16 or fp16, by ``||theta - theta_world|| /
||theta_world - theta_0||`` of the fp32 masters: test_precision.py's bar (fp32 sums in another order can flip a
bf16 weight's rounding by one ulp, 2^-8 relative; a few flips move far less than 1% of the update, a real defect
O(1))."""


@pytest.mark.parametrize(
    "world, d, sizes, splits, checkpoints, precision, residents",
    [(4, 2, [2], [[2, 4]], True, 2, [[2, 2, 4]]),
     (8, 4, [4, 2], [[4, 8]], False, 2, [[4, 4, 8], [2, 4, 8], [2, 4, 4]]),
     (8, 2, [2, 4], [[2, 8], [2, 4], [4, 8]], False, 4, [[2, 2, 8], [2, 2, 4], [2, 4, 4], [4, 4, 8]])],
    ids=["world4-2x2", "world8-2x4", "world8-4x2"],
)
def test_grouped_points_match_single_process_training(tmp_path, world, d, sizes, splits, checkpoints, precision,
                                                      residents):
    """Each layout also runs bf16 and fp16 at the grouped points over ``precision`` ranks (``check_precision``),
    ``(1, g, o)`` for each ``(g, o)`` of ``splits`` (``partition_workers.split_cases``: (1, node, world) on each,
    and (1, 2, 4) over two nodes of 2), the first with an Inf on one rank skipping the same step on every rank, and
    the resident point ``(p, W, W)`` (``check_resident``). World 4 also moves checkpoints ZeRO-3 -> ``(node, W, W)``
    -> ZeRO-3, MiCS -> ZeRO-3 -> MiCS, ZeRO-3 -> (1, 1, k), MiCS -> (1, k, k) -> (1, 1, k) -> MiCS, MiCS+qgZ ->
    ZeRO-3 -> MiCS+qgZ and stage 2 -> (1, 2, 4) -> (1, 1, 4) -> stage 3 -> (1, 2, 4) (exact each way) and runs
    ``"partition": "auto"`` over every point the engine runs (``partition_workers.auto_cases``, ``check_auto``).
    Each layout also runs the grouped resident points ``residents`` (``check_grouped_resident``)."""
    results = launch("partition_workers:mics_cases", world, tmp_path, env={"ZEROPP_RANKS_PER_NODE": str(d)},
                     timeout=600, sizes=sizes, root=str(tmp_path), checkpoints=checkpoints, splits=splits,
                     precision=precision, residents=residents)
    check_grouped_resident(results, residents, checkpoints)
    records = [r.pop("p1-g{}-o{}-inf".format(*splits[0])) for r in results]
    assert records == [[False, True, False]] * world, records
    assert all(f"p1-g{g}-o{o}" in results[0] for g, o in splits)
    assert ("resumed_zero3_vs_mics" in results[0]) == checkpoints
    if checkpoints:
        assert "zero_hpz_partition_size: not combined with MiCS" in results[0].pop("refused")
        assert "zero_quantized_gradients: not combined with a grouped stage-1" in results[0].pop("refused-grouped")
        assert results[0].pop("qgz_checkpoints")
        check_auto(results)
    if precision:
        check_precision(results)
    check_resident(results, d, checkpoints)
    assert ("k4-hpz-bit-identical" in results[0]) == (world == 8 and d == 2)  # groups of whole nodes (4 x 2)
    for key in [key for key in results[0] if key.endswith("-hpz-bit-identical")]:
        assert all(r.pop(key) for r in results), key
    for key in [key for key in results[0] if "-bound" in key]:  # the quantized cross-group all-reduce alone
        for r in results:
            bound = r.pop(key)
            assert bound["same"] and 0 < bound["max"] and bound["ratio"] <= 1, (key, bound)
    for key in [key for key in results[0] if key.endswith(("-vs-mics", "-vs-single"))]:
        assert results[0].pop(key) < QUANTIZED_BAR, key
    cases = [key for key in results[0] if key.startswith("s") and not key.endswith("-weights")]
    assert len(cases) == 2 * len(sizes) + 2, cases
    assert {key.split("-")[0] for key in cases} == {"s1", "s2", "s3"}, cases
    for key, errors in results[0].items():
        if key.endswith("-weights"):
            assert all(r[key] == errors for r in results), key  # every rank: the same weights
        elif key.startswith("resumed_"):
            assert errors < 1e-5, (key, errors)
        else:
            assert errors["norm"] < 1e-5 and errors["max"] < 1e-4, (key, errors)


AUTO_PICKS = {"default": (1, 2, 2), "zero3": (4, 4, 4), "mid": (1, 4, 4), "qgz": (2, 2, 2), "hpz": (2, 2, 4),
              "stage2": (1, 2, 2)}
"""``"partition": "auto"``'s picks for the tiny GPT on 2 x 2 (``partition_workers.auto_cases``, which checks each
against the planner's first choice among the runnable points): at 80 GiB ZeRO-2 inside each node's pair (fewest
bytes across nodes, no parameter gathers); with memory only ZeRO-3 fits in, ZeRO-3; with a little more, ZeRO-2; with
qgZ (which the grouped stage-1/2 points refuse) MiCS inside each node; under hpZ (which stages 1, 2 and MiCS inside a
node refuse) the grouped resident point (2, 2, 4), parameters over the hpZ size; stage 2 as a ceiling keeps the
first pick."""


def check_auto(results: list[dict]) -> None:
    """``partition_workers.auto_cases``: the same picks on every rank, ``AUTO_PICKS``, and a memory below every
    point's refused on every rank. Pops what it checks."""
    for name, point in AUTO_PICKS.items():
        assert all(tuple(r.pop(f"auto-{name}")) == point for r in results), name
    for r in results:
        assert "no point at stage 3 or below fits in" in r.pop("auto-refused")


def check_grouped_resident(results: list[dict], residents: list[list[int]], checkpoints: bool) -> None:
    """``partition_workers.grouped_resident_cases``: each grouped resident point ``(p, g, o)`` trained bit for bit
    like ``(1, g, o)`` (``g < o``) or MiCS over ``g`` (``g = o``) on every rank (asserted there, with its byte
    counters against the formula and ``zeropp.plan``, and its memory against ``zeropp.plan.memory``), and
    ``(p, k, k)`` with qwZ and qgZ bit for bit like MiCS over ``k`` with them (its counters against ``zeropp.plan``),
    and ``(2, k, W)`` in bf16 bit for bit like ``(1, k, W)`` in bf16 (``precision_cases``); with
    ``checkpoints``, at the first point an Inf skipped on every rank alike, checkpoints moved ZeRO-3 -> point ->
    MiCS -> point -> ZeRO-3 bit for bit, and qgZ refused; without, at the last point (replicated: ``o`` below the
    world) checkpoints moved point -> ZeRO-3 -> point bit for bit. Pops what it checks."""
    assert all(r.pop("grouped-resident-bf16-bit-identical") for r in results)  # (2, k, W) in bf16
    for point in residents:
        assert all(r.pop("resident-p{}-g{}-o{}".format(*point)) for r in results), point
        if point[1] == point[2]:
            assert all(r.pop("resident-p{}-g{}-o{}-qwz8-qgz4".format(*point)) for r in results), point
    if not checkpoints and residents[-1][2] < len(results):
        assert all(r.pop("resident-replicas-checkpoints") for r in results)
    if checkpoints:
        assert [r.pop("resident-skip") for r in results] == [[False, True, False]] * len(results)
        refused = results[0].pop("refused-grouped-resident")
        assert "zero_quantized_gradients: not combined with zeropp.partition ({}, {}, {})".format(
            *residents[0]) in refused, refused


def check_resident(results: list[dict], d: int, checkpoints: bool) -> None:
    """``partition_workers.resident_cases``: the resident point ``(p, W, W)`` (``p`` the ranks per node, 2 on
    nodes of 4, and 4 = two whole nodes at 4 x 2) trained bit-identically to ZeRO-3 on every rank (asserted there,
    with its byte counters, the planner's and its memory), and its step's exchange bytes across nodes below ZeRO-3's
    forward and backward gathers' (by ``d``: measured 119,104 against 870,656 at 2 x 2); at 2 x 2 also with qwZ and
    qgZ, optimizer offload, bf16, weight deltas and OneBitAdam, each bit for bit against ZeRO-3 with the same
    options; at 4 x 2 a checkpoint moved ``(4, W, W)`` -> ZeRO-3 -> ``(4, W, W)`` bit for bit and qgZ refused
    there. Pops what it checks."""
    world = len(results)
    sizes = resident_sizes(world, d)
    for p in sizes:
        assert all(r.pop(f"resident-{p}-bit-identical") for r in results), p
        for r in results:
            inter, zero3 = r.pop(f"resident-{p}-inter"), r.pop(f"resident-{p}-zero3-inter")
            assert 0 < inter < zero3, (p, inter, zero3)
    if checkpoints:  # and the options it composes with, each against ZeRO-3 with them (resident_combos)
        for name in ("qwz8-qgz4", "offload-cpu", "bf16", "deltas", "onebit"):
            assert all(r.pop(f"resident-{name}-bit-identical") for r in results), name
        assert all(r.pop("resident-checkpoints") for r in results)
        assert "offload_param: not combined with zeropp.partition" in results[0].pop("refused-resident")
    elif 2 * d in sizes:
        assert all(r.pop(f"resident-{2 * d}-checkpoints") for r in results)
        refused = results[0].pop("refused-spanning")
        assert "zero_quantized_gradients: not combined with zeropp.partition (4, 8, 8)" in refused, refused


def check_precision(results: list[dict]) -> None:
    """``partition_workers.precision_cases``: bf16 at MiCS, ``(1, 1, k)``, ``(1, k, k)`` and ``(1, k, W)`` within
    ``BF16_BAR`` of bf16 at the same stage over the world (measured 0, 0, 1.5e-9 and 1.5e-9 at world 4; 1.4e-9, 0
    and 2.1e-9 at 2 x 4; 1.4e-9, 0 and 2.9e-9 at 4 x 2, the last three without ``(1, k, W)``); fp16 under MiCS,
    ``(1, 1, k)`` and ``(1, k, k)`` with an Inf on one rank of one group skips that step (and only it) on every
    rank, halves the loss scale alike, and ends within ``BF16_BAR`` of fp16 ZeRO-3 with the same Inf (measured 0 at
    world 4, 5.4e-9 at 2 x 4, 1.9e-9 at 4 x 2). With the cross-group all-reduce moved after the Inf/NaN check, the
    group without the Inf steps while the other skips, and the workers' every-rank check fails at that step. fp16
    at the resident point ``(node, W, W)`` with the same Inf: the same skipped step and loss scales as fp16 ZeRO-3,
    its slices and states unchanged by the skipped step, and ZeRO-3's fp32 masters bit for bit (checked there).
    Pops what it checks; the caller checks the ``-weights`` sums (every rank alike)."""
    assert all(r.pop("fp16-resident-inf-bit-identical") for r in results)
    for key in [key for key in results[0] if key.startswith("bf16-") and not key.endswith("-weights")]:
        assert results[0].pop(key) < BF16_BAR, key
    fp16 = [key for key in results[0] if key.startswith("fp16-") and not key.endswith("-weights")]
    assert fp16 == ["fp16-s3-inf", "fp16-s1-inf", "fp16-s2-inf"], fp16
    for key in fp16:
        runs = [r.pop(key) for r in results]
        assert all(run["record"] == runs[0]["record"] for run in runs), (key, runs)
        record = runs[0]["record"]
        assert record == runs[0]["zero3_record"] == [(False, 256.0), (True, 128.0), (False, 128.0)], (key, record)
        assert runs[0]["vs_zero3"] < BF16_BAR, (key, runs[0]["vs_zero3"])
