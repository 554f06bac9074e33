"""Workers for test_fsdp_hsdp.py: the tiny GPT trained with FSDP2's native HSDP on a (2, 4) mesh and with zeropp's
comms on the same mesh (exact and quantized), the per-step bytes, the quantized all-reduce hook on fresh inputs,
DCP checkpoints across the two, and the misuses ``enable`` refuses on HSDP; then HSDP with tensor parallelism on a
(replicate 2, shard 2, tp 2) world mesh (mesh_workers' tiny residual MLP), plain and with zeropp, and DCP from it
to plain HSDP + TP and to plain HSDP (2, 4) and back."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_workers import error_message
from mesh_workers import BATCH as TP_BATCH
from mesh_workers import DIM, Stage
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zeropp.fsdp
from zeropp import comm
from zeropp.fsdp.hsdp import ReplicaAllReduce
from zeropp.models import GPT, GPTConfig

STEPS, QUANTIZED_STEPS, BATCH, SEQ, REPLICAS, SHARDS = 10, 5, 2, 32, 2, 4
HOOK_NUMEL, HOOK_BLOCK = 1001, 64
TP = 2
PART_SEGMENTS, PART_SHARDED = (37, 300, 50, 9), (0, 1, 0, 1)  # the hook's tp-replicated / -sharded layout case


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))


def _model(mesh: DeviceMesh) -> GPT:
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _train(model: GPT, rank: int, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` AdamW steps on random bytes (rank-specific, the same for every run): losses, the full parameters
    after, the bytes this rank sent across nodes in each step (all collective kinds), and the warnings raised."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, inter = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            comm.reset_stats()
            _, loss = model(*_batch(gen))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            inter.append(sum(c["sent_inter"] for c in comm.stats().values()))
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": full, "inter": inter, "warnings": [str(w.message) for w in seen]}


def _hook_case(rank: int, world: int) -> dict[str, Any]:
    """The int4 replicate all-reduce hook on fresh random inputs (replica ``r``'s scaled by ``r + 1``, each shard
    position its own): the output, every replica's input of this rank's replicate group (made on every rank from
    seeds) for the reference, and the bytes sent across nodes."""
    topo = comm.Topology(_mesh().get_group("replicate"), 1)
    shard_pos = rank % SHARDS
    inputs = [torch.randn(HOOK_NUMEL, generator=torch.Generator().manual_seed(77 + 10 * r + shard_pos)) * (r + 1)
              for r in range(REPLICAS)]
    mine = inputs[rank // SHARDS].clone()
    comm.reset_stats()
    ReplicaAllReduce(topo, 4, HOOK_BLOCK)(mine)
    sent = sum(c["sent_inter"] for c in comm.stats().values())
    return {"out": mine, "inputs": inputs, "sent_inter": sent}


def _dcp_case(src: GPT, rank: int, path: str) -> dict[str, Any]:
    """``src`` (a trained zeropp HSDP model) saves with DCP; a plain HSDP model loads it, saves it again; a new
    zeropp model loads that: the full parameters at each stage (and that model's before it loads), and the loss
    of a step after loading."""
    mesh = _mesh()
    saved = {n: p.full_tensor().detach().clone() for n, p in src.named_parameters()}
    dcp.save(src.state_dict(), checkpoint_id=path + "/zeropp")
    plain = _model(mesh)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path + "/zeropp")
    plain.load_state_dict(state)
    loaded_plain = {n: p.full_tensor().detach().clone() for n, p in plain.named_parameters()}
    dcp.save(plain.state_dict(), checkpoint_id=path + "/plain")
    back = _model(mesh)
    zeropp.fsdp.enable(back, weight_bits=8, gradient_bits=4)
    init = {n: p.full_tensor().detach().clone() for n, p in back.named_parameters()}
    state = back.state_dict()
    dcp.load(state, checkpoint_id=path + "/plain")
    back.load_state_dict(state)
    loaded_back = {n: p.full_tensor().detach().clone() for n, p in back.named_parameters()}
    _, loss = back(*_batch(torch.Generator().manual_seed(5 + rank)))  # it still runs after loading
    loss.backward()
    return {"saved": saved, "plain": loaded_plain, "back": loaded_back, "init": init, "loss": loss.item()}


def _tp_world() -> DeviceMesh:
    return init_device_mesh("cpu", (REPLICAS, SHARDS // TP, TP), mesh_dim_names=("replicate", "shard", "tp"))


def _tp_model(world: DeviceMesh | None) -> Stage:
    """``Stage(0)``: with a ``world`` mesh, each block tensor-parallel over ``world["tp"]`` (``up`` column-, ``down``
    row-wise) and ``fully_shard``-ed over ``world["replicate", "shard"]``, then the stage; with none, plain HSDP
    on the (2, 4) mesh."""
    model = Stage(0)
    dp = _mesh() if world is None else world["replicate", "shard"]
    for block in model.blocks:
        if world is not None:
            parallelize_module(block, world["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _tp_train(model: Stage, world: DeviceMesh, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` Adam steps, data-parallel rank ``dp`` (the same batch on its tp peers) on its own random batches:
    losses, full parameters, each parameter's local tensor (the tp peers' are compared), bytes sent across nodes
    per step."""
    coord = dict(zip(world.mesh_dim_names, world.get_coordinate()))
    dp = coord["replicate"] * (SHARDS // TP) + coord["shard"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    losses, inter = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * dp + step)
        x, target = torch.randn(TP_BATCH, DIM, generator=gen), torch.randn(TP_BATCH, DIM, generator=gen)
        comm.reset_stats()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        inter.append(sum(c["sent_inter"] for c in comm.stats().values()))
    return {"losses": losses, "params": _full_params(model), "inter": inter,
            "local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "placements": {n: str(p.placements) for n, p in model.named_parameters()}}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _tp_dcp(src: Stage, world: DeviceMesh, path: str) -> dict[str, Any]:
    """``src`` (zeropp on HSDP + TP, trained) saves with DCP; plain HSDP + TP loads it; plain HSDP (2, 4) without
    tp loads it and saves again; a zeropp HSDP + TP model loads that: the full parameters at each stage."""
    out = {"saved": _full_params(src)}
    dcp.save(src.state_dict(), checkpoint_id=path + "/tp_zeropp")
    for key, model in (("plain_tp", _tp_model(world)), ("plain_2x4", _tp_model(None))):
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path + "/tp_zeropp")
        model.load_state_dict(state)
        out[key] = _full_params(model)
    dcp.save(model.state_dict(), checkpoint_id=path + "/plain_2x4")
    back = _tp_model(world)
    zeropp.fsdp.enable(back, weight_bits=8, gradient_bits=4)
    out["init"] = _full_params(back)
    state = back.state_dict()
    dcp.load(state, checkpoint_id=path + "/plain_2x4")
    back.load_state_dict(state)
    out["back"] = _full_params(back)
    return out


def _part_hook_case(rank: int) -> dict[str, Any]:
    """The int4 replicate all-reduce hook on a group layout of tp-replicated and -sharded segments
    (``PART_SEGMENTS``, ``PART_SHARDED``), fresh random inputs as ``_hook_case``'s: output, every replica's input."""
    topo = comm.Topology(_mesh().get_group("replicate"), 1)
    n = sum(PART_SEGMENTS)
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(91 + 10 * r + rank % SHARDS)) * (r + 1)
              for r in range(REPLICAS)]
    mine = inputs[rank // SHARDS].clone()
    ReplicaAllReduce(topo, 4, HOOK_BLOCK, segments=PART_SEGMENTS, tp_sharded=PART_SHARDED)(mine)
    return {"out": mine, "inputs": inputs}


def tp_runs(rank: int, world: int, path: str) -> dict[str, Any]:
    """HSDP + TP on the (replicate 2, shard 2, tp 2) mesh: plain, zeropp exact, zeropp qwZ int8 / qgZ int4 with
    the int4 all-reduce (``_tp_train``; the quantized one QUANTIZED_STEPS steps), the topologies enable derived
    (nodes), DCP across meshes (``_tp_dcp``) and the tp-parted hook (``_part_hook_case``)."""
    tp_world = _tp_world()
    out: dict[str, Any] = {"coord": dict(zip(tp_world.mesh_dim_names, tp_world.get_coordinate()))}
    out["plain"] = _tp_train(_tp_model(tp_world), tp_world)
    exact = _tp_model(tp_world)
    out["nodes"] = zeropp.fsdp.enable(exact, weight_bits=None, gradient_bits=None).nodes
    out["exact"] = _tp_train(exact, tp_world)
    quantized = _tp_model(tp_world)
    zeropp.fsdp.enable(quantized, weight_bits=8, gradient_bits=4)
    out["quantized"] = _tp_train(quantized, tp_world, QUANTIZED_STEPS)
    out["dcp"] = _tp_dcp(quantized, tp_world, path)
    out["part_hook"] = _part_hook_case(rank)
    return out


def _misuse(rank: int, world: int) -> dict[str, str]:
    mesh = _mesh()
    out = {}
    for key, kwargs in (("hpz", {"hpz": 2}), ("topology", {"topology": comm.get_default_topology()}),
                        ("ef", {"error_feedback": True}), ("sr", {"stochastic_rounding": True}),
                        ("rot", {"gradient_rotation": 32}),
                        ("rules", {"rules": [{"match": "ln", "gradient_bits": None}]}),
                        ("bits", {"replicate_bits": 3})):
        out[key] = error_message(lambda kw=kwargs: zeropp.fsdp.enable(_model(mesh), **kw))
    flat = init_device_mesh("cpu", (world,))
    out["flat"] = error_message(lambda: zeropp.fsdp.enable(_model(flat), replicate_bits=8))
    before = _model(mesh)
    before.set_all_reduce_hook(lambda output: None)
    out["hook_before"] = error_message(lambda: zeropp.fsdp.enable(before))
    after = _model(mesh)
    zeropp.fsdp.enable(after, weight_bits=None, gradient_bits=None)
    after.set_all_reduce_hook(lambda output: None)
    out["hook_after"] = error_message(lambda: after(*_batch(torch.Generator().manual_seed(rank))))
    model = _model(mesh)
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=None)
    model.set_requires_all_reduce(False)
    _, loss = model(*_batch(torch.Generator().manual_seed(rank)))
    out["no_all_reduce"] = error_message(loss.backward)
    return out


def all_runs(rank: int, world: int, path: str) -> dict[str, Any]:
    """Everything test_fsdp_hsdp.py checks, in one launch (the misuses last: they leave a backward failed)."""
    mesh = _mesh()
    out: dict[str, Any] = {"plain": _train(_model(mesh), rank)}
    exact = _model(mesh)
    zeropp.fsdp.enable(exact, weight_bits=None, gradient_bits=None)
    out["exact"] = _train(exact, rank)
    quantized = _model(mesh)
    zeropp.fsdp.enable(quantized, weight_bits=8, gradient_bits=4)
    out["quantized"] = _train(quantized, rank, QUANTIZED_STEPS)
    out["hook"] = _hook_case(rank, world)
    out["dcp"] = _dcp_case(quantized, rank, path)
    dist.barrier()
    out["tp"] = tp_runs(rank, world, path)
    dist.barrier()
    out["misuse"] = _misuse(rank, world)
    return out
