"""Worker functions for tests/engine/test_partition.py: the grouped points (``zeropp.engine.partition``: MiCS
``(k, k, k)`` at stage 3, ``(1, 1, k)`` at stage 1, ``(1, k, k)`` at stage 2) on real gloo processes, against plain
single-process training (engine_workers.py's reference), their byte counters against the formulas (and, at stages 1
and 2, with the model states' bytes, against ``zeropp.plan``'s prediction), and checkpoints moved between MiCS,
ZeRO-3 and the grouped stage-1/2 points. One launch per layout runs every case."""

from __future__ import annotations

from pathlib import Path

import torch
from engine_workers import MODEL, batches, relative_errors, state_bytes, torch_optimizer

import zeropp
from zeropp import comm
from zeropp.comm.accounting import gather_traffic
from zeropp.config import ConfigError
from zeropp.models import GPT
from zeropp.plan import Partition, Plan, from_preset
from zeropp.plan.memory import memory
from zeropp.plan.traffic import Layout, collectives, totals

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}


def _config(micro: int, accum: int, zero: dict, clip: float = 0.0) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "gradient_clipping": clip, "optimizer": ADAMW, "zero_optimization": zero}


def _train(engine, rank: int, world: int, micro: int, accum: int, data) -> None:
    """Micro-step ``k`` of rank ``r`` takes samples ``[(k * P + r) * m, ...)`` of each global batch."""
    for inputs, targets in data:
        for k in range(accum):
            lo = (k * world + rank) * micro
            _, loss = engine(inputs[lo : lo + micro], targets[lo : lo + micro])
            engine.backward(loss)
            engine.step()


def _expected_all_reduce(engine) -> dict[str, int]:
    """``comm.all_reduce``'s counters for one boundary: a ring all-reduce of every unit's fp32 gradient shard laid
    end to end over the replica group (``zeropp.comm.accounting``)."""
    mics = engine.mics
    numel = sum(u.shard_numel for u in engine.units)
    r = mics.replicas
    same = sum(mics.world.node_of(q) == mics.world.node for q in mics.replica_ranks)
    once = gather_traffic(-(-numel // r) * 4, r, same)
    t = once + once
    return {"calls": 1, "sent_intra": t.sent_intra, "sent_inter": t.sent_inter, "recv_intra": t.recv_intra,
            "recv_inter": t.recv_inter}


def _expected_stage12(engine, accum: int) -> dict[str, dict[str, int]]:
    """The grouped stage-1/2 points' in-group counters for one boundary: each unit's fp32 gradient reduce-scattered
    over the shard group once (stage 1, at the boundary) or every micro-batch (stage 2), and its stepped fp32 shard
    all-gathered back once; a reduce-scatter of ``S`` elements per rank is counted as an all-gather of ``4 S``
    bytes (``zeropp.comm.accounting``)."""
    mics = engine.mics
    numel = sum(u.shard_numel for u in engine.units)
    same = sum(mics.world.node_of(q) == mics.world.node for q in mics.groups[mics.index])
    once = gather_traffic(numel * 4, mics.size, same)
    out = {}
    for kind, calls in (("reduce_scatter", 1 if engine.stage == 1 else accum), ("all_gather", 1)):
        t = once
        for _ in range(calls - 1):
            t = t + once
        out[kind] = {"sent_intra": t.sent_intra, "sent_inter": t.sent_inter, "recv_intra": t.recv_intra,
                     "recv_inter": t.recv_inter}
    return out


def _zero(stage: int, k: int, accum: int) -> dict:
    """The grouped point of ``stage`` over ``k`` ranks; MiCS as ``mics_shard_size`` at accumulation 1."""
    if stage == 3 and accum == 1:
        return {"stage": 3, "mics_shard_size": k}
    point = {1: (1, 1, k), 2: (1, k, k), 3: (k, k, k)}[stage]
    return {"stage": stage, "zeropp": {"partition": dict(zip(("parameters", "gradients", "optimizer"), point))}}


CASES = ((3, 2, 1, 0.0), (3, 1, 2, 0.5), (1, 1, 2, 0.5), (2, 1, 2, 0.0))
"""(stage, micro-batch, accumulation, clipping) of each grouped case."""


def mics_cases(rank: int, world: int, root: str, sizes: list[int], checkpoints: bool, steps: int = 4) -> dict:
    """For each group size in ``sizes`` and each of ``CASES`` (MiCS at accumulation 1 and 2, clipping on in the
    second; ``(1, 1, k)`` and ``(1, k, k)`` at accumulation 2, for the last size only: the layouts' last sizes are
    a group inside a node, a whole node and two nodes): train against the single-process reference and
    return the worst relative errors; check the groups' layout, that every rank ends with the same weights, the
    byte counters of one boundary; then, with ``checkpoints``, move a checkpoint MiCS -> ZeRO-3 -> MiCS and MiCS ->
    ``(1, k, k)`` -> ``(1, 1, k)`` -> MiCS."""
    out: dict = {}
    for k in sizes:
        for stage, micro, accum, clip in CASES if k == sizes[-1] else CASES[:2]:
            config = _config(micro, accum, _zero(stage, k, accum), clip)
            model, ref = GPT(MODEL, seed=rank), GPT(MODEL, seed=0)  # the engine starts from rank 0's weights
            engine, _, _, _ = zeropp.initialize(model=model, config=config)
            mics = engine.mics
            assert mics is not None and mics.size == k and engine.comm.world_size == k and engine.stage == stage
            assert engine.world_size == world and engine.train_batch_size() == micro * accum * world
            node = mics.world.nodes[mics.world.node]
            assert set(mics.groups[mics.index]) <= set(node) or set(node) <= set(mics.groups[mics.index])
            ref_opt = torch_optimizer(ADAMW, list(ref.parameters()))
            data = batches(steps, micro * accum * world)
            norms = []
            for step, (inputs, targets) in enumerate(data):
                if step == steps - 1:
                    comm.reset_stats()
                _train(engine, rank, world, micro, accum, [(inputs, targets)])
                _, ref_loss = ref(inputs, targets)
                ref_loss.backward()
                if clip:
                    norms.append((engine.get_global_grad_norm(),
                                  torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()))
                ref_opt.step()
                ref_opt.zero_grad()
            stats = comm.stats()
            assert stats["all_reduce"] == _expected_all_reduce(engine), (stats["all_reduce"],
                                                                          _expected_all_reduce(engine))
            rs = stats["reduce_scatter"]
            same = sum(mics.world.node_of(q) == mics.world.node for q in mics.groups[mics.index])
            assert rs["sent_inter"] == 0 if same == k else rs["sent_inter"] > 0, rs
            if stage < 3:
                for kind, want in _expected_stage12(engine, accum).items():
                    got = {f: v for f, v in stats[kind].items() if f != "calls"}
                    assert got == want, (kind, got, want)
                point = (1, 1, k) if stage == 1 else (1, k, k)
                planned = totals(collectives(from_preset("tiny:nobias"), Plan(Partition(*point)),
                                             Layout(world, mics.world.ranks_per_node, rank), accum, 4))
                got = {kind: {f: v for f, v in stats[kind].items() if f != "calls"} for kind in planned}
                assert got == planned, ("zeropp.plan", got, planned)
                mem = memory(from_preset("tiny:nobias"), Plan(Partition(*point)), world, micro, 64, 4)
                assert state_bytes(engine) == {key: mem[key] for key in ("params", "grads", "optimizer")}, (
                    state_bytes(engine), mem)
            for got, want in norms:
                assert abs(got - want) <= 1e-5 * want, (got, want)
            errors = relative_errors(engine.full_parameters(), ref)
            key = f"s{stage}-k{k}-m{micro}-a{accum}-clip{clip}"
            out[key] = {"norm": max(e[0] for e in errors.values()), "max": max(e[1] for e in errors.values())}
            out[key + "-weights"] = {n: float(p.double().sum()) for n, p in engine.full_parameters().items()}
            engine.destroy()
    if checkpoints:
        out.update(_checkpoints(rank, world, root, sizes[0]))
        for key, zero in (("refused", {"stage": 3, "mics_shard_size": sizes[0], "zero_quantized_weights": True}),
                          ("refused-grouped", {**_zero(1, sizes[0], 2), "zero_quantized_gradients": True})):
            try:  # initialize refuses what the grouped points do not combine with, before building anything
                zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, zero))
                raise AssertionError(f"{zero} was accepted")
            except ConfigError as e:
                out[key] = str(e)
    return out


