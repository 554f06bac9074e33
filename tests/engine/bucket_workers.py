"""Workers for tests/engine/test_reduce_bucket.py: the same two training steps of the tiny GPT with gradient
reduce-scatters bucketed three ways (``reduce_bucket_size``), and the references they are held to."""

from __future__ import annotations

import torch
import torch.distributed as dist
from engine_workers import MODEL, gather_masters, text_batches

import zeropp
from zeropp.models import GPT

PRECISIONS = {
    "fp32": {},  # exact reduce-scatter, fp32 on the wire
    "bf16": {"bf16": {"enabled": True}},  # communication_data_type defaults to bf16: the 16-bit wire
    "qgz": {"zero_optimization": {"zero_quantized_gradients": True}},
    "qgz-ef": {"zero_optimization": {"zero_quantized_gradients": True, "zeropp": {"error_feedback": True}}},
    # zeropp-g2's gradients with LoCo's 8-bit residuals: int8 in the node, int2 across, rotated
    "qgz-loco": {"zero_optimization": {"zero_quantized_gradients": True, "zeropp": {
        "error_feedback": "loco", "error_feedback_beta": 0.5, "gradient_bits": 2, "gradient_bits_intra": 8,
        "gradient_rotation": "hadamard"}}},
}
# stage 3: every unit freed after each use, so that freeing while a bucket is held is observable
EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def _config(stage: int, precision: str, bucket: int) -> dict:
    extra = PRECISIONS[precision]
    zero = {"stage": stage, "reduce_bucket_size": bucket, **(EVERY_GATHER if stage == 3 else {}),
            **extra.get("zero_optimization", {})}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            **{k: v for k, v in extra.items() if k != "zero_optimization"}}


def _mean_gradients(rank: int, world: int, precision: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 mean over the ranks of a plain copy of the model's gradients (each rank its own micro-batch)."""
    plain = GPT(MODEL, seed=0)
    if precision == "bf16":
        plain = plain.bfloat16()
    _, loss = plain(x, y)
    loss.float().backward()
    out = {}
    for name, p in plain.named_parameters():
        grad = p.grad.double()
        dist.all_reduce(grad)
        out[name] = grad / world
    return out


def bucketed_runs(rank: int, world: int, runs: dict[int, list[str]], steps: int = 2) -> dict[str, dict]:
    """For each stage (``runs``' keys) and each of its precisions, ``_bucketings``: ``steps`` training steps with
    each bucketing, by ``"stage/precision/bucketing"``."""
    batches = text_batches(steps, 2 * world)
    out: dict[str, dict] = {}
    for stage, precisions in runs.items():
        for precision in precisions:
            out.update(_bucketings(rank, world, stage, precision, batches))
    return out


def _bucketings(rank: int, world: int, stage: int, precision: str, batches: list) -> dict[str, dict]:
    """Train on ``batches`` with each bucketing (``one``: one unit per bucket; ``all``: every unit in one; ``two``:
    the units' elements in all minus one, so all but the last unit ready fill one bucket and the last goes in a
    second); return for each the reduce-scatter calls per step, every unit's ``grad_shard`` after the first
    backward, the gathered fp32 masters, the losses, each unit's qgZ error-feedback residuals after the last step
    (as stored: float32 or LoCo's 8-bit packs), and at stage 3 for each unit whose gradients got ready in
    backward whether it was still gathered right after and how many units were then held for their bucket. For
    the exact precisions also the largest difference of the first backward's gradient shards to the float64 mean
    of the ranks' gradients, relative to its largest magnitude per unit."""
    x0, y0 = (t[2 * rank : 2 * rank + 2] for t in batches[0])
    out: dict[str, dict] = {}
    mean = _mean_gradients(rank, world, precision, x0, y0) if precision in ("fp32", "bf16") else None
    total = None
    for bucket in ("one", "all", "two"):
        size = {"one": 1, "all": 10**9}.get(bucket) or total - 1
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(stage, precision, size))
        total = sum(u.full.numel() for u in engine.units)
        ready: list[tuple[bool, int]] = []
        if engine._readiness is not None:
            on_ready = engine._readiness.on_ready

            def record(unit, on_ready=on_ready, engine=engine, ready=ready):
                on_ready(unit)
                ready.append((unit.gathered, sum(map(len, engine._buckets.values()))))  # held units

            engine._readiness.on_ready = record
        calls, losses, shards = [], [], None
        for inputs, targets in batches:
            before = zeropp.comm.stats().get("reduce_scatter", {}).get("calls", 0)
            _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
            engine.backward(loss)
            calls.append(zeropp.comm.stats()["reduce_scatter"]["calls"] - before)
            if shards is None:
                shards = [u.grad_shard.clone() for u in engine.units]
            engine.step()
            losses.append(loss.item())
        masters, _ = gather_masters(engine)
        residuals = [(u.error_feedback.residual.clone(), u.error_feedback.partial_residual.clone())
                     for u in engine.units if u.error_feedback is not None]
        res = {"calls": calls, "shards": shards, "masters": masters, "losses": losses, "ready": ready,
               "units": len(engine.units), "residuals": residuals}
        if mean is not None:
            worst = 0.0
            for unit, shard in zip(engine.units, shards):
                flat = torch.zeros(unit.full.numel(), dtype=torch.float64)
                for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
                    flat[off : off + shape.numel()] = mean[name].reshape(-1)
                want = flat[unit.start : unit.start + unit.shard_numel]
                worst = max(worst, ((shard.double() - want).abs().max() / want.abs().max()).item())
            res["worst"] = worst
        out[f"{stage}/{precision}/{bucket}"] = res
    return out
