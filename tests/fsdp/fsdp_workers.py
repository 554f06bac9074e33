"""Workers for test_fsdp_comms.py: the tiny GPT trained with plain FSDP2 and with FSDP2 + ``zeropp.fsdp`` comms
on the same data, the weights a qwZ forward computes with, and the misuses ``zeropp.fsdp.enable`` must refuse."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp.fsdp
from zeropp import comm
from zeropp.models import GPT, GPTConfig

STEPS, BATCH, SEQ = 10, 2, 32


def _model(mesh: Any, dtype: str, model: GPT | None = None, tail_group: bool = False) -> GPT:
    """``fully_shard`` per block, then the root; with ``tail_group``, in between, ONE ``fully_shard`` over the final
    LayerNorm, the embedding and the head tied to it, as accelerate wraps a model (its group's flat input:
    ``ln_f.weight``, ``ln_f.bias``, ``wte.weight``; the root keeps ``wpe``)."""
    model = GPT(GPTConfig.preset("tiny"), seed=0) if model is None else model
    mp = MixedPrecisionPolicy()
    if dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    if tail_group:
        fully_shard([model.ln_f, model.wte, model.lm_head], mesh=mesh, mp_policy=mp)
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


def varied_gpt() -> GPT:
    """The tiny GPT with every bias drawn from N(0, 0.02) and every LayerNorm gain from N(1, 0.1) (GPT-2's init
    makes them 0 and 1, which any quantizer rounds exactly), the same on every rank."""
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.1, generator=gen)
            for pname, p in module.named_parameters(recurse=False):
                if pname == "bias":
                    p.normal_(0.0, 0.02, generator=gen)
    return model


def forward_weights(mesh: Any, bits: int, tail_group: bool = False) -> dict[str, Any]:
    """Every parameter of ``varied_gpt`` (wrapped by ``_model``) as one qwZ forward (``weight_bits=bits``) computes
    with, read by a forward pre-hook on its module after FSDP2's all-gather, by name; and the warnings raised."""
    model = _model(mesh, "fp32", varied_gpt(), tail_group)
    zeropp.fsdp.enable(model, weight_bits=bits, gradient_bits=None)
    seen: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            def grab(m: nn.Module, args: Any, prefix: str = prefix) -> None:
                for pname, p in m.named_parameters(recurse=False):
                    seen[f"{prefix}.{pname}"] = p.detach().clone()
            module.register_forward_pre_hook(grab)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(0)))
    return {"weights": seen, "warnings": [str(w.message) for w in caught]}


HOOK_SEGMENTS = (100, 300, 28)


def hook_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s all-gather input for ``hook_calls``: ``sum(HOOK_SEGMENTS)`` floats whose segments have
    absmaxes 1000x apart, so blocks that straddle two segments are easy to tell from blocks that do not."""
    gen = torch.Generator().manual_seed(70 + rank)
    scales = torch.cat([torch.full((n,), 10.0 ** (3 * (i % 2) - 2)) for i, n in enumerate(HOOK_SEGMENTS)])
    return torch.randn(sum(HOOK_SEGMENTS), generator=gen) * scales


def hook_calls(rank: int, world: int) -> dict[str, Any]:
    """``ZeroppAllGather`` (int8, block 128) called as FSDP2 calls it (the input a view of the output) with the
    segments of its input, and twice with segments that do not add up to it: the outputs and the warnings."""
    topo = comm.Topology()
    n = sum(HOOK_SEGMENTS)
    out: dict[str, Any] = {}
    for name, segments, calls in (("segments", HOOK_SEGMENTS, 1), ("mismatch", HOOK_SEGMENTS[:2], 2)):
        hook = zeropp.fsdp.ZeroppAllGather(topo, 8, 128, segments)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(calls):
                gathered = torch.empty(world * n)
                gathered[rank * n:(rank + 1) * n] = hook_input(rank)
                hook(gathered, gathered[rank * n:(rank + 1) * n], topo.group)
        out[name] = {"output": gathered, "warnings": [str(w.message) for w in caught]}
    return out


def train_runs(rank: int, world: int, dtype: str) -> dict[str, Any]:
    """Plain FSDP2, FSDP2 + zeropp exact comms, FSDP2 + qwZ int8 / qgZ int4: losses, parameters, byte counters;
    the weights a qwZ int8 / int4 forward computes with (``forward_weights``), wrapped per block and with the
    accelerate-like tail group; the hook called directly (``hook_calls``)."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"forward_weights": {(bits, tail): forward_weights(mesh, bits, tail)
                                               for bits in (8, 4) for tail in (False, True)},
                           "hook": hook_calls(rank, world)}
    out["plain"] = _train(_model(mesh, dtype), rank)
    for name, wbits, gbits in (("exact", None, None), ("quantized", 8, 4)):
        model = _model(mesh, dtype)
        zeropp.fsdp.enable(model, weight_bits=wbits, gradient_bits=gbits)
        comm.reset_stats()
        out[name] = _train(model, rank)
        out[name + "_stats"] = comm.stats()
    return out


def error_message(fn: Any) -> str:
    """``"TypeName: message"`` of the ValueError or TypeError ``fn()`` raises, else ``"no error"``."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def misuse(rank: int, world: int) -> dict[str, str]:
    """What enable (and a step under it) says for: hpZ on a 2-D (HSDP) mesh, a topology of other ranks, a custom
    gradient divide factor."""
    out = {}
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = error_message(lambda: zeropp.fsdp.enable(_model(mesh2, "fp32"), hpz=2))
    mesh = init_device_mesh("cpu", (world,))
    model = _model(mesh, "fp32")
    zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=None)
    model.set_gradient_divide_factor(3.0)
    idx = torch.randint(0, 256, (1, 9))

    def step() -> None:
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    out["divide_factor"] = error_message(step)
    # last: the subgroups this topology creates on ranks 0 and 1 only would shift later group creation
    pair = dist.new_group([0, 1])  # every rank takes part in creating a group
    if rank < 2:
        topo = comm.Topology(pair, ranks_per_node=1)
        out["topology"] = error_message(lambda: zeropp.fsdp.enable(_model(mesh, "fp32"), topology=topo))
    return out
