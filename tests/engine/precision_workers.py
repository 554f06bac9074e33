"""Workers for test_precision.py (bf16 / fp16 mixed precision, issue 4 phase 3), run on every rank by
``engine_launch.launch``; the data and model are those of ``engine_workers`` (tiny GPT without biases, crops of an
English text).

The bf16 reference (computed on every rank, independently of zeropp): a plain single-process loop that

* holds the model in bfloat16 (``GPT(seed=0).bfloat16()``) and an fp32 master copy of its (bf16-rounded) weights;
* per step, runs each rank's micro-batch through the bf16 model separately (``loss.float().backward()``), upcasts
  each micro-batch's bf16 gradients to fp32 and averages them in fp32 over the ranks;
* steps ``torch.optim.AdamW(fused=True)`` on the fp32 masters and copies them down (round to nearest) to the
  bf16 model.

That is the engine's exact bf16 semantics stated without sharding, so the only differences left are the order of
the fp32 sums (gloo's reduce-scatter against ``sum`` here) and what they flip downstream.
"""

from __future__ import annotations

import torch
from engine_workers import MODEL, gather_masters, text_batches

import zeropp
from zeropp.models import GPT

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}


def _config(stage: int, zero: dict | None = None, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW,
            "zero_optimization": {"stage": stage, **(zero or {})}, **extra}


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[n].reshape(-1).float() for n in sorted(d)])


def _mean_over_ranks(engine, value: float) -> float:
    t = torch.tensor([value])
    engine.comm.all_reduce_sum(t)
    return t.item() / engine.comm.world_size


