"""Workers for test_fsdp_meshes.py: a tiny residual MLP trained on a 3-D world mesh (dp 2 x tp 2 x pp 2: tensor
parallel up/down projections, FSDP2 over dp, ``torch.distributed.pipelining``'s 1F1B schedule of 2 stages over pp)
and on a 2-D one (dp 4 x tp 2),
each plain, with zeropp's exact comms and with qwZ int8 / qgZ int4; the weights a qwZ forward computes with; DCP
checkpoints across the three on the 2-D mesh."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from feature_workers import _full
from fsdp_workers import error_message
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zeropp.fsdp
from zeropp import comm
from zeropp.fsdp.segments import shard_numels

STEPS, BATCH, DIM, HIDDEN = 10, 4, 12, 42  # HIDDEN / tp = 21 rows: uneven FSDP shards, padded
MICROBATCHES = 2  # per pipelined step
EF_STEPS = 4  # pipelined steps of the error-feedback check


class Block(nn.Module):
    """``x + down(tanh(up(norm(x))))`` on the last dim (``dim`` wide, ``hidden`` inside); ``up`` column-, ``down``
    row-parallel over tp, ``norm`` plain."""

    def __init__(self, gen: torch.Generator, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        with torch.no_grad():  # no 0 / 1 that any quantizer rounds exactly
            for p in self.parameters():
                p.normal_(0.0, 0.3, generator=gen)
            self.norm.weight.add_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Stage(nn.Module):
    """Two blocks and a final LayerNorm: one pipeline stage (FSDP2 units: each block, then the stage)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList([Block(gen), Block(gen)])
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def stage(world: DeviceMesh, seed: int) -> Stage:
    """``Stage(seed)`` tensor-parallel over ``world["tp"]``, each block and then the stage ``fully_shard``-ed over
    ``world["dp"]``."""
    return shard_tp_dp(Stage(seed), world)


def shard_tp_dp(model: nn.Module, world: DeviceMesh) -> Any:
    """``model`` with each of its ``blocks`` tensor-parallel over ``world["tp"]`` (``up`` column-, ``down``
    row-wise) and ``fully_shard``-ed over ``world["dp"]``, then the whole ``fully_shard``-ed over ``world["dp"]``."""
    for block in model.blocks:
        parallelize_module(block, world["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    return model


def _batch(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and target of data-parallel rank ``dp`` at ``step`` (the same on its tp and pp peers)."""
    gen = torch.Generator().manual_seed(1000 * dp + step)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)


def pipeline(model: nn.Module, world: DeviceMesh, inputs: torch.Tensor, activations: tuple[int, ...],
             outputs: tuple[int, ...], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Schedule1F1B:
    """``torch.distributed.pipelining``'s 1F1B schedule of ``MICROBATCHES`` micro-batches over ``world["pp"]``, with
    ``model`` as this rank's stage (torchtitan's recipe: FSDP2 on the stage module). Static shapes, per micro-batch:
    the first stage takes ``inputs`` (an example micro-batch), stages exchange activations of shape
    ``activations``, the last stage's output has shape ``outputs`` and ``loss_fn(output, target)`` is its loss (the
    gradients are divided by ``MICROBATCHES``: the mean over micro-batches)."""
    pp, stages = world.get_local_rank("pp"), world["pp"].size()
    received = inputs if pp == 0 else torch.empty(activations, requires_grad=True)
    sent = torch.empty(outputs if pp == stages - 1 else activations, requires_grad=True)
    stage = PipelineStage(model, pp, stages, torch.device("cpu"), input_args=(received,), output_args=(sent,),
                          group=world.get_group("pp"))
    return Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)


def pipeline_step(schedule: Schedule1F1B, world: DeviceMesh, x: torch.Tensor, target: torch.Tensor) -> float | None:
    """One step of ``schedule`` (``pipeline``'s on ``world``) on the batch ``x`` (used by the first stage) and
    ``target`` (by the last), cut into its micro-batches along dim 0: forward and backward of every micro-batch,
    then FSDP2's gradient reduction. The mean of the micro-batches' losses on the last stage, None on the others."""
    pp, stages = world.get_local_rank("pp"), world["pp"].size()
    if pp == 0:
        schedule.step(x)
        return None
    if pp < stages - 1:
        schedule.step()
        return None
    losses: list[torch.Tensor] = []
    schedule.step(target=target, losses=losses)
    return sum(loss.item() for loss in losses) / len(losses)


def _train(model: Stage, world: DeviceMesh, opt: torch.optim.Optimizer,
           steps: range = range(STEPS)) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Adam steps on the batches of ``steps``: with a pp dim, through ``pipeline`` (``MICROBATCHES`` micro-batches
    of ``BATCH / MICROBATCHES`` rows per step; the loss is the last stage's); without, forward and backward of the
    whole batch. The losses this rank computed (none but on the last stage) and the full parameters afterwards."""
    coord = dict(zip(world.mesh_dim_names, world.get_coordinate()))
    schedule = None
    if "pp" in coord:
        micro = (BATCH // MICROBATCHES, DIM)
        schedule = pipeline(model, world, torch.empty(micro), micro, micro, nn.functional.mse_loss)
    losses = []
    for step in steps:
        x, target = _batch(coord["dp"], step)
        if schedule is None:
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            losses.append(loss.item())
        else:
            mean = pipeline_step(schedule, world, x, target)
            if mean is not None:
                losses.append(mean)
        opt.step()
        opt.zero_grad(set_to_none=True)
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return losses, full


def _adam(model: Stage) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def _checkpoints(world: DeviceMesh, trained: dict[str, tuple[Stage, torch.optim.Optimizer]],
                 ckpt_dir: Path) -> dict[str, Any]:
    """DCP across comms on ``world`` (no pp dim: one checkpoint of the whole world): each ``trained`` run
    ("plain", "exact", "quantized") saves model and optimizer through the public state-dict API, then takes one
    more step; a fresh stage under other comms loads a saver's checkpoint and takes that same step. Per saver and
    per (saver, loader): the full state saved / loaded, the step's losses and parameters."""
    out: dict[str, Any] = {"saved": {}, "loaded": {}}
    for comms, (model, opt) in trained.items():
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir / comms))
        state = _full({"model": model_sd, "optim": optim_sd})
        out["saved"][comms] = {"state": state, "step": _train(model, world, opt, range(STEPS, STEPS + 1))}
    for saver, loader in (("exact", "plain"), ("quantized", "plain"), ("plain", "quantized")):
        model = stage(world, 0)
        if loader == "quantized":
            zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4)
        opt = _adam(model)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(ckpt_dir / saver))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["loaded"][saver, loader] = {"state": _full(dict(zip(("model", "optim"), get_state_dict(model, opt)))),
                                        "step": _train(model, world, opt, range(STEPS, STEPS + 1))}
    return out


