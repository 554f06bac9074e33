"""FSDP2 features under zeropp.fsdp comms, on real gloo processes (4 ranks, 2 emulated nodes of 2), each against
plain FSDP2 doing the same: MixedPrecisionPolicy (bf16 params with fp32 or bf16 reduce, fp16 params and reduce), gradient
accumulation with set_requires_gradient_sync, and DCP checkpoints saved under one set of comms and loaded under
the other. One launch runs every scenario."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from feature_workers import ACCUM_STEPS, DCP_STEPS, MICRO_BATCHES, MP_STEPS, POLICIES
from fsdp_launch import launch
from gpt_units import gpt_unit_segments

from zeropp.models import GPT, GPTConfig
from zeropp.quant import DEFAULT_BLOCK_SIZE, BlockFormat

WORLD = 4
INTER_PEERS = 2  # ranks on the other node, for every rank (2 nodes of 2)
ENV = {"ZEROPP_RANKS_PER_NODE": "2"}
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp_features")
    return launch("feature_workers:features", WORLD, tmp, env=ENV, timeout=300, ckpt_dir=str(tmp / "ckpt"))


def _same(a: Any, b: Any) -> bool:
    """Exact equality of nested state (dicts, lists, tensors bit for bit, other values by ==)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _close(losses: list[float], reference: list[float]) -> bool:
    return len(losses) == len(reference) and all(abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(losses, reference))


def _unit_segments() -> dict[int, list[int]]:
    """Each FSDP2 unit of the tiny GPT (a block; the root: the rest, the tied ``lm_head`` once) by its all-gather
    input's numel: the elements of every parameter's zero-padded dim-0 shard on one rank, in ``named_parameters``'
    order (FSDP2's post-order walk, for a model whose parameters all sit in leaf modules)."""
    by_numel = {sum(u): u for u in gpt_unit_segments(GPT(GPTConfig.preset("tiny"), seed=0), WORLD)}
    assert len(by_numel) == 2  # the blocks alike, the root another size: the numel names the unit
    return by_numel


def _initial() -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in GPT(GPTConfig.preset("tiny"), seed=0).named_parameters()}


# ---- mixed precision ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_precision_exact_comms_bit_identical_to_plain(runs: list[dict], policy: str) -> None:
    initial = _initial()
    for r in runs:
        plain, exact = r["mixed_precision"][policy, "plain"], r["mixed_precision"][policy, "exact"]
        assert len(plain["losses"]) == MP_STEPS
        assert exact["losses"] == plain["losses"]
        assert _same(exact["params"], plain["params"])
        assert not torch.equal(plain["params"]["blocks.0.mlp.c_fc.weight"], initial["blocks.0.mlp.c_fc.weight"])
        assert all(p.dtype == torch.float32 for p in plain["params"].values())  # sharded params stay fp32


def test_mixed_precision_policies_differ(runs: list[dict]) -> None:
    """The reduce dtype matters here, so bit-identity above shows zeropp honours it (bf16 sums are not fp32's)."""
    mp = runs[0]["mixed_precision"]
    assert not _same(mp["bf16-fp32", "plain"]["params"], mp["bf16-bf16", "plain"]["params"])


@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_precision_quantized_comms_close_to_plain(runs: list[dict], policy: str) -> None:
    for r in runs:
        plain, quant = r["mixed_precision"][policy, "plain"], r["mixed_precision"][policy, "quantized"]
        # the quantized path ran (bf16 losses are too coarse to differ in MP_STEPS steps; the parameters do)
        assert not _same(quant["params"], plain["params"])
        assert _close(quant["losses"], plain["losses"]), (quant["losses"], plain["losses"])


