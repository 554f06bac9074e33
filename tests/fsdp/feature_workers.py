"""Workers for test_fsdp_features.py: FSDP2 features under ``zeropp.fsdp`` comms, each run beside plain FSDP2 on
the same data — mixed precision policies, gradient accumulation with ``set_requires_gradient_sync``, and DCP
checkpoints saved under one set of comms and loaded under the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import zeropp.fsdp
from zeropp import comm
from zeropp.fsdp import ZeroppAllGather, ZeroppReduceScatter
from zeropp.fsdp.segments import shard_numels
from zeropp.models import GPT, GPTConfig
from zeropp.quant import DEFAULT_BLOCK_SIZE

BATCH, SEQ, LR = 2, 32, 3e-3
MP_STEPS = 3
ACCUM_STEPS, MICRO_BATCHES = 2, 3
DCP_STEPS = 2
# name -> (param_dtype, reduce_dtype). reduce_dtype is always given: left None, FSDP2 reduces in param_dtype up to
# torch 2.14 and, from 2.15, in the parameters' own dtype (fp32 here)
POLICIES = {
    "bf16-fp32": (torch.bfloat16, torch.float32),
    "bf16-bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
}
COMMS = {"exact": (None, None), "quantized": (8, 4)}


def _model(mesh: DeviceMesh, policy: str | None = None) -> GPT:
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    mp = MixedPrecisionPolicy()
    if policy is not None:
        param_dtype, reduce_dtype = POLICIES[policy]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _optimizer(model: GPT) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _batches(rank: int, seed: int, count: int) -> list[torch.Tensor]:
    """``count`` rank-specific batches of random bytes, the same for every run with this ``seed``."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen) for _ in range(count)]


def _step(model: GPT, opt: torch.optim.Optimizer, micro: list[torch.Tensor], calls: list | None = None) -> list[float]:
    """One optimizer step over ``micro`` micro-batches; FSDP2 reduce-scatters gradients only on the last one. With
    ``calls``: appends each micro-batch's zeropp collective calls ({kind: count})."""
    losses = []
    for i, idx in enumerate(micro):
        if calls is not None:
            comm.reset_stats()
        model.set_requires_gradient_sync(i == len(micro) - 1)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        (loss / len(micro)).backward()
        losses.append(loss.item())
        if calls is not None:
            stats = comm.stats()
            calls.append({kind: stats.get(kind, {}).get("calls", 0) for kind in ("all_gather", "reduce_scatter")})
    opt.step()
    opt.zero_grad(set_to_none=True)
    return losses


