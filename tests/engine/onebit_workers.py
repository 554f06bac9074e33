"""Workers for test_onebit.py: OneBitAdam beside AdamW on the tiny GPT of ``engine_workers``, same weights and data,
every rank its own micro-batch of ``text_batches``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from engine_workers import MODEL, text_batches

import zeropp
from zeropp.models import GPT

MICRO = 2
HYPER = {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}


def _engine(stage: int, optimizer: dict, accum: int, zero: dict | None = None):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
              "zero_optimization": {"stage": stage, **(zero or {})}, "optimizer": optimizer}
    return zeropp.initialize(model=GPT(MODEL, seed=0), config=config)[0]


def _micro_batches(inputs: torch.Tensor, targets: torch.Tensor, rank: int, world: int, accum: int) -> list:
    """This rank's ``accum`` micro-batches of a global batch."""
    return [(inputs[(k * world + rank) * MICRO : (k * world + rank + 1) * MICRO],
             targets[(k * world + rank) * MICRO : (k * world + rank + 1) * MICRO]) for k in range(accum)]


def _train_step(engine, micro: list, before_step=None) -> float:
    """One optimizer step over the micro-batches ``micro``; ``before_step()`` runs after the last backward. Returns
    the mean loss over the ranks and micro-batches."""
    total = torch.zeros(1)
    for k, (x, y) in enumerate(micro):
        _, loss = engine(x, y)
        engine.backward(loss)
        if k == len(micro) - 1 and before_step is not None:
            before_step()
        engine.step()
        total += loss.detach() / len(micro)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _local_gradient_error(engine, weights: dict[str, torch.Tensor], micro: list) -> float:
    """The largest difference between the engine's local gradient buffers and this rank's gradient from a plain copy
    of the model holding ``weights`` (each micro-batch's loss / their number, summed by autograd)."""
    plain = GPT(MODEL, seed=0)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(weights[n])
    for x, y in micro:
        _, loss = plain(x, y)
        (loss / len(micro)).backward()
    grads = dict(plain.named_parameters())
    worst = 0.0
    for unit, local in zip(engine.units, engine.onebit.gradients()):
        for n, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
            worst = max(worst, (local[off : off + shape.numel()] - grads[n].grad.reshape(-1)).abs().max().item())
    return worst