@pytest.mark.parametrize("policy", POLICIES)
def test_what_fsdp2_passes_the_hooks(runs: list[dict], policy: str) -> None:
    """All-gather: flat input and output in param_dtype, output P times the input. Reduce-scatter: flat input and
    output in reduce_dtype, op AVG for fp32/bf16 and SUM for fp16 (FSDP2 divides before and after itself), the
    input the size of a module's full all-gather output."""
    param_dtype, reduce_dtype = POLICIES[policy]
    op = "RedOpType.SUM" if reduce_dtype == torch.float16 else "RedOpType.AVG"
    for r in runs:
        for comms in ("exact", "quantized"):
            seen = r["mixed_precision"][policy, comms]["seen"]
            gathers = set(seen["all_gather"])
            assert {(i, o, p) for i, o, _, p in gathers} == {(str(param_dtype), str(param_dtype), WORLD)}
            reduces = set(seen["reduce_scatter"])
            assert {(i, o, p) for i, o, _, p in reduces} == {(str(reduce_dtype), str(reduce_dtype), op)}
            assert {n * WORLD for _, _, n, _ in gathers} == {n for _, _, n, _ in reduces}
            assert len(seen["reduce_scatter"]) == MP_STEPS * (GPTConfig.preset("tiny").n_layer + 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_byte_counters_count_the_dtype_on_the_wire(runs: list[dict], policy: str) -> None:
    """Exact: each call's elements times their size in the hook's dtype; qwZ: packed int8 bytes of each of the
    call's parameter shards (a pack each, whatever the dtype); qgZ: independent of the reduce dtype."""
    fmt8 = BlockFormat(8, DEFAULT_BLOCK_SIZE)
    units = _unit_segments()
    for r in runs:
        mp = r["mixed_precision"]
        exact, quant = mp[policy, "exact"], mp[policy, "quantized"]
        gathers = exact["seen"]["all_gather"]
        size = torch.tensor([], dtype=POLICIES[policy][0]).element_size()
        assert exact["stats"]["all_gather"]["sent_inter"] == sum(INTER_PEERS * n * size for _, _, n, _ in gathers)
        reduces = exact["seen"]["reduce_scatter"]
        rsize = torch.tensor([], dtype=POLICIES[policy][1]).element_size()
        assert exact["stats"]["reduce_scatter"]["sent_inter"] == sum(
            INTER_PEERS * n // WORLD * rsize for _, _, n, _ in reduces
        )
        assert quant["stats"]["all_gather"]["sent_inter"] == sum(
            INTER_PEERS * sum(fmt8.packed_bytes(s) for s in units[n]) for _, _, n, _ in quant["seen"]["all_gather"]
        )
        assert quant["stats"]["reduce_scatter"] == mp["bf16-fp32", "quantized"]["stats"]["reduce_scatter"]


# ---- gradient accumulation ------------------------------------------------------------------------------------


def test_accumulation_exact_comms_bit_identical_to_plain(runs: list[dict]) -> None:
    initial = _initial()
    for r in runs:
        plain, exact = r["accumulation"]["plain"], r["accumulation"]["exact"]
        assert len(plain["losses"]) == ACCUM_STEPS * MICRO_BATCHES
        assert exact["losses"] == plain["losses"]
        assert _same(exact["params"], plain["params"])
        assert not torch.equal(plain["params"]["blocks.1.attn.c_attn.weight"], initial["blocks.1.attn.c_attn.weight"])


def test_accumulation_quantized_comms_close_to_plain(runs: list[dict]) -> None:
    for r in runs:
        plain, quant = r["accumulation"]["plain"], r["accumulation"]["quantized"]
        assert quant["losses"] != plain["losses"]
        assert _close(quant["losses"], plain["losses"]), (quant["losses"], plain["losses"])


@pytest.mark.parametrize("comms", ["exact", "quantized"])
def test_accumulation_reduce_scatters_only_on_sync_micro_batches(runs: list[dict], comms: str) -> None:
    modules = GPTConfig.preset("tiny").n_layer + 1  # fully_shard per block, and the root
    for r in runs:
        calls = r["accumulation"][comms]["calls"]
        assert len(calls) == ACCUM_STEPS * MICRO_BATCHES
        for i, c in enumerate(calls):
            sync = i % MICRO_BATCHES == MICRO_BATCHES - 1
            assert c["reduce_scatter"] == (modules if sync else 0), (i, calls)
            assert c["all_gather"] == calls[0]["all_gather"] > 0  # parameters are gathered on every micro-batch


# ---- DCP ------------------------------------------------------------------------------------------------------


def test_dcp_checkpoints_hold_trained_state(runs: list[dict]) -> None:
    """What each saver wrote is DCP_STEPS steps of AdamW (so the comparisons below compare real states), the exact
    comms' state is plain FSDP2's bit for bit, and the quantized comms' is not."""
    for r in runs:
        saved = r["checkpoints"]["saved"]
        for comms in ("plain", "exact", "quantized"):
            state = saved[comms]["state"]["optim"]["state"]["blocks.0.attn.c_attn.weight"]
            assert state["step"].item() == DCP_STEPS
            assert state["exp_avg"].abs().max() > 0 and state["exp_avg_sq"].abs().max() > 0
        assert _same(saved["exact"]["state"], saved["plain"]["state"])
        assert not _same(saved["quantized"]["state"]["model"], saved["plain"]["state"]["model"])


@pytest.mark.parametrize("saver, loader", [
    ("quantized", "plain"), ("exact", "plain"), ("plain", "exact"), ("plain", "quantized"),
])
def test_dcp_load_across_comms_is_identical(runs: list[dict], saver: str, loader: str) -> None:
    for r in runs:
        saved = r["checkpoints"]["saved"][saver]["state"]
        loaded = r["checkpoints"]["loaded"][saver, loader]["state"]
        assert _same(loaded["model"], saved["model"])
        assert _same(loaded["optim"], saved["optim"])  # moments, step, param_groups


@pytest.mark.parametrize("saver, loader", [("exact", "plain"), ("plain", "exact")])
def test_dcp_exact_continuation_bit_identical(runs: list[dict], saver: str, loader: str) -> None:
    for r in runs:
        original, resumed = r["checkpoints"]["saved"][saver], r["checkpoints"]["loaded"][saver, loader]
        assert resumed["loss"] == original["loss"]
        assert _same(resumed["params"], original["params"])
        name = "blocks.0.mlp.c_proj.weight"
        assert not torch.equal(resumed["params"][name], original["state"]["model"][name])  # the step moved it


@pytest.mark.parametrize("saver, loader", [("quantized", "plain"), ("plain", "quantized")])
def test_dcp_quantized_continuation_close(runs: list[dict], saver: str, loader: str) -> None:
    for r in runs:
        original, resumed = r["checkpoints"]["saved"][saver], r["checkpoints"]["loaded"][saver, loader]
        assert resumed["loss"] != original["loss"]  # one side gathered quantized weights
        assert _close([resumed["loss"]], [original["loss"]])
