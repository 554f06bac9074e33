"""``zero_optimization.zeropp.rules`` (issue 24, item 4): per-parameter formats, first match wins.

The config checks run in this process. The engine checks are one launch of 2 gloo ranks as 2 emulated nodes of 1
(``rules_workers.rules_runs``), the tiny GPT (no biases) for a few AdamW steps on English text, each rule set
against the exact run of the same stage:

* exact-matched parameters get exactly the exact run's bits in the first step: the weights the first forward
  computes with (all stages: the initial weights, gathered) and, with weights left exact, the reduced gradients of
  the first backward (at 2 ranks the average of two values is the same in any order, so any exact layout gives the
  same bits); the quantized ones within their format's bound: half a step of the block's scale, ``max|x| / (2
  qmax)`` of the parameter's (weights) or of the largest local gradient of any rank (qgZ's two-hop average, one
  rank per node: each rank's gradient quantized once);
* each unit's bytes in the first step equal the formula of its own format (``unit_bytes``), so a split unit costs
  exactly its parts;
* ``rules: []`` and rules giving every parameter exact formats (qwZ and qgZ switched on) are exact ZeRO-3, bit for
  bit (losses and masters);
* stage 2 applies weight rules to the post-step all-gather (the whole parameters: exact ones equal the fp32 master,
  quantized ones within the bound);
* a checkpoint of the mixed run loads into the same rules (masters bit for bit, the next step bit for bit) and into
  exact ZeRO-3 (masters bit for bit);
* a rule taking no parameter is refused at ``initialize``.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine_launch import launch
from zeropp.config import ConfigError, Rule, load_config, to_dict
from zeropp.engine.rules import parameter_formats
from zeropp.quant.format import SUPPORTED_BITS

P, BLOCK = 2, 128
EXACT = r"^(wte|wpe)\.|ln_"  # embeddings and norms (the head is tied to wte)
QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}
# the token embedding (tied head) and the norms exact, the MLPs int4 weights and int8 gradients; the rest (position
# embedding, attention) the global int8 weights and int4 gradients: the root unit and every block are split
MIXED = [{"match": r"^wte\.|ln_", "weight_bits": None, "gradient_bits": None},
         {"match": r"\.mlp\.", "weight_bits": 4, "gradient_bits": 8}]
GRAD_RULES = [{"match": EXACT, "gradient_bits": None}]
RUNS = {
    "exact": {},
    "mixed": {"zero": {**QW, **QG, "zeropp": {"rules": MIXED}}, "save": True},
    "all-null": {"zero": {**QW, **QG, "zeropp": {"rules": [{"match": "", "weight_bits": None,
                                                            "gradient_bits": None}]}}},
    "empty": {"zero": {"zeropp": {"rules": []}}},
    # DeepSpeed's persistence defaults: every unit of the tiny GPT stays whole, gathered once per step in one
    # bucketed all-gather per format
    "mixed-persistent": {"zero": {**QW, **QG, "zeropp": {"rules": MIXED}, "stage3_param_persistence_threshold": 10**5,
                                  "stage3_max_reuse_distance": 10**9}},
    "grads-s3": {"zero": {**QG, "zeropp": {"rules": GRAD_RULES}}},
    "grads-ef": {"zero": {**QG, "zeropp": {"rules": GRAD_RULES, "error_feedback": True}}},
    # wpe frozen: at stage 3 it is gathered with the global int8, in a unit of its own (frozen only)
    "frozen": {"zero": {**QW, "zeropp": {"rules": [{"match": r"^wte\.|ln_", "weight_bits": None}]}},
               "freeze": ["wpe.weight"]},
    "exact-s2": {"stage": 2},
    "grads-s2": {"stage": 2, "zero": {**QG, "zeropp": {"rules": GRAD_RULES}}},
    "weights-s2": {"stage": 2, "zero": {**QW, "zeropp": {"rules": [{"match": EXACT, "weight_bits": None}]}}},
    "exact-s1": {"stage": 1},
    "grads-s1": {"stage": 1, "zero": {**QG, "zeropp": {"rules": GRAD_RULES}}},
}
STEPS = 4


def base(zeropp: dict, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, **zero, "zeropp": zeropp}}


def test_rules_config_resolves_and_round_trips():
    c = load_config(base({"weight_bits": 4, "rules": [{"match": "a", "weight_bits": None}, {"match": "b"},
                                                      {"match": "c", "gradient_bits": 8}]},
                         zero_quantized_weights=True), 1)
    # a left-out key is the global setting: zeropp.weight_bits with qwZ on, exact with qgZ off
    assert c.zero_optimization.zeropp.rules == (Rule("a", None, None), Rule("b", 4, None), Rule("c", 4, 8))
    assert load_config(to_dict(c), 1) == c
    assert load_config(base({"rules": []}), 1) == load_config(base({}), 1)


def test_rules_config_errors():
    with pytest.raises(ConfigError) as e:
        load_config(base({"rules": [{"match": "(x"}, {"mtch": "a"}, {"match": "b", "weight_bits": 3},
                                    {"match": 5}, "c"]}), 1)
    lines = str(e.value).splitlines()
    assert "6 problems" in lines[0]
    assert any("rules[0].match='(x' is not a valid regular expression (re.search): missing )" in x for x in lines)
    assert any("'zero_optimization.zeropp.rules[1].mtch'; did you mean 'match'?" in x for x in lines)
    assert any("rules[1] needs \"match\"" in x for x in lines)
    widths = ", ".join(map(str, SUPPORTED_BITS))
    assert any(f"rules[2].weight_bits=3 must be null (exact) or one of {widths}" in x for x in lines)
    assert any("rules[3].match must be a regular expression" in x for x in lines)
    assert any("rules[4] must be an object" in x for x in lines)
    with pytest.raises(ConfigError, match="rules must be a list"):
        load_config(base({"rules": {"match": "a"}}), 1)


def test_parameter_formats_first_match_wins():
    names = ["wte.weight", "blocks.0.ln_1.weight", "blocks.0.mlp.c_fc.weight"]
    rules = [Rule("ln_", None, None), Rule(r"blocks\.", 4, 8)]
    assert parameter_formats(names, rules, (8, 4)) == [(8, 4), (None, None), (4, 8)]
    with pytest.raises(ConfigError, match=r"rules\[1\] \(match 'ln_1'\) takes no parameter: earlier rules take"):
        parameter_formats(names, [Rule("ln_", None, None), Rule("ln_1", 4, 4)], (8, 4))
    with pytest.raises(ConfigError, match=r"rules\[0\] \(match 'lm_head'\) takes no parameter: no parameter's"):
        parameter_formats(names, [Rule("lm_head", None, None)], (8, 4))


def packed(s: int, bits: int) -> int:
    return s * bits // 8 + 4 * (s // BLOCK)


def unit_bytes(unit: dict, stage: int) -> dict[str, int]:
    """Cross-node bytes of one unit in one step (2 nodes of 1 rank; every stage-3 unit gathered for its forward and,
    but the root, again for its backward; stages 1-2 gather once, after the step)."""
    s, f, (w, g) = unit["shard"], unit["frozen_shard"], unit["bits"]
    gathers = (1 + (unit["name"] != "")) if stage == 3 else 1
    return {"all_gather": gathers * (P - 1) * sum(packed(x, w) if w else 4 * x for x in (s, f)),
            "reduce_scatter": (P - 1) * (packed(s, g) if g else 4 * s)}


def within(got: torch.Tensor, want: torch.Tensor, amax: float, bits: int) -> bool:
    qmax = (1 << (bits - 1)) - 1
    return bool((got - want).abs().max() <= 1.01 * amax / (2 * qmax))


def test_rules_in_the_engine(tmp_path):
    results = launch("rules_workers:rules_runs", P, tmp_path, env={"ZEROPP_RANKS_PER_NODE": "1"}, timeout=300,
                     runs=RUNS, steps=STEPS, ckpt=str(tmp_path / "ckpt"))
    res = results[0]
    runs, grad_max = res["runs"], res["grad_max"]
    exact = runs["exact"]
    assert exact["losses"][0] - exact["losses"][-1] > 0.5, exact["losses"]  # the job learns

    # the mixed rule set: unit parts by format, weights bit-exact where exact, bounded elsewhere, bytes per part
    mixed = runs["mixed"]
    formats = {name: u["bits"] for u in mixed["units"] for name in u["params"]}
    assert formats["wte.weight"] == formats["ln_f.weight"] == formats["blocks.1.ln_2.weight"] == (None, None)
    assert formats["blocks.0.mlp.c_fc.weight"] == (4, 8)
    assert formats["wpe.weight"] == formats["blocks.0.attn.c_attn.weight"] == (8, 4)
    assert len(mixed["units"]) == 8  # the root split two ways, each block three ways
    for name, w in mixed["weights"].items():
        want = exact["weights"][name]
        bits = formats[name][0]
        if bits is None:
            assert torch.equal(w, want), name
        else:
            assert not torch.equal(w, want) and within(w, want, want.abs().max().item(), bits), name
    want = {k: sum(unit_bytes(u, 3)[k] for u in mixed["units"]) for k in ("all_gather", "reduce_scatter")}
    assert {k: mixed["traffic"][k]["sent_inter"] for k in want} == want
    for got, ref in zip(mixed["losses"], exact["losses"]):
        assert abs(got - ref) <= 0.01 * ref, (mixed["losses"], exact["losses"])

    persistent = runs["mixed-persistent"]
    assert all(torch.equal(w, mixed["weights"][n]) for n, w in persistent["weights"].items())
    assert persistent["traffic"]["all_gather"]["calls"] == 3  # exact, int8 and int4 weights
    assert persistent["traffic"]["all_gather"]["sent_inter"] == sum(
        unit_bytes({**u, "name": ""}, 3)["all_gather"] for u in persistent["units"])  # each gathered once
    for got, ref in zip(persistent["losses"], exact["losses"]):
        assert abs(got - ref) <= 0.01 * ref, (persistent["losses"], exact["losses"])

    # gradient rules at every stage: exact-matched reduced gradients bit for bit, quantized ones bounded
    for name, stage, ref in (("grads-s3", 3, exact), ("grads-ef", 3, exact), ("grads-s2", 2, runs["exact-s2"]),
                             ("grads-s1", 1, runs["exact-s1"])):
        got = runs[name]
        fmts = {name: u["bits"] for u in got["units"] for name in u["params"]}
        assert got["weights"] == {} or all(torch.equal(got["weights"][n], ref["weights"][n]) for n in got["weights"])
        for pname, g in got["grads"].items():
            bits = fmts[pname][1]
            if bits is None:
                assert torch.equal(g, ref["grads"][pname]), (name, pname)
            else:
                assert not torch.equal(g, ref["grads"][pname]), (name, pname)
                assert within(g, ref["grads"][pname], grad_max[pname], bits), (name, pname)
        want = {k: sum(unit_bytes(u, stage)[k] for u in got["units"]) for k in ("all_gather", "reduce_scatter")}
        assert {k: got["traffic"][k]["sent_inter"] for k in want} == want, name

    # a frozen parameter takes its rule's weight format (here the global int8) in a unit of its own
    frozen = runs["frozen"]
    part = next(u for u in frozen["units"] if u["frozen"])
    assert part["frozen"] == ["wpe.weight"] and not part["params"] and part["bits"] == (8, None)
    for name, w in frozen["weights"].items():
        want = exact["weights"][name]
        if re.search(r"^wte\.|ln_", name):
            assert torch.equal(w, want), name
        else:
            assert not torch.equal(w, want) and within(w, want, want.abs().max().item(), 8), name
    want = {k: sum(unit_bytes(u, 3)[k] for u in frozen["units"]) for k in ("all_gather", "reduce_scatter")}
    assert {k: frozen["traffic"][k]["sent_inter"] for k in want} == want

    # stage 2, weight rules: the post-step gather is exact for exact-matched parameters
    w2 = runs["weights-s2"]
    for name, p in w2["whole_params"].items():
        master = w2["masters"][name]
        if re.search(EXACT, name):
            assert torch.equal(p, master), name
        else:
            assert not torch.equal(p, master) and within(p, master, master.abs().max().item(), 8), name

    # no rules / all exact: exact ZeRO-3 bit for bit
    for name in ("all-null", "empty"):
        assert runs[name]["losses"] == exact["losses"], name
        assert all(torch.equal(runs[name]["masters"][n], m) for n, m in exact["masters"].items()), name

    # checkpoints: the same rules continue bit for bit; exact ZeRO-3 loads the same masters
    loads = res["loads"]
    for label in ("same", "exact"):
        assert all(torch.equal(loads[label]["masters"][n], m) for n, m in mixed["at_save"].items()), label
    assert all(torch.equal(loads["same"]["masters_after"][n], m) for n, m in mixed["masters"].items())

    errors = res["errors"]
    assert "rules[0] (match '^nothing_here') takes no parameter" in errors["no_match"]
    assert "rules[1] (match 'ln_1') takes no parameter: earlier rules take" in errors["shadowed"]