def _whole(engine, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each unit's whole flat buffer from its shards (an exact all-gather)."""
    out = []
    for unit, shard in zip(engine.units, shards):
        full = torch.empty(unit.full.numel())
        zeropp.comm.all_gather(shard, topology=engine.topology, out=full)
        out.append(full)
    return out


def _by_name(engine, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: full[off : off + s.numel()].clone() for unit, full in zip(engine.units, buffers)
            for n, off, s in zip(unit.param_names, unit.offsets, unit.shapes)}


def _sent(kind: str) -> int:
    s = zeropp.comm.stats()[kind]
    return s["sent_intra"] + s["sent_inter"]


def onebit_case(rank: int, world: int, stage: int, freeze: int, recorded: int, steps: int, accum: int = 1,
                checkpoint_dir: str | None = None, nonfinite: bool = False, zero: dict | None = None) -> dict:
    """Train AdamW and OneBitAdam (``freeze_step=freeze``; both with the ``zero_optimization`` keys ``zero``)
    ``steps`` steps side by side. Returns: whether the masters
    were bit-identical after every warmup step; the losses (mean over ranks) of both; the reduce-scatter bytes this
    rank sent in the last warmup step and in a compressed one; and (rank 0) what a float64 reference of the first
    ``recorded`` compressed steps needs: the units' layout, the whole ``exp_avg``, ``exp_avg_sq`` and masters after
    the last warmup step, every rank's local gradient of each recorded step, and the whole masters after them.

    With ``checkpoint_dir``: the OneBitAdam engine is saved after the first compressed step, and a new engine loaded
    from there trains the remaining steps; ``"resumed"`` says whether its local momenta, worker errors and
    ``exp_avg_sq`` after the load and its masters at the end were bit-identical to the first engine's.

    ``"local_gradient_error"``: the first compressed step's local gradients against a plain model's (``accum``
    micro-batches per step). With ``nonfinite``: one more step in which the last rank's local gradient holds a NaN;
    ``"nonfinite_skipped"`` says whether it was skipped on every rank leaving masters, local momenta and errors as
    they were."""
    adamw = _engine(stage, {"type": "AdamW", "params": HYPER}, accum, zero)
    onebit_config = {"type": "OneBitAdam", "params": {**HYPER, "freeze_step": freeze, "cuda_aware": False,
                                                      "comm_backend_name": "nccl"}}
    onebit = _engine(stage, onebit_config, accum, zero)
    out: dict = {"warmup_equal": [], "losses": {"adamw": [], "onebit": []}, "sent": {}, "grads": []}
    batches = [_micro_batches(x, y, rank, world, accum)
               for x, y in text_batches(steps + nonfinite, MICRO * world * accum)]
    saved = None
    for s, micro in enumerate(batches[:steps]):
        weights = onebit.full_parameters() if s == freeze else None

        def record() -> None:
            if weights is not None:
                out["local_gradient_error"] = _local_gradient_error(onebit, weights, micro)
            if freeze <= s < freeze + recorded:
                every = []
                for g in onebit.onebit.gradients():  # one rank: the gradient shard, the whole buffer
                    parts = [torch.empty_like(g) for _ in range(world)]
                    dist.all_gather(parts, g)
                    every.append(torch.stack(parts))
                out["grads"].append(every)

        out["losses"]["adamw"].append(_train_step(adamw, micro))
        zeropp.comm.reset_stats()
        out["losses"]["onebit"].append(_train_step(onebit, micro, record))
        if s in (freeze - 1, freeze + 1):
            out["sent"]["warmup" if s < freeze else "compressed"] = _sent("reduce_scatter")
        if s < freeze:
            same = _by_name(adamw, _whole(adamw, [u.master for u in adamw.units]))
            got = _by_name(onebit, _whole(onebit, [u.master for u in onebit.units]))
            out["warmup_equal"].append(all(torch.equal(same[n], got[n]) for n in same))
        if s == freeze - 1:
            state = onebit.optimizer.state
            out["start"] = {"master": _whole(onebit, [u.master for u in onebit.units]),
                            "exp_avg": _whole(onebit, state["exp_avg"]),
                            "exp_avg_sq": _whole(onebit, state["exp_avg_sq"])}
        if s == freeze + recorded - 1:
            out["end"] = _whole(onebit, [u.master for u in onebit.units])
        if checkpoint_dir is not None and s == freeze:
            onebit.save_checkpoint(checkpoint_dir)
            saved = [t.clone() for t in [*onebit.onebit.momentum, *onebit.onebit.error,
                                         *onebit.optimizer.state["exp_avg_sq"]]]
    if nonfinite:
        held = [t.clone() for t in [*onebit.onebit.momentum, *onebit.onebit.error, *(u.master for u in onebit.units)]]

        def poison() -> None:
            if rank == world - 1:
                onebit.onebit.grads[0][0] = float("nan")

        _train_step(onebit, batches[steps], poison)
        after = [*onebit.onebit.momentum, *onebit.onebit.error, *(u.master for u in onebit.units)]
        out["nonfinite_skipped"] = (not onebit.was_step_applied() and onebit.skipped_steps == 1
                                    and all(torch.equal(a, b) for a, b in zip(after, held, strict=True)))
    if checkpoint_dir is not None:
        resumed = _engine(stage, onebit_config, accum, zero)
        resumed.load_checkpoint(checkpoint_dir)
        loaded = [*resumed.onebit.momentum, *resumed.onebit.error, *resumed.optimizer.state["exp_avg_sq"]]
        same = all(a is not None and torch.equal(a, b) for a, b in zip(loaded, saved, strict=True))
        for micro in batches[freeze + 1 : steps]:
            _train_step(resumed, micro)
        ends = zip(_whole(resumed, [u.master for u in resumed.units]), _whole(onebit, [u.master for u in onebit.units]))
        out["resumed"] = same and all(torch.equal(a, b) for a, b in ends)
    out["units"] = [{"shard": u.shard_numel, "offsets": list(u.offsets), "sizes": [p.numel() for p in u.shapes]}
                    for u in onebit.units]
    out["block_size"] = onebit.comm.block_size
    if rank != 0:
        for key in ("grads", "start", "end"):
            out.pop(key, None)
    return out


def onebit_cases(rank: int, world: int, cases: dict[str, dict]) -> dict[str, dict]:
    """``onebit_case`` for each named case (its keyword arguments), in one launch."""
    return {name: onebit_case(rank, world, **kwargs) for name, kwargs in cases.items()}
