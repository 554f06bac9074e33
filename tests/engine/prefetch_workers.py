"""Workers for tests/engine/test_prefetch.py: the same job with prefetch and overlap off and on."""

from __future__ import annotations

import zeropp
from engine_workers import MODEL, gather_masters, text_batches
from zeropp.models import GPT


def prefetch_runs(rank: int, world: int, zero: dict, runs: dict[str, dict], steps: int = 4) -> dict[str, dict]:
    """Train ``steps`` steps per run (``zero`` plus the run's keys); return per run the losses, the gathered fp32
    masters, and the prefetcher's count of gathers started ahead of use in each step."""
    out = {}
    for name, extra in runs.items():
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **zero, **extra},
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=config)
        losses, started = [], []
        for inputs, targets in text_batches(steps, 2 * world):
            before = engine.prefetcher.started
            _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            started.append(engine.prefetcher.started - before)
            assert not any(u.gathered for u in engine.units)  # nothing left gathered (or in flight) after a step
        masters, _ = gather_masters(engine)
        out[name] = {"losses": losses, "masters": masters, "started": started,
                     "order": [u.name for u in engine.prefetcher.order],
                     "unit_numel": {u.name: u.full.numel() for u in engine.units},
                     "bucket_numel": world * sum(u.shard_numel for u in engine.units),
                     # the gradient buffers kept for reuse: as many of each size as were in flight at once
                     "pooled": sorted(b.numel() for bs in engine.units[0].reduce_buffers._free.values() for b in bs)}
    return out
