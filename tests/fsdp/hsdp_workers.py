"""Workers for test_fsdp_hsdp.py: the tiny GPT trained with FSDP2's native HSDP on a (2, 4) mesh and with zeropp's
comms on the same mesh (exact and quantized), the per-step bytes, the quantized all-reduce hook on fresh inputs,
DCP checkpoints across the two, and the misuses ``enable`` refuses on HSDP."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_workers import error_message
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import zeropp.fsdp
from zeropp import comm
from zeropp.fsdp.hsdp import ReplicaAllReduce
from zeropp.models import GPT, GPTConfig

STEPS, QUANTIZED_STEPS, BATCH, SEQ, REPLICAS, SHARDS = 10, 5, 2, 32, 2, 4
HOOK_NUMEL, HOOK_BLOCK = 1001, 64


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
    out["misuse"] = _misuse(rank, world)
    return out
