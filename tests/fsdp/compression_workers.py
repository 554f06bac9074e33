"""Workers for test_fsdp_compression.py: qgZ bits per hop (``gradient_bits_intra``, int2) and per-parameter rules
through ``zeropp.fsdp``, on the tiny GPT (``varied_gpt``: biases and gains not 0 and 1) against plain FSDP2 and an
unsharded copy of the model, and the misuses ``enable`` refuses. One launch runs every case (``all_runs``)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from fsdp_workers import error_message, varied_gpt
from gpt_units import gpt_units, padded_shard_numel
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
HPZ, DELTA_BITS, DELTA_STEPS = 2, 4, 6
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
    return {"weights": seen, "grads": grads, "all_gather": gathers,
            "reduce_scatter": dict(comm.stats()["reduce_scatter"]), "loss": loss.item()}


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
    topo = comm.Topology(mesh.get_group())  # one for every run: fewer process groups to create
    out: dict[str, Any] = {"plain": _step(_model(mesh), rank), "local": _local_grads(rank)}
    runs: dict[str, dict[str, Any]] = {
        "weights": {"weight_bits": 8, "gradient_bits": None, "rules": WEIGHT_RULES},
        "grads": {"weight_bits": None, "gradient_bits": 4, "rules": GRADIENT_RULES},
        "ef": {"weight_bits": None, "gradient_bits": 4, "rules": GRADIENT_RULES, "error_feedback": True,
               "gradient_bits_intra": 8},
        "global_rule": {"weight_bits": 8, "gradient_bits": 4, "rules": [{"match": "."}]},  # every parameter: global
        "global": {"weight_bits": 8, "gradient_bits": 4},
    }
    for name, kwargs in runs.items():
        model = _model(mesh)
        zeropp.fsdp.enable(model, topology=topo, **kwargs)
        out[name] = [_step(model, rank), _step(model, rank)] if name == "ef" else _step(model, rank)
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
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=4, gradient_bits_intra=8, block_size=BLOCK,
                       topology=topo)
    out["enable"] = _step(model, rank)["reduce_scatter"]
    out["options"] = option_runs(topo, numel)
    model = _model(init_device_mesh("cpu", (world,)))
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=4, gradient_bits_intra=8, block_size=BLOCK,
                       topology=topo, error_feedback="loco", stochastic_rounding=True)
    out["enable_options"] = _step(model, rank)["reduce_scatter"]
    return out


def option_runs(topo: comm.Topology, numel: int) -> dict[str, Any]:
    """The hook with stochastic rounding (two calls, and a second hook with the same seed) and with LoCo's error
    feedback (three calls), beside ``comm.reduce_scatter`` given what the hook should pass it: the seed of each
    call, one ``ErrorFeedback("loco", beta)`` for the buffer."""
    rank, avg = dist.get_rank(), dist.ReduceOp.AVG
    out: dict[str, Any] = {}
    sr = zeropp.fsdp.ZeroppReduceScatter(topo, 4, BLOCK, intra_bits=8, stochastic_rounding=True, seed=3)
    again = zeropp.fsdp.ZeroppReduceScatter(topo, 4, BLOCK, intra_bits=8, stochastic_rounding=True, seed=3)
    x = _hop_input(rank, numel, 0)
    for call in (1, 2):
        got = torch.empty(HOP_SHARD)
        sr(got, x.clone(), topo.group, avg)
        expect = comm.reduce_scatter(x.clone(), 4, topology=topo, block_size=BLOCK, intra_bits=8,
                                     seed=int.from_bytes(hashlib.sha256(f"3/{call}/0".encode()).digest()[:4], "little"))
        out[f"sr{call}"] = (got, expect)
    out["sr_again"] = torch.empty(HOP_SHARD)
    again(out["sr_again"], x.clone(), topo.group, avg)
    out["rtn"] = comm.reduce_scatter(x.clone(), 4, topology=topo, block_size=BLOCK, intra_bits=8)
    loco = zeropp.fsdp.ZeroppReduceScatter(topo, 4, BLOCK, error_feedback="loco", error_feedback_beta=0.25)
    reference = comm.ErrorFeedback("loco", 0.25)
    out["loco"] = []
    for step in range(3):
        x = _hop_input(rank, numel, step)
        got = torch.empty(HOP_SHARD)
        loco(got, x.clone(), topo.group, avg)
        expect = comm.reduce_scatter(x.clone(), 4, topology=topo, block_size=BLOCK, error_feedback=reference)
        out["loco"].append((got, expect))
    ef = loco.error_feedback
    assert ef is not None and ef.residual is not None and reference.residual is not None
    out["loco_store"] = (ef.store, ef.residual.dtype, ef.nbytes, reference.nbytes, ef.numels,
                         torch.equal(ef.residual, reference.residual))
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
    topo = comm.Topology(mesh.get_group())
    out = {
        "no_param": error_message(lambda: zeropp.fsdp.enable(_model(mesh), rules=[{"match": "^lm_head_typo"}],
                                                             topology=topo)),
        "shadowed": error_message(lambda: zeropp.fsdp.enable(_model(mesh), topology=topo, rules=[
            {"match": "ln_", "weight_bits": None}, {"match": "ln_1", "weight_bits": 4}])),
        "bad_bits": error_message(lambda: zeropp.fsdp.enable(_model(mesh), rules=[
            {"match": "ln_", "weight_bits": 3}])),
        "intra_exact": error_message(lambda: zeropp.fsdp.enable(_model(mesh), gradient_bits=None,
                                                                gradient_bits_intra=8)),
        "bits3": error_message(lambda: zeropp.fsdp.enable(_model(mesh), gradient_bits=3)),
        "deltas_no_hpz": error_message(lambda: zeropp.fsdp.enable(_model(mesh), weight_deltas=True)),
    }
    model = _TwoHeads()
    fully_shard(model, mesh=mesh)
    zeropp.fsdp.enable(model, gradient_bits=4, rules=[{"match": "^spare", "gradient_bits": None}], topology=topo)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    model(x, True).square().sum().backward()  # every parameter has a gradient: fine
    out["no_grad"] = error_message(lambda: model(x, False).square().sum().backward())
    return out


def _hpz_model(mesh: Any) -> nn.Module:
    """``varied_gpt`` with every block wrapped with ``reshard_after_forward=HPZ`` (hpZ), the root left as is."""
    model = varied_gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=HPZ)
    fully_shard(model, mesh=mesh)
    return model


def _compute_shard(unit: list[tuple[str, torch.Tensor]], world: int) -> torch.Tensor:
    """This rank's flat all-gather input of a unit (gpt_units' order): each parameter's local rows, zero-padded to
    its padded shard."""
    parts = []
    for _, p in unit:
        local = p.to_local().detach().reshape(-1)
        parts.append(torch.cat([local, local.new_zeros(padded_shard_numel(p, world) - local.numel())]))
    return torch.cat(parts)


def _delta_train(model: nn.Module, rank: int, world: int, deltas: bool) -> dict[str, Any]:
    """DELTA_STEPS AdamW steps on random bytes: the losses, the byte counters of each step's forward gathers,
    backward gathers and exchanges; with ``deltas``, per step and unit the worst excess of ``|w - r|`` over its
    bound (``<= 0``: within) and the largest error, and at steps 1 and DELTA_STEPS - 1 every unit's secondary and
    reconstruction; then an explicit refresh and one more forward."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(500 + rank)
    units = gpt_units(model)
    hooks = zeropp.fsdp.weight_delta_hooks(model) if deltas else []
    hooks = hooks[1:] + hooks[:1]  # gpt_units' order: blocks, then the root (found first by modules())
    qmax = BlockFormat(DELTA_BITS, BLOCK).qmax
    out: dict[str, Any] = {"losses": [], "fwd": [], "bwd": [], "exchange": [], "excess": [], "err": [], "held": {}}
    for step in range(DELTA_STEPS):
        before = [h.reconstruction.clone() if h.reconstruction is not None else None for h in hooks]
        idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
        comm.reset_stats()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        out["fwd"].append(dict(comm.stats()["all_gather"]))
        out["exchange"].append(dict(comm.stats()["exchange"]))
        excess, errs = [], []
        for unit, hook, r_old in zip(units, hooks, before):
            w, r = _compute_shard(unit, world), hook.reconstruction
            if r_old is None:  # the exact refresh
                excess.append(float((w - r).abs().max()))
                errs.append(0.0)
                continue
            d = w - r_old
            blocks = torch.nn.functional.pad(d, (0, -d.numel() % BLOCK)).view(-1, BLOCK)
            bound = (blocks.abs().amax(1) / qmax / 2).repeat_interleave(BLOCK)[: d.numel()]
            err = (w - r).abs()
            excess.append(float((err - bound * (1 + 1e-6) - w.abs() * 2.0**-23).max()))
            errs.append(float(err.max()))
        out["excess"].append(excess)
        out["err"].append(errs)
        if step in (1, DELTA_STEPS - 1) and hooks:
            out["held"][step] = [(h.secondary.clone(), h.reconstruction.clone(), h.resident_bytes) for h in hooks]
        comm.reset_stats()
        loss.backward()
        out["bwd"].append(dict(comm.stats()["all_gather"]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    if deltas:
        zeropp.fsdp.refresh_weight_deltas(model)
        comm.reset_stats()
        with torch.no_grad():
            model(idx[:, :-1], idx[:, 1:])
        out["refresh"] = {"fwd": dict(comm.stats()["all_gather"]), "exchange": dict(comm.stats()["exchange"]),
                          "exact": all(torch.equal(_compute_shard(u, world), h.reconstruction)
                                       for u, h in zip(units, hooks))}
    return out


def delta_runs(rank: int, world: int) -> dict[str, Any]:
    """Plain FSDP2 with hpZ, and FSDP2 + zeropp with hpZ and int4 weight deltas (exact refresh, exact gradients),
    trained alike (``_delta_train``)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {"plain": _delta_train(_hpz_model(mesh), rank, world, False)}
    model = _hpz_model(mesh)
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=None, hpz=HPZ, weight_deltas=True,
                       delta_bits=DELTA_BITS, block_size=BLOCK)
    out["deltas"] = _delta_train(model, rank, world, True)
    return out


def all_runs(rank: int, world: int) -> dict[str, Any]:
    """Everything test_fsdp_compression.py checks, in one launch (the misuses last: they leave a backward
    half-done)."""
    return {"rules": rules_runs(rank, world), "hops": hop_runs(rank, world), "deltas": delta_runs(rank, world),
            "misuse": misuse(rank, world)}
