"""Workers for test_nonfinite.py (issue 12, part 1): an Inf or NaN put into one rank's gradient in fp32 or bf16.

Each run trains the tiny GPT of ``engine_workers`` (no biases) with a linear warmup schedule (so a scheduler
stepped on a skipped step shows in the learning rate) for ``steps`` steps; at step ``run["inject"]`` one rank
(``run["rank"]``) puts ``run["value"]`` (``"nan"`` or ``"inf"``) into one element of ``blocks.0.mlp.c_fc.weight``'s
gradient in the window's first micro-batch (a tensor hook). The reference is a second engine of the same config,
built from the same weights, that never sees the spoiled batch: it takes the same batches except that one, so its
optimizer and scheduler take one step fewer: what a correctly skipped step leaves.

Checked here, on every rank (a failed check raises on the rank that saw it): the spoiled step leaves masters,
compute shards, whole parameters, optimizer moments and step counts bit for bit as they were and finite, the learning
rate unchanged, ``was_step_applied()`` false, ``skipped_steps`` one more, the qgZ error-feedback residuals finite;
every clean step changes the state. Returned for the test: the warnings of each step, the ``NonFiniteGradientError``
messages (``"raise"``), the counters, and the norm of the difference of the final masters from the reference's next
to the norm of the reference's update (all masters as one vector).
"""

from __future__ import annotations

import warnings

import torch
from engine_workers import MODEL, gather_masters, text_batches
from precision_workers import same, snapshot

import zeropp
from zeropp.models import GPT

WEIGHT = "blocks.0.mlp.c_fc.weight"


def _config(run: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": run.get("accum", 1),
           "gradient_clipping": run.get("clip", 0.0),
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 8, "warmup_type": "linear"}},
           "zero_optimization": {"stage": run["stage"], **run.get("zero", {}),
                                 "zeropp": {**run.get("zero", {}).get("zeropp", {}),
                                            "nonfinite_gradients": run.get("mode", "skip")}}}
    if run.get("dtype") in ("bf16", "fp16"):
        cfg[run["dtype"]] = {"enabled": True, **({"initial_scale_power": 8} if run["dtype"] == "fp16" else {})}
    return cfg


def _snapshot(engine) -> dict:
    """What a skipped step must leave alone, bit for bit: ``precision_workers.snapshot`` and the learning rates."""
    return {**snapshot(engine, engine.optimizer), "lr": engine.get_lr()}


def _finite(engine) -> bool:
    tensors = [t for u in engine.units for t in (u.master, u.shard)]
    tensors += [t for ts in engine.optimizer.state.values() for t in ts]
    for unit in engine.units:
        ef = unit.error_feedback
        tensors += [t for t in ((ef.residual, ef.partial_residual) if ef is not None else ()) if t is not None]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _micro_batches(step_batch, rank: int, world: int, accum: int):
    inputs, targets = step_batch
    for k in range(accum):
        lo = k * world + rank
        yield k, inputs[lo : lo + 1], targets[lo : lo + 1]


def _train_step(engine, step_batch, rank, world, accum, spoil=None):
    """One accumulation window; ``spoil`` (``"nan"``/``"inf"``) spoils this rank's first micro-batch. The
    boundary's ``step()`` runs under ``warnings.catch_warnings``; returns its warnings and its error (or None)."""
    weight = dict(engine.module.named_parameters())[WEIGHT]
    for k, x, y in _micro_batches(step_batch, rank, world, accum):
        _, loss = engine(x, y)
        handle = None
        if spoil is not None and k == 0:
            def hook(g):
                g = g.clone()
                g.view(-1)[3] = float(spoil)
                return g
            handle = weight.register_hook(hook)
        engine.backward(loss)
        if handle is not None:
            handle.remove()
        if k < accum - 1:
            engine.step()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine.step()
        except zeropp.engine.NonFiniteGradientError as e:
            error = str(e)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], error


def nonfinite_runs(rank: int, world: int, runs: dict[str, dict], steps: int = 4) -> dict:
    """See the module docstring."""
    out = {}
    for name, run in runs.items():
        accum, inject = run.get("accum", 1), run.get("inject", 1)
        data = text_batches(steps, accum * world)
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(run))
        ref, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(run))
        owner = next(u.name for u in engine.units if WEIGHT in u.param_names)
        start, _ = gather_masters(engine)
        record = {"owner": owner, "warnings": [], "errors": [], "applied": []}
        for step, batch in enumerate(data):
            spoil = run["value"] if step == inject and rank == run.get("rank", 1) else None
            before = _snapshot(engine)
            skipped = engine.skipped_steps
            caught, error = _train_step(engine, batch, rank, world, accum, spoil)
            record["warnings"].append(caught)
            record["errors"].append(error)
            record["applied"].append(engine.was_step_applied())
            assert _finite(engine), (name, step)
            if step == inject:
                assert same(before, _snapshot(engine)), (name, step)
                assert not engine.was_step_applied() and engine.skipped_steps == skipped + 1, (name, step)
                assert engine.get_global_grad_norm() is None, (name, step)
            elif step != inject:
                assert not same(before, _snapshot(engine)), (name, step)
                assert engine.was_step_applied() and engine.skipped_steps == skipped, (name, step)
            if step != inject:
                _train_step(ref, batch, rank, world, accum)
        got, _ = gather_masters(engine)
        want, _ = gather_masters(ref)
        diff = float(torch.cat([(got[n] - want[n]).view(-1) for n in want]).norm())
        update = float(torch.cat([(want[n] - start[n]).view(-1) for n in want]).norm())
        record.update(diff=diff, update=update, skipped_steps=engine.skipped_steps,
                      global_steps=engine.global_steps, optimizer_steps=list(engine.optimizer.steps),
                      ref_optimizer_steps=list(ref.optimizer.steps), lr=engine.get_lr(), ref_lr=ref.get_lr())
        out[name] = record
    return out
