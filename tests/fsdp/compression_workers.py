"""Workers for test_fsdp_compression.py: qgZ bits per hop (``gradient_bits_intra``, int2) and per-parameter rules
through ``zeropp.fsdp``, on the tiny GPT (``varied_gpt``: biases and gains not 0 and 1) against plain FSDP2 and an
unsharded copy of the model, and the misuses ``enable`` refuses. One launch runs every case (``all_runs``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fsdp_workers import error_message, varied_gpt
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zeropp.fsdp
from zeropp import comm
from zeropp.quant import BlockFormat, quantize_chunks, reduce_dequantize, reduce_requantize

BATCH, SEQ, BLOCK = 2, 32, 128
HOP_SHARD = 1000  # elements of each rank's slice in the hook-level cases (not a multiple of BLOCK)
HOP_CASES = ((4, 8), (2, 8), (2, None))  # (gradient_bits, gradient_bits_intra)
WEIGHT_RULES = [{"match": r"^(wte|wpe)\.|ln_", "weight_bits": None}, {"match": r"\.mlp\.", "weight_bits": 4}]
GRADIENT_RULES = [{"match": r"^(wte|wpe)\.|ln_", "gradient_bits": None}, {"match": r"\.mlp\.", "gradient_bits": 8}]


def _model(mesh: Any) -> nn.Module:
    model = varied_gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(300 + rank))
    return idx[:, :-1], idx[:, 1:]


def _step(model: nn.Module, rank: int) -> dict[str, Any]:
    """One forward and backward on this rank's batch: every parameter as the forward computed with it (a forward
    pre-hook on its module, after FSDP2's all-gather), every reduced gradient (full tensor), and the byte counters
    of the forward's all-gathers and the backward's reduce-scatters."""
    model.zero_grad(set_to_none=True)
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            def grab(m: nn.Module, args: Any, prefix: str = prefix) -> None:
                for pname, p in m.named_parameters(recurse=False):
                    seen.setdefault(f"{prefix}.{pname}", p.detach().clone())
            handles.append(module.register_forward_pre_hook(grab))
    comm.reset_stats()
    _, loss = model(*_batch(rank))
    gathers = dict(comm.stats()["all_gather"])
    loss.backward()
    for h in handles:
        h.remove()
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    return {"weights": seen, "grads": grads, "all_gather": gathers, "reduce_scatter": dict(comm.stats()["reduce_scatter"]),
            "loss": loss.item()}


def _local_grads(rank: int) -> dict[str, torch.Tensor]:
    """This rank's unreduced gradients: an unsharded copy of the model on the same batch."""
    model = varied_gpt()
    _, loss = model(*_batch(rank))
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def rules_runs(rank: int, world: int) -> dict[str, Any]:
    """Plain FSDP2; weight rules (``WEIGHT_RULES``, gradients exact); gradient rules (``GRADIENT_RULES``, weights
    exact); gradient rules with error feedback (twice: the residuals of each format part are kept); this rank's
    local gradients."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"plain": _step(_model(mesh), rank), "local": _local_grads(rank)}
    model = _model(mesh)
    zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=None, rules=WEIGHT_RULES)
    out["weights"] = _step(model, rank)
    model = _model(mesh)
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=4, rules=GRADIENT_RULES)
    out["grads"] = _step(model, rank)
    model = _model(mesh)
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=4, rules=GRADIENT_RULES, error_feedback=True,
                       gradient_bits_intra=8)
    out["ef"] = [_step(model, rank), _step(model, rank)]
    model = _model(mesh)
    zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4, rules=[{"match": "."}])  # every parameter: global
    out["global_rule"] = _step(model, rank)
    model = _model(mesh)
    zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4)
    out["global"] = _step(model, rank)
    return out


def _hop_input(rank: int, numel: int, step: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(7000 + 100 * step + rank))


def _composition(topo: comm.Topology, numel: int, bits: int, intra: int | None) -> torch.Tensor:
    """This rank's slice of qgZ computed in this process from every rank's input: each rank's slices packed in
    the hop-1 format, each node's packs of this rank's slice summed in local-index order and requantized to
    ``bits``, the nodes' packs summed in this rank's inter-node group's order, divided by the world size."""
    world, r, s = topo.world_size, topo.rank, numel // topo.world_size
    f1, f2 = BlockFormat(intra or bits, BLOCK), BlockFormat(bits, BLOCK)
    b1 = f1.packed_bytes(s)

    def hop1(g: int) -> torch.Tensor:  # global rank g's pack of slice r
        return quantize_chunks(_hop_input(g, numel, 0), f1, world)[r * b1:(r + 1) * b1]

    node_of = {g: next(nd for nd in topo.nodes if g in nd) for g in topo.ranks}
    buf = torch.cat([reduce_requantize(torch.cat([hop1(g) for g in node_of[p]]), f1, topo.ranks_per_node, 1, s,
                                       out_fmt=f2) for p in topo.inter_ranks])
    expect = torch.empty(s)
    reduce_dequantize(buf, f2, topo.num_nodes, s, expect, divisor=world)
    return expect


