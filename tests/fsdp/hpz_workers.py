"""Workers for test_fsdp_hpz.py: FSDP2 with ``reshard_after_forward=2`` (hpZ) with and without zeropp's comms,
the weights forward and backward compute with, the byte counters of the backward gathers, the misuses
``enable(hpz=...)`` refuses, and qgZ error feedback (through the hook directly and through training)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fsdp_workers import error_message
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import zeropp.fsdp
from zeropp import comm
from zeropp.models import GPT, GPTConfig

STEPS, CONTROL_STEPS, BATCH, SEQ, HPZ = 10, 2, 2, 32, 2


def _model(mesh: DeviceMesh, reshard: bool | int) -> GPT:
    """The tiny GPT, each block wrapped with ``reshard_after_forward=reshard``, the root left to FSDP2's default
    (not resharded after forward)."""
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    return model


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _capture_weights(model: GPT) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]]]:
    """Copies of every block Linear's weight as its forward and its backward see it (a forward pre-hook and a
    full backward pre-hook: FSDP2 has all-gathered the block by then), one per step, by parameter name."""
    fwd: dict[str, list[torch.Tensor]] = {}
    bwd: dict[str, list[torch.Tensor]] = {}
    for name, mod in model.blocks.named_modules(prefix="blocks"):
        if isinstance(mod, nn.Linear):
            key = name + ".weight"
            fwd[key], bwd[key] = [], []
            mod.register_forward_pre_hook(lambda m, args, k=key: fwd[k].append(m.weight.detach().clone()))
            mod.register_full_backward_pre_hook(lambda m, grad, k=key: bwd[k].append(m.weight.detach().clone()))
    return fwd, bwd


def _train(model: GPT, rank: int, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` AdamW steps on random bytes (rank-specific, the same for every run): losses, final full parameters,
    the exact block weights before each step, the weights forward and backward used, the all-gather counters of
    the forwards and of the backwards (summed over steps)."""
    fwd, bwd = _capture_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, exact = [], {k: [] for k in fwd}
    gathers = {"forward": dict.fromkeys(comm.accounting.FIELDS, 0), "backward": dict.fromkeys(comm.accounting.FIELDS, 0)}
    for _ in range(steps):
        params = dict(model.named_parameters())
        for k, before in exact.items():
            before.append(params[k].full_tensor().detach().clone())
        x, y = _batch(gen)
        comm.reset_stats()
        _, loss = model(x, y)
        after_forward = comm.stats()["all_gather"]
        loss.backward()
        after_backward = comm.stats()["all_gather"]
        for f in comm.accounting.FIELDS:
            gathers["forward"][f] += after_forward[f]
            gathers["backward"][f] += after_backward[f] - after_forward[f]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": full, "exact": exact, "fwd": fwd, "bwd": bwd, "gathers": gathers}


