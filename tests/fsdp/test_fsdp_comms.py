"""zeropp.fsdp on real gloo processes (4 ranks, 2 emulated nodes of 2): FSDP2 with zeropp's exact comms is
bit-identical to plain FSDP2; qwZ int8 + qgZ int4 trains within a tolerance of it and the byte counters see the
quantized volumes; qwZ's weights are every parameter's shards quantized alone, bit for bit (blocks never span two
parameters); misuse is refused with a message naming the problem."""

from __future__ import annotations

import math

import pytest
import torch
from fsdp_launch import launch
from fsdp_workers import HOOK_SEGMENTS, STEPS, hook_input, varied_gpt
from gpt_units import gpt_unit_segments, gpt_units
from torch import nn

import zeropp.fsdp
from zeropp.models import GPT, GPTConfig
from zeropp.quant import BlockFormat, reference

WORLD = 4
INTER_PEERS = 2  # ranks on the other node, for every rank (2 nodes of 2)
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
    units = gpt_unit_segments(GPT(GPTConfig.preset("tiny")), WORLD)
    gathers = [2] * (len(units) - 1) + [1]  # blocks: forward and backward; the root stays gathered for backward
    for r in runs:
        exact, quant = r["exact_stats"], r["quantized_stats"]
        for kind in ("all_gather", "reduce_scatter"):
            assert exact[kind]["calls"] == quant[kind]["calls"] > 0
            assert exact[kind]["sent_inter"] > 0 and exact[kind]["sent_intra"] > 0
        assert exact["all_gather"]["calls"] == STEPS * sum(gathers)
        # all-gather, per unit and gather: exact sends its fp32 shard of sum(segments) elements to each peer on the
        # other node; qwZ one pack per parameter shard (its own blocks, the last one partial)
        assert exact["all_gather"]["sent_inter"] == STEPS * sum(
            g * INTER_PEERS * 4 * sum(unit) for g, unit in zip(gathers, units)
        )
        assert quant["all_gather"]["sent_inter"] == STEPS * sum(
            g * INTER_PEERS * sum(fmt8.packed_bytes(s) for s in unit) for g, unit in zip(gathers, units)
        )
        # reduce-scatter: 2 exact peers across nodes (2 * 4 S bytes) against one qgZ hop-2 pack of S int4 codes
        rs = quant["reduce_scatter"]["sent_inter"] / exact["reduce_scatter"]["sent_inter"]
        assert fmt4.packed_bytes(1 << 14) / (8 << 14) <= rs <= 0.075, rs


