"""Workers for test_communication_dtype.py: the gradient shard one backward leaves, against references computed on
every rank without the engine (the tiny GPT of ``engine_workers``, each rank's micro-batch through a plain copy of
the model in the compute dtype, ``loss.float().backward()``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from engine_workers import MODEL, text_batches

import zeropp
from zeropp.comm._dist import reduce_scatter_flat
from zeropp.models import GPT


def _reference_flat(unit, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """``unit``'s flat gradient buffer (its layout, zeros in gaps and padding) from ``grads`` by name."""
    flat = torch.zeros(unit.full.numel(), dtype=next(iter(grads.values())).dtype)
    for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
        flat[off : off + shape.numel()] = grads[name].reshape(-1)
    return flat


def gradient_shards(rank: int, world: int, runs: dict[str, dict]) -> dict[str, dict]:
    """Per run (``bf16``: compute dtype, ``comm``: ``communication_data_type``): one forward and backward; check
    every unit's ``grad_shard`` against the reference reduction the run should do, bit for bit; return the
    reduce-scatter bytes this rank sent and the largest difference to the float64 mean of the ranks' gradients."""
    inputs, targets = text_batches(1, 2 * world)[0]
    x, y = inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]
    out = {}
    for name, run in runs.items():
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": run["bf16"]},
                  "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        if run["comm"] is not None:
            config["communication_data_type"] = run["comm"]
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=config)
        before = zeropp.comm.stats().get("reduce_scatter", {}).get("sent_inter", 0)
        _, loss = engine(x, y)
        engine.backward(loss)
        sent = zeropp.comm.stats()["reduce_scatter"]["sent_inter"] - before

        plain = GPT(MODEL, seed=0)
        if run["bf16"]:
            plain = plain.bfloat16()
        _, ref_loss = plain(x, y)
        ref_loss.float().backward()
        grads = {n: p.grad for n, p in plain.named_parameters()}
        worst = 0.0
        for unit in engine.units:
            flat = _reference_flat(unit, grads)
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)  # the ranks' compute-dtype gradients, exactly
            exact = torch.stack([g.double() for g in every]).sum(0) / world  # exact: a few bf16/fp32 terms
            shard = slice(unit.start, unit.start + unit.shard_numel)
            if run["expect"] == "float64-mean":
                want = exact[shard].float()  # the float64 mean, rounded once to fp32
            else:  # "gloo-fp32": today's path, gloo's fp32 reduce-scatter of the upcast gradients, then / P
                want = torch.empty(unit.shard_numel, dtype=torch.float32)
                reduce_scatter_flat(want, flat.float(), op=dist.ReduceOp.SUM)
                want.div_(world)
            assert torch.equal(unit.grad_shard, want), (name, unit.name)
            worst = max(worst, (unit.grad_shard.double() - exact[shard]).abs().max().item())
        out[name] = {"sent_inter": sent, "worst": worst, "numel": sum(u.full.numel() for u in engine.units)}
    return out


def fp16_range(rank: int, world: int) -> dict[str, list[float]]:
    """``comm.reduce_scatter`` with an fp16 wire at the ends of fp16's range: values whose sum overflows fp16 and
    subnormals that a division before the sum would flush to zero; each rank sends its own values."""
    big = torch.full((world * 4,), 60000.0, dtype=torch.float16)  # sum over 4 ranks: 240000 > 65504
    tiny = torch.full((world * 4,), 2.0**-24, dtype=torch.float16)  # fp16's smallest subnormal; / 4 -> 0
    res = {}
    for key, full in (("big", big), ("tiny", tiny)):
        got = torch.empty(4, dtype=torch.float32)
        zeropp.comm.reduce_scatter(full, out=got, wire_dtype=torch.float16)
        res[key] = got.tolist()
    return res
