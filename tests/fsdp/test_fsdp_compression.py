"""zeropp.fsdp's wider compression on real gloo processes (4 ranks, 2 emulated nodes of 2), one launch:

* qgZ bits per hop (``gradient_bits_intra``) and int2 gradients: the reduce-scatter hook is bit-identical to the
  in-process composition of the format's steps, and its bytes per hop equal the formula, also through ``enable``;
* weight deltas on hpZ: every holder's secondary equals the owner's reconstruction bit for bit, the error stays
  within half a delta step, the forward gathers move no cross-node bytes after the first, the exchanges equal the
  formula, training tracks plain FSDP2 with hpZ, and a refresh is exact;
* per-parameter rules: exact parts bit-identical to plain FSDP2, quantized weights bit-identical to each
  parameter's shard quantized alone (so within half a step of its block scale), quantized gradients within the
  qgZ bound, bytes equal to the sum of each part's formula; a rule set giving every parameter the global formats
  changes nothing; misuse refused with messages naming the fix.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from compression_workers import BLOCK, DELTA_BITS, DELTA_STEPS, GRADIENT_RULES, HOP_CASES, HOP_SHARD, HPZ, WEIGHT_RULES
from fsdp_launch import launch
from fsdp_workers import varied_gpt
from gpt_units import gpt_units, padded_shard_numel

from zeropp.fsdp.reduce_scatter import check_error_feedback
from zeropp.quant import BlockFormat

WORLD, D, N = 4, 2, 2  # ranks, ranks per node, nodes
ENV = {"ZEROPP_RANKS_PER_NODE": str(D)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("compression_workers:all_runs", WORLD, tmp_path_factory.mktemp("compression"), env=ENV,
                  timeout=600)


def _format(name: str, rules: list[dict], key: str, default: int | None) -> int | None:
    """The tests' own reading of the rules: the first rule whose pattern is found in the name, else the default."""
    for rule in rules:
        if re.search(rule["match"], name):
            return rule.get(key, default)
    return default