def _full_params(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


class _RecordingAllGather(ZeroppAllGather):
    """``ZeroppAllGather`` that notes what FSDP2 passes it: (input dtype, output dtype, input numel, P)."""

    def __init__(self, *args: Any, seen: list) -> None:
        super().__init__(*args)
        self.seen = seen

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        self.seen.append((str(input_tensor.dtype), str(output_tensor.dtype), input_tensor.numel(),
                          output_tensor.numel() // input_tensor.numel()))
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _RecordingReduceScatter(ZeroppReduceScatter):
    """``ZeroppReduceScatter`` that notes what FSDP2 passes it: (input dtype, output dtype, input numel, op)."""

    def __init__(self, *args: Any, seen: list) -> None:
        super().__init__(*args)
        self.seen = seen

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        self.seen.append((str(input_tensor.dtype), str(output_tensor.dtype), input_tensor.numel(), str(op)))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _enable_recording(model: GPT, comms: str) -> dict[str, list]:
    """``zeropp.fsdp.enable`` with ``comms``' bits, then the same hooks with recorders, on every FSDP2 module (an
    all-gather per module, with its parameter segments, as ``enable`` installs them)."""
    wbits, gbits = COMMS[comms]
    topology = zeropp.fsdp.enable(model, weight_bits=wbits, gradient_bits=gbits)
    seen: dict[str, list] = {"all_gather": [], "reduce_scatter": []}
    reduce_scatter = _RecordingReduceScatter(topology, gbits, DEFAULT_BLOCK_SIZE, seen=seen["reduce_scatter"])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(_RecordingAllGather(topology, wbits, DEFAULT_BLOCK_SIZE, shard_numels(m),
                                                        seen=seen["all_gather"]))
            m.set_custom_reduce_scatter(reduce_scatter)
    return seen


def mixed_precision(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    """Per policy: plain FSDP2, zeropp exact, zeropp qwZ int8 + qgZ int4 — losses, final fp32 parameters, and for
    zeropp what FSDP2 passed the hooks and the byte counters."""
    out: dict[str, Any] = {}
    batches = _batches(rank, 1, MP_STEPS)
    for policy in POLICIES:
        model = _model(mesh, policy)
        opt = _optimizer(model)
        losses = [loss for idx in batches for loss in _step(model, opt, [idx])]
        out[policy, "plain"] = {"losses": losses, "params": _full_params(model)}
        for comms in COMMS:
            model = _model(mesh, policy)
            seen = _enable_recording(model, comms)
            opt = _optimizer(model)
            comm.reset_stats()
            losses = [loss for idx in batches for loss in _step(model, opt, [idx])]
            out[policy, comms] = {"losses": losses, "params": _full_params(model), "seen": seen,
                                  "stats": comm.stats()}
    return out


def accumulation(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    """ACCUM_STEPS optimizer steps of MICRO_BATCHES micro-batches each (sync on the last): plain FSDP2 and zeropp
    exact / quantized — losses, parameters, and for zeropp the calls each micro-batch made."""
    out: dict[str, Any] = {}
    batches = _batches(rank, 2, ACCUM_STEPS * MICRO_BATCHES)
    steps = [batches[i:i + MICRO_BATCHES] for i in range(0, len(batches), MICRO_BATCHES)]
    model = _model(mesh)
    opt = _optimizer(model)
    losses = [loss for micro in steps for loss in _step(model, opt, micro)]
    out["plain"] = {"losses": losses, "params": _full_params(model)}
    for comms, (wbits, gbits) in COMMS.items():
        model = _model(mesh)
        zeropp.fsdp.enable(model, weight_bits=wbits, gradient_bits=gbits)
        opt = _optimizer(model)
        calls: list[dict[str, int]] = []
        losses = [loss for micro in steps for loss in _step(model, opt, micro, calls)]
        out[comms] = {"losses": losses, "params": _full_params(model), "calls": calls}
    return out


def _full(value: Any) -> Any:
    """``value`` (a state dict, nested) with every DTensor replaced by its full tensor and every tensor copied."""
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _save(model: GPT, opt: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """DCP-save model and optimizer through the public state-dict API; returns their full state."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    return _full({"model": model_sd, "optim": optim_sd})


def _load(model: GPT, opt: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """DCP-load ``path`` into a fresh model and optimizer; returns their full state afterwards."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(dict(zip(("model", "optim"), get_state_dict(model, opt))))


def _built(mesh: DeviceMesh, comms: str) -> tuple[GPT, torch.optim.Optimizer]:
    """A fresh tiny GPT under ``comms`` ("plain": FSDP2's own, else a key of COMMS) and its optimizer."""
    model = _model(mesh)
    if comms != "plain":
        zeropp.fsdp.enable(model, weight_bits=COMMS[comms][0], gradient_bits=COMMS[comms][1])
    return model, _optimizer(model)


def checkpoints(rank: int, mesh: DeviceMesh, ckpt_dir: Path) -> dict[str, Any]:
    """DCP across comms ("plain", "exact", "quantized"). Each saver trains DCP_STEPS steps, saves, then takes one
    more step; each loader is a fresh model that loads a saver's checkpoint and takes that same step. Returns, per
    saver and per (saver, loader), the full state saved / loaded and the continuation's loss and parameters."""
    batches = _batches(rank, 3, DCP_STEPS + 1)
    out: dict[str, Any] = {"saved": {}, "loaded": {}}
    for comms in ("plain", "exact", "quantized"):
        model, opt = _built(mesh, comms)
        for idx in batches[:DCP_STEPS]:
            _step(model, opt, [idx])
        state = _save(model, opt, ckpt_dir / comms)
        loss = _step(model, opt, [batches[DCP_STEPS]])[0]
        out["saved"][comms] = {"state": state, "loss": loss, "params": _full_params(model)}
    for saver, loader in (("quantized", "plain"), ("exact", "plain"), ("plain", "exact"), ("plain", "quantized")):
        model, opt = _built(mesh, loader)
        state = _load(model, opt, ckpt_dir / saver)
        loss = _step(model, opt, [batches[DCP_STEPS]])[0]
        out["loaded"][saver, loader] = {"state": state, "loss": loss, "params": _full_params(model)}
    return out


def features(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """All three scenario sets on one 1-D mesh over the ``world`` ranks (``ckpt_dir``: shared by the ranks)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {
        "mixed_precision": mixed_precision(rank, mesh),
        "accumulation": accumulation(rank, mesh),
        "checkpoints": checkpoints(rank, mesh, Path(ckpt_dir)),
    }
    dist.barrier()
    return out
