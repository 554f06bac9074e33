"""Workers for test_host_memory.py: the small GPT trained on one gloo rank, every unit gathered afresh at each use,
with the engine's heap-trim policy, and with ``malloc_trim(0)`` after every step as well (the policy before it)."""

from __future__ import annotations

import resource

from engine_workers import text_batches

import zeropp
from zeropp.engine import host_memory
from zeropp.models import GPT, GPTConfig


def rss_anon() -> int:
    """Bytes of anonymous memory resident in this process (``RssAnon`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def steady_state(rank: int, world: int, steps: int, trim_every_step: bool) -> dict:
    """Train ``steps`` steps; per step the resident anonymous bytes after it, the minor page faults during it and
    the policy's bound (bytes), and the engine's trims in all."""
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = GPT(GPTConfig.preset("small", block_size=64), seed=0)
    engine, _, _, _ = zeropp.initialize(model=model, config=config)
    rss, faults, bounds = [], [], []
    for inputs, targets in text_batches(steps, 2, seed=7):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _, loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        if trim_every_step:
            host_memory.release_free_heap()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        rss.append(rss_anon())
        bounds.append(engine.heap_trim.bound(host_memory.heap_usage()))
    return {"rss": rss, "faults": faults, "bounds": bounds, "trims": engine.heap_trim.trims}
