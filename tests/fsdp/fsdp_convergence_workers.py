"""Worker for ``test_fsdp_convergence.py``: the tiny GPT trained under FSDP2 with zeropp's exact comms (bit-identical
to plain FSDP2, tests/fsdp/test_fsdp_comms.py) and with full ZeRO++ (qwZ int8, hpZ by ``reshard_after_forward``,
qgZ int4), in one process group, on real text from ``zeropp.data``."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from gpt_units import gpt_unit_segments
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import zeropp.fsdp
from zeropp import comm
from zeropp.data import TextBatches, stdlib_corpus
from zeropp.models import GPT, GPTConfig

SEQ, GLOBAL_BATCH, LR, WEIGHT_DECAY = 32, 16, 1e-3, 0.1
CORPUS_BYTES = 1 << 20
EVAL_BATCHES, EVAL_SEED = 8, 777
HPZ = 2  # ranks per emulated node: the post-forward (hpZ) group


def train(rank: int, world: int, full: bool, steps: int, data: TextBatches, evals: list) -> dict[str, Any]:
    """``steps`` AdamW steps (clipping 1.0); per-step training losses and the eval loss (both averaged over the
    ranks), zeropp's byte counters over the training steps, wall seconds, and each FSDP2 unit's parameter shard
    numels in its all-gather order (blocks, then the root; ``named_parameters``' order is FSDP2's post-order here,
    every parameter sitting in a leaf module)."""
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if full:
        kwargs["reshard_after_forward"] = HPZ
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    bits = (8, 4) if full else (None, None)
    zeropp.fsdp.enable(model, weight_bits=bits[0], gradient_bits=bits[1])
    units = gpt_unit_segments(model, world)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    losses = torch.zeros(steps)
    comm.reset_stats()
    start = time.perf_counter()
    for step in range(steps):
        inputs, targets = data.micro_batch(step, rank=rank, world_size=world)
        _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.item()
    seconds = time.perf_counter() - start
    stats = comm.stats()
    model.eval()
    with torch.no_grad():
        ev = torch.tensor([sum(model(*b)[1].item() for b in evals) / len(evals)])
    dist.all_reduce(losses)
    dist.all_reduce(ev)
    return {"losses": (losses / world).tolist(), "eval": ev.item() / world, "stats": stats, "seconds": seconds,
            "units": units}


def exact_vs_zeropp(rank: int, world: int, steps: int = 200) -> dict[str, Any]:
    """Exact comms, then full ZeRO++, from the same weights on the same batches; eval on held-out crops (another
    seed), each rank its own quarter of every eval batch."""
    data = TextBatches(stdlib_corpus(CORPUS_BYTES), seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=0)
    held_out = TextBatches(data.corpus, seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=EVAL_SEED)
    evals = [held_out.micro_batch(k, rank=rank, world_size=world) for k in range(EVAL_BATCHES)]
    return {"exact": train(rank, world, False, steps, data, evals),
            "zeropp": train(rank, world, True, steps, data, evals)}