def _padded_shards(p: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's zero-padded dim-0 shard of ``p``, flat."""
    rows = math.ceil(p.shape[0] / WORLD)
    padded = torch.zeros(rows * WORLD, *p.shape[1:], dtype=p.dtype)
    padded[: p.shape[0]] = p
    return [chunk.reshape(-1) for chunk in padded.chunk(WORLD)]


def _units_numel(rules: list[dict], key: str, default: int | None) -> list[dict[int | None, int]]:
    """Per FSDP2 unit of the GPT, the per-rank elements of each format's part."""
    out = []
    for unit in gpt_units(varied_gpt()):
        part: dict[int | None, int] = {}
        for name, p in unit:
            bits = _format(name, rules, key, default)
            part[bits] = part.get(bits, 0) + padded_shard_numel(p, WORLD)
        out.append(part)
    return out


def _weight_part_bytes(bits: int | None, segments: list[int]) -> int:
    """Bytes one rank sends per peer for a weight part: exact fp32, or each segment staged at a block boundary."""
    if bits is None:
        return 4 * sum(segments)
    staged = sum(math.ceil(s / BLOCK) * BLOCK for s in segments[:-1]) + segments[-1]
    return BlockFormat(bits, BLOCK).packed_bytes(staged)


# ---- bits per hop -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,intra", HOP_CASES)
def test_hop_bits_hook_bit_identical_to_composition(runs: list[dict], bits: int, intra: int | None) -> None:
    b1 = BlockFormat(intra or bits, BLOCK).packed_bytes(HOP_SHARD)
    b2 = BlockFormat(bits, BLOCK).packed_bytes(HOP_SHARD)
    for r in runs:
        case = r["hops"][bits, intra]
        assert torch.equal(case["got"], case["expect"]), float((case["got"] - case["expect"]).abs().max())
        st = case["stats"]
        assert (st["sent_intra"], st["sent_inter"]) == ((D - 1) * N * b1, (N - 1) * b2)
        assert (st["recv_intra"], st["recv_inter"]) == ((D - 1) * N * b1, (N - 1) * b2)


def test_hop_bits_through_enable_bytes_equal_formula(runs: list[dict]) -> None:
    widths = [sum(padded_shard_numel(p, WORLD) for _, p in unit) for unit in gpt_units(varied_gpt())]
    f1, f2 = BlockFormat(8, BLOCK), BlockFormat(4, BLOCK)
    for r in runs:
        st = r["hops"]["enable"]
        assert st["calls"] == len(widths)
        assert st["sent_intra"] == sum((D - 1) * N * f1.packed_bytes(s) for s in widths)
        assert st["sent_inter"] == sum((N - 1) * f2.packed_bytes(s) for s in widths)


def test_stochastic_rounding_and_loco_pass_through_to_comm(runs: list[dict]) -> None:
    """``ZeroppReduceScatter(stochastic_rounding=True, seed=...)`` gives each call its own seed and equals
    ``comm.reduce_scatter`` with that seed (tested against the seeded composition and for unbiasedness in
    tests/comm/test_qgz_options.py); ``error_feedback="loco"`` equals ``comm.reduce_scatter`` fed one LoCo store,
    residuals included, at 1 + 4/BLOCK bytes per element; through ``enable`` neither changes the bytes."""
    for r in runs:
        o = r["hops"]["options"]
        for call in (1, 2):
            got, expect = o[f"sr{call}"]
            assert torch.equal(got, expect)
        assert torch.equal(o["sr_again"], o["sr1"][0])                 # the same seed reproduces
        assert not torch.equal(o["sr1"][0], o["sr2"][0])               # each call its own noise
        assert not torch.equal(o["sr1"][0], o["rtn"])                  # not round-to-nearest
        for got, expect in o["loco"]:
            assert torch.equal(got, expect)
        store, dtype, nbytes, ref_nbytes, numels, same = o["loco_store"]
        assert (store, dtype, same, nbytes) == ("loco", torch.uint8, True, ref_nbytes)
        assert nbytes <= sum(numels) * (1 + 4 / BLOCK) + 8 * BLOCK    # padding of each slice's last block
        assert r["hops"]["enable_options"] == r["hops"]["enable"]


def test_error_feedback_beta_needs_loco() -> None:
    """As the config refuses ``zeropp.error_feedback_beta`` without ``"loco"``, so does ``zeropp.fsdp``."""
    check_error_feedback("loco", 4, 0.25)
    check_error_feedback(True, 4)
    for ef in (True, False):
        with pytest.raises(ValueError, match="error_feedback_beta=0.25 is LoCo's moving-average coefficient"):
            check_error_feedback(ef, 4, 0.25)


# ---- per-parameter rules ------------------------------------------------------------------------------------


def test_weight_rules_exact_parts_bit_identical_quantized_parts_bounded(runs: list[dict]) -> None:
    model = varied_gpt()
    params = dict(model.named_parameters())
    checked = {None: 0, 8: 0, 4: 0}
    for r in runs:
        plain, got = r["rules"]["plain"]["weights"], r["rules"]["weights"]["weights"]
        assert plain.keys() == got.keys() and "lm_head.weight" in got
        for name, w in got.items():
            key = "wte.weight" if name == "lm_head.weight" else name
            bits = _format(key, WEIGHT_RULES, "weight_bits", 8)
            checked[bits] += 1
            if bits is None:
                assert torch.equal(w, plain[name]), name
                continue
            assert torch.equal(plain[name], params[key].detach()), name  # plain FSDP2 gathers the exact weights
            fmt = BlockFormat(bits, BLOCK)
            for shard, mine in zip(_padded_shards(params[key].detach()), _padded_shards(w)):
                blocks = torch.nn.functional.pad(shard, (0, -shard.numel() % BLOCK)).view(-1, BLOCK)
                bound = (blocks.abs().amax(1) / fmt.qmax / 2).repeat_interleave(BLOCK)[: shard.numel()]
                err = (mine - shard).abs()
                assert (err <= bound * (1 + 1e-6)).all(), name
                assert err.max() > 0, name  # quantized, not passed through
    assert all(checked.values()), checked


def test_weight_rules_bytes_equal_sum_of_parts(runs: list[dict]) -> None:
    model = varied_gpt()
    calls = inter = 0
    for unit in gpt_units(model):
        parts: dict[int | None, list[int]] = {}
        for name, p in unit:
            parts.setdefault(_format(name, WEIGHT_RULES, "weight_bits", 8), []).append(padded_shard_numel(p, WORLD))
        calls += len(parts)
        inter += sum((WORLD - D) * _weight_part_bytes(bits, segs) for bits, segs in parts.items())
    for r in runs:
        st = r["rules"]["weights"]["all_gather"]
        assert (st["calls"], st["sent_inter"], st["recv_inter"]) == (calls, inter, inter)


def test_gradient_rules_exact_parts_bit_identical_quantized_parts_bounded(runs: list[dict]) -> None:
    local = [r["rules"]["local"] for r in runs]
    exact_mean = {n: sum(g[n].double() for g in local) / WORLD for n in local[0]}
    for r in runs:
        plain, got = r["rules"]["plain"]["grads"], r["rules"]["grads"]["grads"]
        assert plain.keys() == got.keys()
        for name, g in got.items():
            bits = _format(name, GRADIENT_RULES, "gradient_bits", 4)
            if bits is None:
                assert torch.equal(g, plain[name]), name
                continue
            # qgZ's bound, loosened to the part's largest local gradient A: every rank's hop-1 error is at most
            # A / (2 qmax) and a node's partial sum's requantization at most D A / (2 qmax), summed and averaged
            qmax = BlockFormat(bits, BLOCK).qmax
            a = max(float(x[n].abs().max()) for x in local for n in x
                    if _format(n, GRADIENT_RULES, "gradient_bits", 4) == bits)
            bound = (WORLD * a / (2 * qmax) + N * D * a / (2 * qmax)) / WORLD
            err = float((g.double() - exact_mean[name]).abs().max())
            assert 0 < err <= bound * 1.01, (name, err, bound)
            assert float((plain[name].double() - exact_mean[name]).abs().max()) < 1e-3 * bound  # reference sane


def test_gradient_rules_bytes_equal_sum_of_parts(runs: list[dict]) -> None:
    calls = intra = inter = 0
    for part in _units_numel(GRADIENT_RULES, "gradient_bits", 4):
        calls += len(part)
        for bits, s in part.items():
            if bits is None:  # an exact fp32 reduce-scatter: counted like an all-gather of its slice
                intra += (D - 1) * 4 * s
                inter += (WORLD - D) * 4 * s
            else:
                b = BlockFormat(bits, BLOCK).packed_bytes(s)
                intra += (D - 1) * N * b
                inter += (N - 1) * b
    for r in runs:
        st = r["rules"]["grads"]["reduce_scatter"]
        assert (st["calls"], st["sent_intra"], st["sent_inter"]) == (calls, intra, inter)


def test_gradient_rules_with_error_feedback_and_hop_bits(runs: list[dict]) -> None:
    """Error feedback per quantized part: the second backward on the same batch and weights adds the first one's
    residuals back (so its gradients differ from the first's) while the exact parts stay plain FSDP2's."""
    for r in runs:
        first, second = r["rules"]["ef"]
        plain = r["rules"]["plain"]["grads"]
        for name in plain:
            if _format(name, GRADIENT_RULES, "gradient_bits", 4) is None:
                assert torch.equal(first["grads"][name], plain[name]) and torch.equal(second["grads"][name],
                                                                                      plain[name]), name
        assert any(not torch.equal(first["grads"][n], second["grads"][n]) for n in plain
                   if _format(n, GRADIENT_RULES, "gradient_bits", 4) is not None)


def test_rules_giving_the_global_formats_change_nothing(runs: list[dict]) -> None:
    for r in runs:
        a, b = r["rules"]["global_rule"], r["rules"]["global"]
        assert a["loss"] == b["loss"] and a["all_gather"] == b["all_gather"]
        assert a["reduce_scatter"] == b["reduce_scatter"]
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def test_misuse_refused_naming_the_fix(runs: list[dict]) -> None:
    for r in runs:
        m = r["misuse"]
        assert "ConfigError: rules[0] (match '^lm_head_typo') takes no parameter" in m["no_param"]
        assert "rules[1] (match 'ln_1') takes no parameter: earlier rules take every parameter" in m["shadowed"]
        assert "weight_bits=3 must be null (exact) or one of 8, 4, 2" in m["bad_bits"]
        assert "gradient_bits_intra=8 needs quantized gradients" in m["intra_exact"]
        assert "gradient_bits=3 is not supported; use 8, 4, 2 or None" in m["bits3"]
        assert "some of them got no gradient this backward" in m["no_grad"]
        assert "trunk.weight" in m["no_grad"] and "own fully_shard" in m["no_grad"]
        assert "weight_deltas=True needs hpz=N" in m["deltas_no_hpz"]


# ---- weight deltas ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deltas(runs: list[dict]) -> list[dict]:
    return [r["deltas"] for r in runs]


def _unit_widths() -> list[int]:
    """Per-rank elements of each unit's flat shard, in gpt_units' order."""
    return [sum(padded_shard_numel(p, WORLD) for _, p in unit) for unit in gpt_units(varied_gpt())]


def test_weight_deltas_holders_equal_owner_reconstruction_bit_for_bit(deltas: list[dict]) -> None:
    group = WORLD // HPZ
    widths = _unit_widths()
    for step in (1, DELTA_STEPS - 1):
        held = [r["deltas"]["held"][step] for r in deltas]
        for u, n in enumerate(widths):
            for m in range(WORLD):
                secondary, reconstruction, resident = held[m][u]
                assert secondary.numel() == group * n and reconstruction.numel() == n
                assert resident == (group + 1) * n * 4  # fp32 compute dtype
                for k in range(group):
                    owner = m % HPZ * group + k
                    assert torch.equal(secondary[k * n:(k + 1) * n], held[owner][u][1]), (step, u, m, owner)


def test_weight_deltas_error_within_half_a_step(deltas: list[dict]) -> None:
    for r in deltas:
        d = r["deltas"]
        assert d["excess"][0] == [0.0] * 3  # the exact refresh: the reconstruction is the weights
        for step in range(1, DELTA_STEPS):
            assert all(e <= 0 for e in d["excess"][step]), (step, d["excess"][step])
            assert all(e > 0 for e in d["err"][step]), step  # the weights changed and were quantized


def test_weight_deltas_bytes(deltas: list[dict]) -> None:
    group = WORLD // HPZ
    pack = sum(BlockFormat(DELTA_BITS, BLOCK).packed_bytes(n) for n in _unit_widths())
    for m, r in enumerate(deltas):
        d = r["deltas"]
        assert d["fwd"][0]["sent_inter"] > 0 and d["exchange"][0]["calls"] == 0  # the first forward: refresh
        holders = [j for j in range(WORLD) if j % HPZ == m // group and j != m]
        cross = sum(1 for j in holders if j // D != m // D)
        local = len(holders) - cross
        assert cross == (WORLD - D) // HPZ
        for step in range(1, DELTA_STEPS):
            fwd, ex, bwd = d["fwd"][step], d["exchange"][step], d["bwd"][step]
            assert fwd["calls"] == 3 and fwd["sent_inter"] == fwd["recv_inter"] == 0 and fwd["sent_intra"] > 0
            assert bwd["sent_inter"] == bwd["recv_inter"] == 0
            assert ex["calls"] == 3 and (ex["sent_inter"], ex["sent_intra"]) == (cross * pack, local * pack)


def test_weight_deltas_train_like_plain_hpz_and_refresh_exactly(deltas: list[dict]) -> None:
    for r in deltas:
        plain, got = r["plain"]["losses"], r["deltas"]["losses"]
        assert got[0] == plain[0]  # the first forward gathers exactly
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(got, plain)), (got, plain)
        assert got != plain  # the deltas are quantized
        refresh = r["deltas"]["refresh"]
        assert refresh["exact"] and refresh["exchange"]["calls"] == 0 and refresh["fwd"]["sent_inter"] > 0