def _checkpoints(rank: int, world: int, root: str, k: int) -> dict:
    """Save under MiCS over ``k``, load under ZeRO-3 over the world and under ``(1, k, k)`` (the same weights, bit
    for bit), train all three on (the resumed runs against MiCS's), save under ZeRO-3 and load under MiCS and
    ``(1, 1, k)``, save under ``(1, k, k)`` and load under ``(1, 1, k)``, save that and load it under MiCS (each bit
    for bit)."""
    out: dict = {}
    data = batches(2, 2 * world)
    ckpt = Path(root) / "ckpt"

    def engine(zero: dict, seed: int):
        return zeropp.initialize(model=GPT(MODEL, seed=seed), config=_config(2, 1, zero))[0]

    def same(a, b) -> bool:
        return all(torch.equal(a.full_parameters()[n], p) for n, p in b.full_parameters().items())

    first = engine(_zero(3, k, 1), 0)
    _train(first, rank, world, 2, 1, data[:1])
    path = first.save_checkpoint(ckpt, tag="mics")
    assert path == ckpt / "mics"
    zero3, grouped2 = engine({"stage": 3}, 5), engine(_zero(2, k, 2), 7)
    for e in (zero3, grouped2):
        e.load_checkpoint(ckpt, tag="mics")
        assert same(first, e)
    for e in (first, zero3, grouped2):
        _train(e, rank, world, 2, 1, data[1:])
    for key, e in (("resumed_zero3_vs_mics", zero3), ("resumed_grouped2_vs_mics", grouped2)):
        out[key] = max(v[0] for v in relative_errors(e.full_parameters(),
                                                     _as_module(first.full_parameters())).values())
    moves = ((zero3, "zero3", _zero(3, k, 1)), (grouped2, "grouped2", _zero(1, k, 2)))
    loaded = []
    for saver, tag, zero in moves:
        saver.save_checkpoint(ckpt, tag=tag)
        back = engine(zero, 6)
        if loaded:  # the (1, 1, k) engine also loads ZeRO-3's checkpoint first
            back.load_checkpoint(ckpt, tag="zero3")
            assert same(zero3, back)
        back.load_checkpoint(ckpt, tag=tag)
        assert same(saver, back), tag
        loaded.append(back)
    loaded[1].save_checkpoint(ckpt, tag="grouped1")
    mics_again = engine(_zero(3, k, 1), 8)
    mics_again.load_checkpoint(ckpt, tag="grouped1")
    assert same(loaded[1], mics_again)
    for e in (first, zero3, grouped2, *loaded, mics_again):
        e.destroy()
    return out


def _as_module(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = GPT(MODEL, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    return model