def hpz_runs(rank: int, world: int) -> dict[str, Any]:
    """Plain FSDP2 (reshard to the shard group, and to groups of HPZ), then FSDP2 + zeropp: exact with hpz, qwZ
    int8 + qgZ int4 with hpz, and (CONTROL_STEPS only) qwZ int8 + qgZ int4 without hpZ (blocks resharded to the
    whole group)."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    out["plain"] = _train(_model(mesh, True), rank)
    out["plain_hpz"] = _train(_model(mesh, HPZ), rank)
    for name, wbits, gbits, reshard in (("exact_hpz", None, None, HPZ), ("zeropp_hpz", 8, 4, HPZ),
                                        ("zeropp", 8, 4, True)):
        model = _model(mesh, reshard)
        zeropp.fsdp.enable(model, weight_bits=wbits, gradient_bits=gbits, hpz=HPZ if reshard == HPZ else None)
        out[name] = _train(model, rank, STEPS if reshard == HPZ else CONTROL_STEPS)
    return out


def hpz_misuse(rank: int, world: int) -> dict[str, str]:
    """What enable(hpz=...) says for: an hpz not dividing the ranks per node, modules wrapped with
    reshard_after_forward=True (at the first forward), a mesh whose post-forward runs span nodes; error_feedback
    without gradient bits."""
    mesh = init_device_mesh("cpu", (world,))
    out = {"hpz3": error_message(lambda: zeropp.fsdp.enable(_model(mesh, HPZ), hpz=3))}
    out["hpz4"] = error_message(lambda: zeropp.fsdp.enable(_model(mesh, True), hpz=4))
    model = _model(mesh, True)
    zeropp.fsdp.enable(model, hpz=HPZ)
    x, y = _batch(torch.Generator().manual_seed(rank))
    out["wrapped_true"] = error_message(lambda: model(x, y))
    out["ef_exact"] = error_message(lambda: zeropp.fsdp.enable(_model(mesh, True), gradient_bits=None,
                                                          error_feedback=True))
    # node 0 = ranks 0, 1; mesh positions 0, 1 hold ranks 0, 2: FSDP2's first post-forward group spans both nodes
    strided = DeviceMesh("cpu", [0, 2, 1, 3])
    out["strided"] = error_message(lambda: zeropp.fsdp.enable(_model(strided, HPZ), hpz=HPZ))
    return out


def _grad_inputs(step: int, world: int, numel: int) -> list[torch.Tensor]:
    """Every rank's reduce-scatter input at ``step`` (each rank can make them all: the reference needs no comm):
    a per-rank mean that stays the same over steps plus fresh noise, so the gradients have a consistent part that
    quantization errors can bias."""
    out = []
    for r in range(world):
        base = torch.randn(numel, generator=torch.Generator().manual_seed(50 + r), dtype=torch.float64)
        noise = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + r), dtype=torch.float64)
        out.append((base + 0.5 * noise).float())
    return out


def ef_hook_runs(rank: int, world: int, steps: int, shard: int) -> dict[str, Any]:
    """The qgZ int4 reduce-scatter hook fed the same per-step inputs with and without error feedback (and with it
    and a 32-element rotation), as FSDP2
    calls it (flat input of world * shard, AVG): the running sum of this rank's outputs in float64 after every
    step, and the float64 reference (mean over ranks of the same inputs, this rank's slice)."""
    topo = comm.Topology()
    hooks = {
        "ef": zeropp.fsdp.ZeroppReduceScatter(topo, 4, 128, error_feedback=True),
        "plain": zeropp.fsdp.ZeroppReduceScatter(topo, 4, 128),
        "rot_ef": zeropp.fsdp.ZeroppReduceScatter(topo, 4, 128, error_feedback=True, gradient_rotation=32),
    }
    sums = {name: torch.zeros(shard, dtype=torch.float64) for name in (*hooks, "reference")}
    history: dict[str, list[torch.Tensor]] = {name: [] for name in sums}
    for step in range(steps):
        inputs = _grad_inputs(step, world, world * shard)
        sums["reference"] += torch.stack([t.double() for t in inputs]).mean(0)[rank * shard:(rank + 1) * shard]
        history["reference"].append(sums["reference"].clone())
        for name, hook in hooks.items():
            out = torch.empty(shard)
            hook(out, inputs[rank].clone(), topo.group, dist.ReduceOp.AVG)
            sums[name] += out.double()
            history[name].append(sums[name].clone())
    return history


def ef_train_runs(rank: int, world: int, accumulate: int) -> dict[str, Any]:
    """Through ``enable``: (1) STEPS training steps of qwZ int8 + qgZ int4 with error feedback (as ``_train``);
    (2) ``accumulate`` backward passes on fresh batches with no optimizer step (the weights stay put), with exact
    comms and with qgZ int4 with and without error feedback: the float64 sum of the reduced gradients of every
    parameter after each pass (full tensors)."""
    mesh = init_device_mesh("cpu", (world,))
    model = _model(mesh, True)
    zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4, error_feedback=True)
    out: dict[str, Any] = {"ef_losses": _train(model, rank)["losses"]}
    for name, kwargs in (("exact", None), ("ef", {"error_feedback": True}), ("no_ef", {})):
        model = _model(mesh, True)
        if kwargs is not None:
            zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=4, **kwargs)
        gen = torch.Generator().manual_seed(2000 + rank)
        sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
        history = []
        for _ in range(accumulate):
            _, loss = model(*_batch(gen))
            loss.backward()
            for n, p in model.named_parameters():
                sums[n] += p.grad.full_tensor().double()
            model.zero_grad(set_to_none=True)
            history.append({n: s.clone() for n, s in sums.items()})
        out[name + "_sums"] = history
    return out


def all_runs(rank: int, world: int, ef_steps: int, ef_shard: int, accumulate: int) -> dict[str, Any]:
    """Everything test_fsdp_hpz.py checks, in one launch: ``hpz_runs``, ``ef_hook_runs``, ``ef_train_runs``, and
    last ``hpz_misuse`` (it leaves a model stopped mid-forward)."""
    return {
        "hpz": hpz_runs(rank, world),
        "ef_hook": ef_hook_runs(rank, world, ef_steps, ef_shard),
        "ef_train": ef_train_runs(rank, world, accumulate),
        "misuse": hpz_misuse(rank, world),
    }
