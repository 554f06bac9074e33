"""Full ZeRO++ under FSDP2 converges like plain FSDP2 and cuts its cross-node bytes (issue 13, test 2).

One launched job on 4 gloo ranks as 2 emulated nodes of 2 (``ZEROPP_RANKS_PER_NODE=2``) trains the tiny GPT
(``fully_shard`` per block, then the root) 100 AdamW steps (lr 1e-3, weight decay 0.1, clipping 1.0) on random
32-byte crops of the stdlib sources (``zeropp.data``, global batch 16), twice from the same weights and data:
FSDP2 under ``zeropp.fsdp.enable`` with exact comms (bit-identical to plain FSDP2: tests/fsdp/test_fsdp_comms.py,
and byte-counted, which torch's own collectives are not), then full ZeRO++: qwZ int8, hpZ through
``reshard_after_forward=2`` (backward re-gathers inside the node, exactly), qgZ int4, block 128.

The bytes are checked twice: the counters against the formula from ``BlockFormat.packed_bytes`` and each FSDP2
unit's parameter shards (``s_i`` elements each, ``n = sum s_i``; fp32, 2 of the 4 ranks on the other node), per
rank and step:

* exact: every block all-gathered in forward and again in backward, the root (not resharded after forward) once:
  ``2 * 4n`` bytes across per gather; reduce-scatter ``2 * 4n`` (the two cross-node peers' slices);
* full: one int8 forward gather per unit, ``2 * sum packed8(s_i)`` (a pack per parameter shard: qwZ blocks never
  span two parameters; the backward gathers stay in the node); qgZ's hop 2 sends one int4 pack of the node-reduced
  slice to the other node, ``packed4(n)``.

Measured (torch 2.13 CPU, 2-core box at load average ~20): eval loss exact 2.6323, ZeRO++ 2.6392 (+0.26%); last-10
training loss 2.7130 and 2.7311 (+0.67%), from 5.5 (ln 256); bounds: eval 1%, last-10 1.5%. At 200 steps (the
file's first version, twice the time, bound 2% on both) the gaps were alike: eval 2.4018 and 2.4121 (+0.43%),
last-10 2.3090 and 2.3213 (+0.54%). The bounds are tighter than 200 steps' because a quantizer's bias shows less in
fewer steps: codes rounded down instead of to nearest (``floor_`` in ``reference.quantize_blocks``' code rounding) put
ZeRO++ +2.2% (eval) and +2.5% (last-10) above exact here at 100 steps (the engine's twin test: +3.8% and +3.6% at
200 steps, +1.7% and +1.9% at 100).

Cross-node bytes 0.1204x exact's, the formula's value exactly (0.1153x when qwZ's blocks were cut from the flat
input: per-parameter blocks pad this model's many 16-element shards); bound 0.27. Training 16 s + 27 s at that load
(AdamW ``fused=True``: the per-parameter DTensor loop of the default CPU AdamW cost ~20% more).
"""

from __future__ import annotations

import math
import time

from fsdp_launch import launch

from zeropp.quant import BlockFormat

STEPS = 100
EVAL_BOUND, LAST10_BOUND = 0.01, 0.015  # relative gaps to plain FSDP2, see the docstring


def expected_inter_bytes(units: list[list[int]], full: bool) -> dict[str, int]:
    """Cross-node bytes one rank sends per step (all-gather, reduce-scatter) for FSDP2 units whose parameter shards
    have ``units[u]`` elements each (blocks first, the root last), 4 ranks as 2 nodes of 2, fp32."""
    fmt8, fmt4 = BlockFormat(8, 128), BlockFormat(4, 128)
    other_node = 2
    if full:
        return {"all_gather": sum(other_node * sum(fmt8.packed_bytes(s) for s in unit) for unit in units),
                "reduce_scatter": sum(fmt4.packed_bytes(sum(unit)) for unit in units)}
    gathers = [2] * (len(units) - 1) + [1]  # blocks: forward and backward; the root stays gathered for backward
    return {"all_gather": sum(g * other_node * 4 * sum(unit) for g, unit in zip(gathers, units)),
            "reduce_scatter": sum(other_node * 4 * sum(unit) for unit in units)}


def test_full_zeropp_within_1_percent_of_fsdp2_and_under_027_of_its_bytes(tmp_path):
    start = time.perf_counter()
    results = launch("fsdp_convergence_workers:exact_vs_zeropp", 4, tmp_path, env={"ZEROPP_RANKS_PER_NODE": "2"},
                     timeout=600, steps=STEPS)
    wall = time.perf_counter() - start
    for r in results[1:]:  # losses are averaged over the ranks: every rank reports the same numbers
        assert all(r[k]["losses"] == results[0][k]["losses"] and r[k]["eval"] == results[0][k]["eval"]
                   for k in ("exact", "zeropp"))
    exact, zpp = results[0]["exact"], results[0]["zeropp"]
    assert len(exact["losses"]) == len(zpp["losses"]) == STEPS
    # the same start (ln 256 up to the initialisation; qwZ's int8 weights change the first loss a little only)
    assert abs(exact["losses"][0] - math.log(256)) < 0.2 and abs(zpp["losses"][0] - exact["losses"][0]) < 2e-3
    last = {name: sum(run["losses"][-10:]) / 10 for name, run in (("exact", exact), ("zeropp", zpp))}
    summary = (f"eval exact {exact['eval']:.4f} zeropp {zpp['eval']:.4f}; last-10 {last}; training s "
               f"{exact['seconds']:.1f} + {zpp['seconds']:.1f}; launch wall {wall:.1f} s")
    assert exact["eval"] < 0.6 * math.log(256) and last["exact"] < 0.6 * math.log(256), summary  # it learns
    assert abs(zpp["eval"] - exact["eval"]) <= EVAL_BOUND * exact["eval"], summary
    assert abs(last["zeropp"] - last["exact"]) <= LAST10_BOUND * last["exact"], summary

    for r in results:
        assert r["exact"]["units"] == results[0]["exact"]["units"] == r["zeropp"]["units"]
        for name, full in (("exact", False), ("zeropp", True)):
            want = expected_inter_bytes(r[name]["units"], full)
            for kind in ("all_gather", "reduce_scatter"):
                assert r[name]["stats"][kind]["sent_inter"] == STEPS * want[kind], (name, kind, r[name]["stats"])
        # hpZ: the backward gathers stay in the node (the formula's full case counts none across); the root, resharded
        # to the node after forward too, adds one (in-node) backward gather per step
        assert r["zeropp"]["stats"]["all_gather"]["calls"] == r["exact"]["stats"]["all_gather"]["calls"] + STEPS
        assert r["zeropp"]["stats"]["all_gather"]["sent_intra"] > r["exact"]["stats"]["all_gather"]["sent_intra"]
    sent = {name: sum(results[0][name]["stats"][k]["sent_inter"] for k in ("all_gather", "reduce_scatter"))
            for name in ("exact", "zeropp")}
    units = results[0]["exact"]["units"]
    formula = sum(expected_inter_bytes(units, True).values()) / sum(expected_inter_bytes(units, False).values())
    ratio = sent["zeropp"] / sent["exact"]
    assert ratio == formula and ratio <= 0.27, (ratio, formula, summary)
    print(f"cross-node bytes ratio {ratio:.4f}; {summary}")