def _round_trip(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``x`` (flat) quantized as one pack by the torch reference quantizer, and dequantized to float32."""
    buf = torch.empty(fmt.packed_bytes(x.numel()), dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, 1, 1, buf)
    out = torch.empty(x.numel())
    reference.dequantize_chunks(buf, fmt, 1, x.numel(), out)
    return out


def _gathered(unit: list[tuple[str, torch.Tensor]], fmt: BlockFormat, per_parameter: bool) -> dict[str, torch.Tensor]:
    """What a qwZ all-gather of ``unit`` gives back, by the reference: every rank's zero-padded dim-0 shard of every
    parameter quantized alone (``per_parameter``) or, for comparison, each rank's concatenated shards of the whole
    unit quantized as one run (blocks may span two parameters); reassembled into full tensors."""
    shards = {}
    for name, p in unit:
        rows = math.ceil(p.shape[0] / WORLD)
        padded = torch.zeros(rows * WORLD, *p.shape[1:])
        padded[: p.shape[0]] = p.detach()
        shards[name] = list(padded.reshape(WORLD, -1))
    if per_parameter:
        back = {name: [_round_trip(s, fmt) for s in per_rank] for name, per_rank in shards.items()}
    else:
        sizes = [shards[name][0].numel() for name, _ in unit]
        per_rank = [_round_trip(torch.cat([shards[name][r] for name, _ in unit]), fmt).split(sizes)
                    for r in range(WORLD)]
        back = {name: [per_rank[r][i] for r in range(WORLD)] for i, (name, _) in enumerate(unit)}
    return {name: torch.cat(back[name]).view(-1, *p.shape[1:])[: p.shape[0]] for name, p in unit}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tail_group", [False, True], ids=["per_module", "tail_group"])
def test_qwz_quantizes_every_parameter_shard_alone(runs: list[dict], bits: int, tail_group: bool) -> None:
    """Every parameter of the tiny GPT (random biases, LayerNorm gains ~1) as a qwZ forward sees it equals, bit for
    bit, every rank's shard of it quantized alone by the torch reference and dequantized, with no warning.
    ``tail_group``: the final LayerNorm, the embedding and the tied head ``fully_shard``-ed together as accelerate
    does, one FSDP2 group whose flat input holds ``ln_f.weight`` and ``ln_f.bias`` (16 elements per rank each,
    no block multiple) before ``wte.weight``: cutting blocks from that input would put the bias, the gain and the
    embedding in one block."""
    fmt = BlockFormat(bits, 128)
    want = {k: v for unit in gpt_units(varied_gpt()) for k, v in _gathered(unit, fmt, True).items()}
    group = [(name, p) for name, p in varied_gpt().named_parameters() if name in ("ln_f.weight", "ln_f.bias",
                                                                                  "wte.weight")]
    flat = _gathered(sorted(group, key=lambda item: not item[0].startswith("ln_f")), fmt, False)
    assert not torch.equal(flat["ln_f.bias"], want["ln_f.bias"])  # the test tells the two layouts apart
    for r in runs:
        run = r["forward_weights"][bits, tail_group]
        seen = run["weights"]
        assert want.keys() <= seen.keys()
        for name, value in want.items():
            assert torch.equal(seen[name], value), name
        assert torch.equal(seen["lm_head.weight"], seen["wte.weight"])  # tied: gathered once
        assert run["warnings"] == []


@pytest.mark.parametrize("bits", [8, 4])
def test_biases_beside_layernorm_gains_keep_their_own_scale(runs: list[dict], bits: int) -> None:
    """A bias that FSDP2's flat input puts beside a LayerNorm gain (``attn.c_proj.bias`` before ``ln_2.weight``,
    ``ln_1.bias`` after ``ln_1.weight``) comes back within half a quantization step of its own absmax. The bound:
    half a step of the block's scale, ``absmax / qmax``, with float32 rounding slack (the scale rounded, the code
    from ``x * (1 / scale)`` within ``qmax * 2**-22`` of ``x / scale``, ``code * scale`` rounded): a factor
    ``1 + 1e-4``. Quantizing the flat input instead breaks it many times over (checked, so the case can fail)."""
    fmt = BlockFormat(bits, 128)
    model = varied_gpt()
    full = dict(model.named_parameters())
    flat = {k: v for unit in gpt_units(model) for k, v in _gathered(unit, fmt, False).items()}
    biases = [name for name in full if name.endswith("bias")]
    assert "blocks.0.attn.c_proj.bias" in biases and "blocks.1.ln_1.bias" in biases
    for r in runs:
        seen = r["forward_weights"][bits, False]["weights"]
        worst_flat = 0.0
        for name in biases:
            w = full[name].detach()
            bound = 0.5 * w.abs().max().item() / fmt.qmax * (1 + 1e-4)
            assert (seen[name] - w).abs().max().item() <= bound, name
            worst_flat = max(worst_flat, (flat[name] - w).abs().max().item() / bound)
        assert worst_flat > 10, worst_flat


def test_hook_quantizes_each_segment_alone(runs: list[dict]) -> None:
    """Called directly with its input's segments: every rank's each segment quantized alone (reference), in place."""
    fmt = BlockFormat(8, 128)
    want = torch.cat([_round_trip(part, fmt) for r in range(WORLD) for part in hook_input(r).split(HOOK_SEGMENTS)])
    for r in runs:
        assert torch.equal(r["hook"]["segments"]["output"], want)
        assert r["hook"]["segments"]["warnings"] == []


def test_hook_falls_back_to_flat_blocks_with_one_warning(runs: list[dict]) -> None:
    """Segments that do not add up to the input: blocks from the flat input (each rank's input one run), warned
    once over two calls, naming the sizes."""
    fmt = BlockFormat(8, 128)
    flat = torch.cat([_round_trip(hook_input(r), fmt) for r in range(WORLD)])
    per_segment = torch.cat([_round_trip(p, fmt) for r in range(WORLD) for p in hook_input(r).split(HOOK_SEGMENTS)])
    assert not torch.equal(flat, per_segment)  # the input tells the two apart
    for r in runs:
        got = r["hook"]["mismatch"]
        assert torch.equal(got["output"], flat)
        assert len(got["warnings"]) == 1, got["warnings"]
        assert f"{sum(HOOK_SEGMENTS)} elements" in got["warnings"][0] and "add up to 400" in got["warnings"][0]


@pytest.fixture(scope="module")
def misuse(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch("fsdp_workers:misuse", WORLD, tmp_path_factory.mktemp("misuse"), env=ENV)


def test_refuses_hpz_on_hsdp_mesh(misuse: list[dict]) -> None:
    # HSDP itself is served (tests/fsdp/test_fsdp_hsdp.py); hpZ on it is refused at enable
    for r in misuse:
        assert r["hsdp"].startswith("ValueError") and "not served on an HSDP mesh" in r["hsdp"], r["hsdp"]


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


def test_refuses_error_feedback_without_bits_before_any_collective() -> None:
    # no process group exists here: the error must come before enable makes a topology
    with pytest.raises(ValueError, match="error_feedback=True needs quantized gradients"):
        zeropp.fsdp.enable(nn.Linear(2, 2), gradient_bits=None, error_feedback=True)
    with pytest.raises(ValueError, match="gradient_rotation=32 needs quantized gradients"):
        zeropp.fsdp.enable(nn.Linear(2, 2), gradient_bits=None, gradient_rotation=32)
    with pytest.raises(ValueError, match="gradient_rotation=64 must divide block_size=32"):
        zeropp.fsdp.enable(nn.Linear(2, 2), block_size=32, gradient_rotation=64)
    with pytest.raises(ValueError, match="rotation size=24"):
        zeropp.fsdp.enable(nn.Linear(2, 2), gradient_rotation=24)
