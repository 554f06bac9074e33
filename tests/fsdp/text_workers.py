"""Workers for test_fsdp_mesh_text.py: 200 AdamW steps on real text (``zeropp.data``'s stdlib bytes) on three 8-rank
meshes, each plain, with zeropp's exact comms and with qwZ int8 / qgZ int4 (HSDP: + the int4 cross-replica
all-reduce):

* ``hsdp``: the tiny GPT on FSDP2's HSDP, a (replicate 2, shard 4) mesh (``hsdp_workers``' mesh and wrapping), every
  rank its own 2 sequences of a global batch of 16;
* ``3d``: a byte-level stage model on dp 2 x tp 2 x pp 2 (``mesh_workers``' mesh, blocks and pipeline:
  ``torch.distributed.pipelining``'s 1F1B over 2 micro-batches; stage 0 embeds the bytes and runs two blocks, stage
  1 runs two blocks, the final LayerNorm and the output head), every dp rank its own 4 sequences of a global batch
  of 8 (its tp and pp peers the same);
* ``hsdp_tp``: the whole byte-level model (both stages' layers, no pipeline) on HSDP with tensor parallelism, a
  (replicate 2, shard 2, tp 2) mesh (``hsdp_workers``' mesh and wrapping), every dp rank its own 2 sequences of a
  global batch of 8.

Per run, the losses this rank computed (one per step; none on pipeline stage 0) and the full parameters after."""

from __future__ import annotations

import time
from typing import Any

import torch
from hsdp_workers import _mesh as _hsdp_mesh
from hsdp_workers import _model as _hsdp_model
from hsdp_workers import _tp_world
from mesh_workers import MICROBATCHES, Block, pipeline, pipeline_step, shard_tp_dp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zeropp.fsdp
from zeropp.data import TextBatches, stdlib_corpus

STEPS, SEQ, VOCAB = 200, 32, 256
HSDP_BATCH, MESH_BATCH = 16, 8  # global sequences per step
DIM, HIDDEN = 32, 64  # the stage model's width (tp 2 divides HIDDEN)