def hop_runs(rank: int, world: int) -> dict[str, Any]:
    """``ZeroppReduceScatter`` with each ``HOP_CASES`` setting, fed as FSDP2 feeds it (a flat ``P x S`` buffer,
    ``AVG``): its output, the in-process composition, and the reduce-scatter byte counters; then one backward
    through ``enable(gradient_bits=4, gradient_bits_intra=8)``: its reduce-scatter counters."""
    topo = comm.Topology()
    numel = world * HOP_SHARD
    out: dict[str, Any] = {}
    for bits, intra in HOP_CASES:
        hook = zeropp.fsdp.ZeroppReduceScatter(topo, bits, BLOCK, intra_bits=intra)
        got = torch.empty(HOP_SHARD)
        comm.reset_stats()
        hook(got, _hop_input(dist.get_rank(), numel, 0), topo.group, dist.ReduceOp.AVG)
        out[bits, intra] = {"got": got, "expect": _composition(topo, numel, bits, intra),
                            "stats": dict(comm.stats()["reduce_scatter"])}
    model = _model(init_device_mesh("cpu", (world,)))
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=4, gradient_bits_intra=8, block_size=BLOCK)
    out["enable"] = _step(model, rank)["reduce_scatter"]
    return out


class _TwoHeads(nn.Module):
    """A trunk and two heads in one FSDP2 group; the second head is used only when asked (so it may get no
    gradient)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.trunk, self.head, self.spare = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h) + (self.spare(h) if use_spare else 0)


def misuse(rank: int, world: int) -> dict[str, str]:
    """What ``enable`` says for: a rule that takes no parameter, a rule shadowed by an earlier one, a bad rule,
    ``gradient_bits_intra`` without quantized gradients, an unsupported ``gradient_bits``; and what the first
    backward says when a group with several gradient formats has a parameter with no gradient."""
    mesh = init_device_mesh("cpu", (world,))
    out = {
        "no_param": error_message(lambda: zeropp.fsdp.enable(_model(mesh), rules=[{"match": "^lm_head_typo"}])),
        "shadowed": error_message(lambda: zeropp.fsdp.enable(_model(mesh), rules=[
            {"match": "ln_", "weight_bits": None}, {"match": "ln_1", "weight_bits": 4}])),
        "bad_bits": error_message(lambda: zeropp.fsdp.enable(_model(mesh), rules=[
            {"match": "ln_", "weight_bits": 3}])),
        "intra_exact": error_message(lambda: zeropp.fsdp.enable(_model(mesh), gradient_bits=None,
                                                                gradient_bits_intra=8)),
        "bits3": error_message(lambda: zeropp.fsdp.enable(_model(mesh), gradient_bits=3)),
    }
    model = _TwoHeads()
    fully_shard(model, mesh=mesh)
    zeropp.fsdp.enable(model, gradient_bits=4, rules=[{"match": "^spare", "gradient_bits": None}])
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    model(x, True).square().sum().backward()  # every parameter has a gradient: fine
    out["no_grad"] = error_message(lambda: model(x, False).square().sum().backward())
    return out


def all_runs(rank: int, world: int) -> dict[str, Any]:
    """Everything test_fsdp_compression.py checks, in one launch (the misuses last: they leave a backward
    half-done)."""
    return {"rules": rules_runs(rank, world), "hops": hop_runs(rank, world), "misuse": misuse(rank, world)}
