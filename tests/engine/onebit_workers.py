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


def _engine(stage: int, optimizer: dict):
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage},
              "optimizer": optimizer}
    return zeropp.initialize(model=GPT(MODEL, seed=0), config=config)[0]


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


def onebit_case(rank: int, world: int, stage: int, freeze: int, recorded: int, steps: int,
                checkpoint_dir: str | None = None) -> dict:
    """Train AdamW and OneBitAdam (``freeze_step=freeze``) ``steps`` steps side by side. Returns: whether the masters
    were bit-identical after every warmup step; the losses (mean over ranks) of both; the reduce-scatter bytes this
    rank sent in the last warmup step and in a compressed one; and (rank 0) what a float64 reference of the first
    ``recorded`` compressed steps needs: the units' layout, the whole ``exp_avg``, ``exp_avg_sq`` and masters after
    the last warmup step, every rank's local gradient of each recorded step, and the whole masters after them.

    With ``checkpoint_dir``: the OneBitAdam engine is saved after the first compressed step, and a new engine loaded
    from there trains the remaining steps; ``"resumed"`` says whether its local momenta, worker errors and
    ``exp_avg_sq`` after the load and its masters at the end were bit-identical to the first engine's."""
    adamw = _engine(stage, {"type": "AdamW", "params": HYPER})
    onebit_config = {"type": "OneBitAdam", "params": {**HYPER, "freeze_step": freeze, "cuda_aware": False,
                                                      "comm_backend_name": "nccl"}}
    onebit = _engine(stage, onebit_config)
    out: dict = {"warmup_equal": [], "losses": {"adamw": [], "onebit": []}, "sent": {}, "grads": []}
    batches = text_batches(steps, MICRO * world)
    saved = None
    for s, (inputs, targets) in enumerate(batches):
        x, y = inputs[rank * MICRO : (rank + 1) * MICRO], targets[rank * MICRO : (rank + 1) * MICRO]
        for name, engine in (("adamw", adamw), ("onebit", onebit)):
            zeropp.comm.reset_stats()
            _, loss = engine(x, y)
            engine.backward(loss)
            if name == "onebit" and freeze <= s < freeze + recorded:
                every = []
                for g in engine.onebit.grads:
                    parts = [torch.empty_like(g) for _ in range(world)]
                    dist.all_gather(parts, g)
                    every.append(torch.stack(parts))
                out["grads"].append(every)
            engine.step()
            if name == "onebit" and s in (freeze - 1, freeze + 1):
                out["sent"]["warmup" if s < freeze else "compressed"] = _sent("reduce_scatter")
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean)
            out["losses"][name].append(mean.item() / world)
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
    if checkpoint_dir is not None:
        resumed = _engine(stage, onebit_config)
        resumed.load_checkpoint(checkpoint_dir)
        loaded = [*resumed.onebit.momentum, *resumed.onebit.error, *resumed.optimizer.state["exp_avg_sq"]]
        same = all(a is not None and torch.equal(a, b) for a, b in zip(loaded, saved, strict=True))
        for inputs, targets in batches[freeze + 1 :]:
            x, y = inputs[rank * MICRO : (rank + 1) * MICRO], targets[rank * MICRO : (rank + 1) * MICRO]
            _, loss = resumed(x, y)
            resumed.backward(loss)
            resumed.step()
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