class TextStage(nn.Module):
    """Pipeline stage ``pp`` of a byte-level model: stage 0 ``Embedding(256, DIM)`` then two ``mesh_workers.Block``,
    stage 1 two blocks, a LayerNorm and a ``Linear(DIM, 256)`` head (logits ``(batch, SEQ, 256)``); ``pp`` None:
    the whole model, embedding, two blocks and the head."""

    def __init__(self, pp: int | None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(pp or 0)
        self.embed = nn.Embedding(VOCAB, DIM) if pp != 1 else None
        self.blocks = nn.ModuleList([Block(gen, DIM, HIDDEN), Block(gen, DIM, HIDDEN)])
        self.norm = nn.LayerNorm(DIM) if pp != 0 else None
        self.head = nn.Linear(DIM, VOCAB) if pp != 0 else None
        with torch.no_grad():
            for p in (*(self.embed.parameters() if self.embed else ()), *(self.head.parameters() if self.head else ())):
                p.normal_(0.0, 0.1, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _text_stage(world: DeviceMesh, pp: int) -> TextStage:
    """``TextStage(pp)``: blocks tensor-parallel over ``world["tp"]``; each block, then the stage, ``fully_shard``-ed
    over ``world["dp"]``."""
    return shard_tp_dp(TextStage(pp), world)


def _hsdp_tp_model(world: DeviceMesh) -> TextStage:
    """``TextStage(None)``: blocks tensor-parallel over ``world["tp"]``; each block, then the model, ``fully_shard``-ed
    over ``world["replicate", "shard"]``."""
    model = TextStage(None)
    for block in model.blocks:
        parallelize_module(block, world["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=world["replicate", "shard"])
    return fully_shard(model, mesh=world["replicate", "shard"])


def _train_hsdp_tp(model: TextStage, world: DeviceMesh, data: TextBatches) -> tuple[list[float], dict]:
    """AdamW steps, dp rank ``replicate * shards + shard`` its own sequences (its tp peer the same)."""
    coord = dict(zip(world.mesh_dim_names, world.get_coordinate()))
    shards = world["shard"].size()
    dp, dps = coord["replicate"] * shards + coord["shard"], world["replicate"].size() * shards
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        inputs, targets = data.micro_batch(step, rank=dp, world_size=dps)
        loss = nn.functional.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _train_hsdp(model: nn.Module, rank: int, world: int, data: TextBatches) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        _, loss = model(*data.micro_batch(step, rank=rank, world_size=world))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _train_3d(model: TextStage, world: DeviceMesh, data: TextBatches) -> tuple[list[float], dict]:
    """As ``mesh_workers._train``, on bytes: ``mesh_workers.pipeline`` with activations ``(batch, SEQ, DIM)`` per
    micro-batch, the cross-entropy of the last stage's logits as the loss."""
    dp = world.get_local_rank("dp")
    micro = MESH_BATCH // world["dp"].size() // MICROBATCHES
    schedule = pipeline(model, world, torch.zeros(micro, SEQ, dtype=torch.long), (micro, SEQ, DIM), (micro, SEQ, VOCAB),
                        lambda logits, targets: nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                                            targets.reshape(-1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        inputs, targets = data.micro_batch(step, rank=dp, world_size=world["dp"].size())
        loss = pipeline_step(schedule, world, inputs, targets)
        if loss is not None:
            losses.append(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def text_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Per mesh (``hsdp``, ``3d``, ``hsdp_tp``) and comms (``plain``, ``exact``, ``quantized``): ``(losses, params)``; the
    mesh coordinates of ``3d``; ``seconds``: this rank's wall time per mesh."""
    corpus = stdlib_corpus()
    out: dict[str, Any] = {"hsdp": {}, "3d": {}, "seconds": {}}
    start = time.perf_counter()
    mesh = _hsdp_mesh()
    data = TextBatches(corpus, seq_len=SEQ, global_batch=HSDP_BATCH, seed=0)
    for comms in ("plain", "exact", "quantized"):
        model = _hsdp_model(mesh)
        if comms != "plain":
            bits = (8, 4) if comms == "quantized" else (None, None)
            zeropp.fsdp.enable(model, weight_bits=bits[0], gradient_bits=bits[1])
        out["hsdp"][comms] = _train_hsdp(model, rank, world_size, data)
    out["seconds"]["hsdp"] = time.perf_counter() - start
    start = time.perf_counter()
    world = init_device_mesh("cpu", (2, 2, world_size // 4), mesh_dim_names=("dp", "tp", "pp"))
    out["3d"]["coord"] = dict(zip(world.mesh_dim_names, world.get_coordinate()))
    data = TextBatches(corpus, seq_len=SEQ, global_batch=MESH_BATCH, seed=1)
    topology = None
    for comms in ("plain", "exact", "quantized"):
        model = _text_stage(world, out["3d"]["coord"]["pp"])
        if comms == "exact":
            topology = zeropp.fsdp.enable(model, weight_bits=None, gradient_bits=None)
        elif comms == "quantized":
            zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4, topology=topology)
        out["3d"][comms] = _train_3d(model, world, data)
    out["seconds"]["3d"] = time.perf_counter() - start
    hsdp_tp_runs(out, corpus)
    return out


def hsdp_tp_runs(out: dict[str, Any], corpus: torch.Tensor) -> None:
    """``out["hsdp_tp"][comms]`` for the three comms on the (replicate 2, shard 2, tp 2) mesh, and its seconds."""
    start = time.perf_counter()
    world = _tp_world()
    data = TextBatches(corpus, seq_len=SEQ, global_batch=MESH_BATCH, seed=2)
    out["hsdp_tp"] = {}
    for comms in ("plain", "exact", "quantized"):
        model = _hsdp_tp_model(world)
        if comms != "plain":
            bits = (8, 4) if comms == "quantized" else (None, None)
            zeropp.fsdp.enable(model, weight_bits=bits[0], gradient_bits=bits[1])
        out["hsdp_tp"][comms] = _train_hsdp_tp(model, world, data)
    out["seconds"]["hsdp_tp"] = time.perf_counter() - start
