"""zeropp.fsdp on real gloo processes (4 ranks, 2 emulated nodes of 2): FSDP2 with zeropp's exact comms is
bit-identical to plain FSDP2; qwZ int8 + qgZ int4 trains within a tolerance of it and the byte counters see the
quantized volumes; misuse is refused with a message naming the problem."""

from __future__ import annotations

import pytest
import torch
from fsdp_launch import launch
from fsdp_workers import STEPS
from torch import nn

import zeropp.fsdp
from zeropp.quant import BlockFormat

WORLD = 4
ENV = {"ZEROPP_RANKS_PER_NODE": "2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("fsdp_workers:train_runs", WORLD, tmp_path_factory.mktemp("fsdp"), env=ENV, dtype="fp32")


def test_exact_comms_bit_identical_to_plain_fsdp2(runs: list[dict]) -> None:
    for r in runs:
        plain_losses, plain_params = r["plain"]
        losses, params = r["exact"]
        assert len(losses) == STEPS
        assert losses == plain_losses
        assert plain_params.keys() == params.keys()
        for name in params:
            assert torch.equal(params[name], plain_params[name]), name
        # the parameters moved, so the comparison covers real updates
        assert not torch.equal(plain_params["blocks.0.attn.c_attn.weight"], _initial("blocks.0.attn.c_attn.weight"))


def _initial(name: str) -> torch.Tensor:
    from zeropp.models import GPT, GPTConfig

    return dict(GPT(GPTConfig.preset("tiny"), seed=0).named_parameters())[name].detach()


def test_quantized_comms_train_close_to_plain_fsdp2(runs: list[dict]) -> None:
    for r in runs:
        plain_losses, _ = r["plain"]
        losses, _ = r["quantized"]
        assert losses != plain_losses  # the quantized path ran
        for a, b in zip(losses, plain_losses):
            assert abs(a - b) <= 0.02 * b, (losses, plain_losses)
    assert runs[0]["quantized"][1].keys() == runs[0]["plain"][1].keys()


def test_byte_counters_see_quantized_volumes(runs: list[dict]) -> None:
    fmt8, fmt4 = BlockFormat(8, 128), BlockFormat(4, 128)
    for r in runs:
        exact, quant = r["exact_stats"], r["quantized_stats"]
        for kind in ("all_gather", "reduce_scatter"):
            assert exact[kind]["calls"] == quant[kind]["calls"] > 0
            assert exact[kind]["sent_inter"] > 0 and exact[kind]["sent_intra"] > 0
        # all-gather: a packed fp32 shard of n elements is n codes + 4 bytes per block (+ block padding)
        ag = quant["all_gather"]["sent_inter"] / exact["all_gather"]["sent_inter"]
        assert 0.25 + 1 / 128 <= ag <= 0.27, ag
        assert fmt8.packed_bytes(1 << 14) / (4 << 14) <= ag
        # reduce-scatter: 2 exact peers across nodes (2 * 4 S bytes) against one qgZ hop-2 pack of S int4 codes
        rs = quant["reduce_scatter"]["sent_inter"] / exact["reduce_scatter"]["sent_inter"]
        assert fmt4.packed_bytes(1 << 14) / (8 << 14) <= rs <= 0.075, rs


@pytest.fixture(scope="module")
def misuse(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("fsdp_workers:misuse", WORLD, tmp_path_factory.mktemp("misuse"), env=ENV)


def test_refuses_2d_mesh(misuse: list[dict]) -> None:
    for r in misuse:
        assert r["hsdp"].startswith("ValueError") and "1-D meshes only" in r["hsdp"] and "2-D" in r["hsdp"]


def test_refuses_topology_of_other_ranks(misuse: list[dict]) -> None:
    for r in misuse[:2]:
        assert r["topology"].startswith("ValueError") and "[0, 1]" in r["topology"] and "[0, 1, 2, 3]" in r["topology"]


def test_refuses_custom_divide_factor(misuse: list[dict]) -> None:
    for r in misuse:
        assert "set_gradient_divide_factor" in r["divide_factor"]
        assert "set_force_sum_reduction_for_comms(True)" in r["divide_factor"]


@pytest.mark.parametrize("kwargs, words", [
    ({"weight_bits": 3}, "weight_bits=3"),
    ({"gradient_bits": 16}, "gradient_bits=16"),
    ({"weight_bits": True}, "weight_bits=True"),
])
def test_refuses_bits_we_do_not_have(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        zeropp.fsdp.enable(nn.Linear(2, 2), **kwargs)


def test_refuses_modules_without_fully_shard() -> None:
    with pytest.raises(ValueError, match="no FSDP2 module"):
        zeropp.fsdp.enable(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        zeropp.fsdp.enable([nn.Linear(2, 2), "x"])