def bf16_reference(rank: int, world: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference loop of the module docstring: mean losses per step and the final fp32 masters."""
    model = GPT(MODEL, seed=0).bfloat16()
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
    opt = torch.optim.AdamW(list(masters.values()), fused=True, **ADAMW["params"])
    losses = []
    for inputs, targets in text_batches(steps, 2 * world):
        sums = {n: torch.zeros_like(m) for n, m in masters.items()}
        total = 0.0
        for r in range(world):
            _, loss = model(inputs[2 * r : 2 * r + 2], targets[2 * r : 2 * r + 2])
            loss.float().backward()
            total += loss.item()
            for n, p in params.items():
                sums[n] += p.grad.float()
                p.grad = None
        for n, m in masters.items():
            m.grad = sums[n] / world
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        losses.append(total / world)
    return losses, {n: m.detach() for n, m in masters.items()}


def _train(engine, rank: int, world: int, steps: int) -> list[float]:
    losses = []
    for inputs, targets in text_batches(steps, 2 * world):
        _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(engine, loss.item()))
    return losses


def bf16_runs(rank: int, world: int, runs: dict[str, dict], steps: int = 10) -> dict:
    """The fp32 engine run (stage 3, exact), then each bf16 run of ``runs``, against the bf16 reference: per run the
    losses, ``||masters - reference masters|| / ||reference masters - initial||`` (``rel_to_update``) and
    ``/ ||reference masters||`` (``rel_to_params``), the buffer dtypes and bytes per rank."""
    init = {n: p.detach().float() for n, p in GPT(MODEL, seed=0).bfloat16().named_parameters()}
    ref_losses, ref_masters = bf16_reference(rank, world, steps)
    fp32, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(3))
    out: dict = {"reference": ref_losses, "fp32": _train(fp32, rank, world, steps)}
    want, start = _flat(ref_masters), _flat(init)
    for name, run in runs.items():
        model = GPT(MODEL, seed=0)
        if run.get("model_bf16"):
            model = model.bfloat16()
        engine, opt, _, _ = zeropp.initialize(model=model, config=_config(run["stage"], run.get("zero"),
                                                                         bf16={"enabled": True}))
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the engine cast the fp32 model
        losses = _train(engine, rank, world, steps)
        got = _flat(gather_masters(engine)[0])
        full = engine.full_parameters()
        assert all(t.dtype == torch.bfloat16 for t in full.values())
        if not run.get("zero"):  # exact: the compute weights are the masters rounded to bf16
            masters = gather_masters(engine)[0]
            assert all(torch.equal(full[n], masters[n].bfloat16()) for n in masters)
        # bytes per rank: compute shard (bf16), master, gradient shard, Adam's two moments (fp32)
        nbytes = {"shard": sum(u.shard.nbytes for u in engine.units),
                  "master": sum(u.master.nbytes for u in engine.units),
                  "grad": sum(u.grad_shard.nbytes for u in engine.units),
                  "state": sum(t.nbytes for ts in opt.state.values() for t in ts)}
        dtypes = {"shard": {str(u.shard.dtype) for u in engine.units},
                  "master": {str(u.master.dtype) for u in engine.units},
                  "grad": {str(u.grad_shard.dtype) for u in engine.units},
                  "state": {str(t.dtype) for ts in opt.state.values() for t in ts}}
        out[name] = {
            "losses": losses,
            "rel_to_update": ((got - want).norm() / (want - start).norm()).item(),
            "rel_to_params": ((got - want).norm() / want.norm()).item(),
            "nbytes": nbytes, "dtypes": dtypes,
            "elements": sum(u.shard_numel for u in engine.units),
        }
    return out


def snapshot(engine, opt) -> dict:
    """Everything a skipped step must leave alone, bit for bit: master, compute shards, optimizer state and step
    counts (and, in stages 1 and 2, the whole parameters)."""
    snap = {"steps": list(opt.steps)}
    for i, unit in enumerate(engine.units):
        snap[f"master{i}"] = unit.master.clone()
        snap[f"shard{i}"] = unit.shard.clone()
        if not unit.sharded:
            snap[f"full{i}"] = unit.full.clone()
        for kind, ts in opt.state.items():
            snap[f"{kind}{i}"] = ts[i].clone()
    return snap


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if isinstance(a[k], list) else torch.equal(a[k], b[k]) for k in a)


def fp16_runs(rank: int, world: int, runs: dict[str, dict], steps: int = 10) -> dict:
    """fp16 with dynamic loss scaling; at the steps listed in ``run["inject"]`` one rank (``run["rank"]``) spoils
    its gradient in the step's first micro-batch: ``"inf"`` puts an Inf into one element of one weight's gradient
    (a tensor hook), ``"huge"`` passes ``loss * 1e38`` to backward (the scaled loss overflows fp32, every gradient of
    that rank is Inf/NaN). Checks, on every rank: the injected steps and only they are skipped with the state
    unchanged bit for bit, the others change it. Returns per run the losses, the loss scale after each step, the
    counters, the non-finite gradient elements seen and, with clipping, the gradient norm of the first step next to
    the fp32 engine's."""
    out = {}
    for name, run in runs.items():
        micro, accum = run.get("micro", 2), run.get("accum", 1)
        fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": run.get("window", 4),
                "hysteresis": run.get("hysteresis", 2)}
        extra = {"gradient_accumulation_steps": accum, "train_micro_batch_size_per_gpu": micro,
                 "gradient_clipping": run.get("clip", 0.0)}
        engine, opt, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0),
                                              config=_config(run["stage"], run.get("zero"), fp16=fp16, **extra))
        assert all(u.shard.dtype == torch.float16 and u.master.dtype == torch.float32 for u in engine.units)
        weight = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
        losses, scales, skipped, nonfinite, norms = [], [], [], [], []
        ef_checked = 0  # residual checks across a scale change
        for step, (inputs, targets) in enumerate(text_batches(steps, micro * accum * world)):
            step_loss = 0.0
            for k in range(accum):
                lo = (k * world + rank) * micro
                _, loss = engine(inputs[lo : lo + micro], targets[lo : lo + micro])
                step_loss += loss.item() / accum
                spoil = step in run.get("inject", ()) and rank == run.get("rank", 1) and k == 0
                handle = None
                if spoil and run.get("how", "inf") == "inf":
                    def hook(g):
                        g = g.clone()
                        g.view(-1)[3] = float("inf")
                        return g
                    handle = weight.register_hook(hook)
                engine.backward(loss * 1e38 if spoil and run.get("how") == "huge" else loss)
                if handle is not None:
                    handle.remove()
                if k < accum - 1:
                    engine.step()
            losses.append(_mean_over_ranks(engine, step_loss))
            # what the overflow check reads: the reduced fp32 gradient shards (per rank, before step() unscales them)
            bad = torch.tensor([float(sum((~torch.isfinite(u.grad_shard)).sum() for u in engine.units)),
                                float(sum(torch.isnan(u.grad_shard).sum() for u in engine.units)),
                                float(any((~torch.isfinite(u.grad_shard)).any() for u in engine.units))])
            engine.comm.all_reduce_sum(bad)
            if bad.any():
                nonfinite.append({"step": step, "elements": int(bad[0]), "nan": int(bad[1]), "ranks": int(bad[2])})
            before = snapshot(engine, opt)
            efs = [u.error_feedback for u in engine.units if u.error_feedback is not None]
            residuals = [(ef.residual.clone(), ef.partial_residual.clone()) for ef in efs]
            scale = engine.loss_scale
            engine.step()  # the boundary
            after = snapshot(engine, opt)
            # qgZ error feedback: the residuals (finite, in scaled units) follow the scale exactly (powers of 2)
            for ef, (res, part) in zip(efs, residuals):
                assert torch.isfinite(res).all() and torch.isfinite(part).all()
                assert torch.equal(ef.residual, res * (engine.loss_scale / scale)), (name, step)
                assert torch.equal(ef.partial_residual, part * (engine.loss_scale / scale)), (name, step)
                ef_checked += engine.loss_scale != scale
            if engine.overflow:
                assert same(before, after), (name, step)
                assert engine.get_global_grad_norm() is None
            else:
                assert not same(before, after), (name, step)
            skipped.append(engine.overflow)
            scales.append(engine.loss_scale)
            norms.append(engine.get_global_grad_norm())
        assert all(torch.isfinite(u.master).all() for u in engine.units)
        out[name] = {"losses": losses, "scales": scales, "nonfinite": nonfinite, "skipped": skipped,
                     "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "skipped_steps": engine.skipped_steps, "optimizer_steps": list(opt.steps), "norms": norms,
                     "ef_scale_changes": int(ef_checked)}
        if run.get("clip"):  # the fp32 engine's first-step norm: the fp16 one must be unscaled
            ref, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(run["stage"], **extra))
            inputs, targets = text_batches(1, micro * accum * world)[0]
            for k in range(accum):
                lo = (k * world + rank) * micro
                ref.backward(ref(inputs[lo : lo + micro], targets[lo : lo + micro])[1])
                ref.step()
            out[name]["fp32_norm"] = ref.get_global_grad_norm()
    return out
