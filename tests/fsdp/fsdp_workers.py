"""Workers for test_fsdp_comms.py: the tiny GPT trained with plain FSDP2 and with FSDP2 + ``zeropp.fsdp`` comms
on the same data, and the misuses ``zeropp.fsdp.enable`` must refuse."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp.fsdp
from zeropp import comm
from zeropp.models import GPT, GPTConfig

STEPS, BATCH, SEQ = 10, 2, 32


def _model(mesh: Any, dtype: str) -> GPT:
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    mp = MixedPrecisionPolicy()
    if dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train(model: GPT, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS AdamW steps on random bytes (rank-specific, the same for every run); the losses of this rank and the
    full parameters afterwards."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(STEPS):
        idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return losses, full


def train_runs(rank: int, world: int, dtype: str) -> dict[str, Any]:
    """Plain FSDP2, FSDP2 + zeropp exact comms, FSDP2 + qwZ int8 / qgZ int4: losses, parameters, byte counters."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    out["plain"] = _train(_model(mesh, dtype), rank)
    for name, wbits, gbits in (("exact", None, None), ("quantized", 8, 4)):
        model = _model(mesh, dtype)
        zeropp.fsdp.enable(model, weight_bits=wbits, gradient_bits=gbits)
        comm.reset_stats()
        out[name] = _train(model, rank)
        out[name + "_stats"] = comm.stats()
    return out


def _message(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def misuse(rank: int, world: int) -> dict[str, str]:
    """What enable (and a step under it) says for: a 2-D (HSDP) mesh, a topology of other ranks, a custom gradient
    divide factor."""
    out = {}
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = _message(lambda: zeropp.fsdp.enable(_model(mesh2, "fp32")))
    mesh = init_device_mesh("cpu", (world,))
    model = _model(mesh, "fp32")
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=None)
    model.set_gradient_divide_factor(3.0)
    idx = torch.randint(0, 256, (1, 9))

    def step() -> None:
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    out["divide_factor"] = _message(step)
    # last: the subgroups this topology creates on ranks 0 and 1 only would shift later group creation
    pair = dist.new_group([0, 1])  # every rank takes part in creating a group
    if rank < 2:
        topo = comm.Topology(pair, ranks_per_node=1)
        out["topology"] = _message(lambda: zeropp.fsdp.enable(_model(mesh, "fp32"), topology=topo))
    return out
