"""Workers for test_reuse.py: the same job with units freed after every use and with units kept whole
(``stage3_param_persistence_threshold``, ``stage3_max_reuse_distance``, ``stage3_max_live_parameters``)."""

from __future__ import annotations

from engine_workers import MODEL, gather_masters, text_batches

import zeropp
from zeropp.models import GPT


def _gathers(before: dict, after: dict) -> tuple[int, int]:
    """All-gather calls and bytes sent (inside and across nodes) between two ``comm.stats()``."""
    a, b = before.get("all_gather", {}), after.get("all_gather", {})
    sent = sum(b.get(k, 0) - a.get(k, 0) for k in ("sent_intra", "sent_inter"))
    return b.get("calls", 0) - a.get("calls", 0), sent


def reuse_runs(rank: int, world: int, zero: dict, runs: dict[str, dict], steps: int = 4) -> dict[str, dict]:
    """Train ``steps`` steps per run (``zero`` plus the run's keys); return per run the losses, the gathered fp32
    masters, per step the all-gather calls and bytes of the forward, the backward and the optimizer step, and the
    names of the units whole between forward and backward."""
    out = {}
    for name, extra in runs.items():
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **zero, **extra},
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=config)
        losses, phases, whole = [], [], []
        for inputs, targets in text_batches(steps, 2 * world):
            s0 = zeropp.comm.stats()
            _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
            s1 = zeropp.comm.stats()
            whole.append([u.name for u in engine.units if u.gathered])
            engine.backward(loss)
            s2 = zeropp.comm.stats()
            engine.step()
            s3 = zeropp.comm.stats()
            losses.append(loss.item())
            phases.append([_gathers(s0, s1), _gathers(s1, s2), _gathers(s2, s3)])
            assert not any(u.gathered for u in engine.units)  # a step leaves every unit to be gathered afresh
        masters, _ = gather_masters(engine)
        out[name] = {"losses": losses, "masters": masters, "phases": phases, "whole": whole,
                     "persistent": [u.name for u in engine.persistent],
                     "numel": {u.name: u.numel for u in engine.units}}
    return out