def _forward_weights(model: Stage, world: DeviceMesh) -> dict[str, torch.Tensor]:
    """Every parameter as this rank's first forward computes with it, after FSDP2's all-gather (the tensor-parallel
    local tensor of a DTensor), by name; one forward, no backward."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            def grab(m: nn.Module, args: Any, prefix: str = prefix) -> None:
                for pname, p in m.named_parameters(recurse=False):
                    local = p.to_local() if isinstance(p, DTensor) else p
                    seen[f"{prefix}.{pname}"] = local.detach().clone()
            handles.append(module.register_forward_pre_hook(grab))
    with torch.no_grad():
        model(_batch(0, 0)[0])
    model.reshard()  # the root keeps its gathered weights after forward; training starts from the sharded state
    for h in handles:
        h.remove()
    return seen


def _error_feedback_sums(world: DeviceMesh, topology: comm.Topology) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Pipelined steps (``pipeline``) on one fixed batch with no optimizer step, so every step's gradients are the
    same: exact weights, and exact gradients (``exact``, one step) or qgZ int4 with error feedback (``ef``,
    ``EF_STEPS`` steps). After each step, this rank's shard of every reduced gradient summed over the steps so far
    (float64), by name."""
    coord = dict(zip(world.mesh_dim_names, world.get_coordinate()))
    x, target = _batch(coord["dp"], 0)
    micro = (BATCH // MICROBATCHES, DIM)
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for comms, bits, steps in (("exact", None, 1), ("ef", 4, EF_STEPS)):
        model = stage(world, coord["pp"])
        zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=bits, error_feedback=bits is not None,
                           topology=topology)
        schedule = pipeline(model, world, torch.empty(micro), micro, micro, nn.functional.mse_loss)
        sums = {name: torch.zeros(p.to_local().shape, dtype=torch.float64) for name, p in model.named_parameters()}
        out[comms] = []
        for _ in range(steps):
            pipeline_step(schedule, world, x, target)
            for name, p in model.named_parameters():
                sums[name] += p.grad.to_local().double()
            model.zero_grad(set_to_none=True)
            out[comms].append({name: t.clone() for name, t in sums.items()})
    return out


def mesh_runs(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    """Per mesh (``3d``: dp x tp x pp = 2 x 2 x 2; ``2d``: dp x tp = 4 x 2): plain FSDP2 + TP, zeropp exact
    (topology derived by enable), zeropp qwZ int8 / qgZ int4 (losses, parameters, byte counters, the segments of
    each FSDP2 unit); for ``3d``, the weights a qwZ int8 forward computes with and the gradient sums of
    ``_error_feedback_sums``; for ``2d``, DCP checkpoints across
    the three (``_checkpoints``, in ``ckpt_dir``, shared by the ranks). Ranks' coordinates included. ``hpz``: what
    enable says for ``hpz=2`` on the 2-D mesh."""
    meshes = {"3d": init_device_mesh("cpu", (2, 2, world_size // 4), mesh_dim_names=("dp", "tp", "pp")),
              "2d": init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))}
    out: dict[str, Any] = {}
    for key, world in meshes.items():
        coord = dict(zip(world.mesh_dim_names, world.get_coordinate()))
        seed = coord.get("pp", 0)
        res: dict[str, Any] = {"coord": coord}
        trained = {"plain": stage(world, seed)}
        trained["exact"] = stage(world, seed)
        topology = zeropp.fsdp.enable(trained["exact"], weight_bits=None, gradient_bits=None)
        res["nodes"] = topology.nodes
        res["segments"] = [shard_numels(m) for m in (*trained["exact"].blocks, trained["exact"])]
        trained["quantized"] = stage(world, seed)
        zeropp.fsdp.enable(trained["quantized"], weight_bits=8, gradient_bits=4, topology=topology)
        if key == "3d":
            res["forward_weights"] = _forward_weights(trained["quantized"], world)
        opts = {}
        for comms, model in trained.items():
            opts[comms] = _adam(model)
            comm.reset_stats()
            res[comms] = _train(model, world, opts[comms])
            res[comms + "_stats"] = comm.stats()
        if key == "3d":
            res["error_feedback"] = _error_feedback_sums(world, topology)
        if key == "2d":
            res["checkpoints"] = _checkpoints(world, {k: (m, opts[k]) for k, m in trained.items()}, Path(ckpt_dir))
        out[key] = res
    out["hpz"] = error_message(lambda: zeropp.fsdp.enable(stage(meshes["2d"], 0), hpz=2))
    return out
