"""Worker functions for tests/engine/test_partition.py: the grouped points (``zeropp.engine.partition``: MiCS
``(k, k, k)`` at stage 3, ``(1, 1, k)`` at stage 1, ``(1, k, k)`` and ``(1, g, o)`` with ``g < o`` at stage 2,
``split_cases``) on real gloo processes, against plain
single-process training (engine_workers.py's reference), their byte counters against the formulas and against
``zeropp.plan``'s prediction (the cross-group all-reduce's calls and bytes at every point, exact and qgZ; at stages
1 and 2 every kind, with the model states' bytes), and checkpoints moved between MiCS,
ZeRO-3 and the grouped stage-1/2 points; MiCS with qwZ and qgZ
(``quantized_cases``) against exact MiCS, the quantized cross-group all-reduce against its bound, checkpoints
MiCS+qgZ <-> ZeRO-3, and bf16 and fp16 (an overflow skipped on every group alike) at the grouped points, and fp16
at the resident point (``precision_cases``); the resident point ``(p, W, W)`` against ZeRO-3, bit for bit, with its
counters and checkpoints (``resident_cases``); the grouped resident points ``(p, g, o)`` against ``(1, g, o)`` or
MiCS, bit for bit, with their counters, memory, a skipped step and checkpoints (``grouped_resident_cases``,
``grouped_resident_extras``); ``"partition": "auto"``'s picks against the planner's first choice among the runnable
points, and its runs against the explicit configs (``auto_cases``). One launch per layout runs every case."""

from __future__ import annotations

import dataclasses
import io
import os
from contextlib import redirect_stdout
from pathlib import Path

import torch
from engine_workers import MODEL, batches, relative_errors, state_bytes, torch_optimizer

import zeropp
from zeropp import comm
from zeropp.comm.accounting import gather_traffic
from zeropp.config import ConfigError, load_config
from zeropp.engine import auto_partition
from zeropp.engine.auto_partition import ENV_CLUSTER
from zeropp.models import GPT
from zeropp.plan import Batch, Cluster, Partition, Plan, from_preset, partitions, predict
from zeropp.plan.memory import memory
from zeropp.plan.traffic import Layout, collectives, totals
from zeropp.quant import BlockFormat

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


def _planned_all_reduce(plan: Plan, world: int, rank: int, accum: int) -> dict[str, int]:
    """``zeropp.plan``'s cross-group all-reduce of ``plan`` (tiny:nobias in float32) for this rank, in
    ``comm.stats()``'s form: its calls per step and its bytes."""
    colls = [c for c in collectives(from_preset("tiny:nobias"), plan,
                                    Layout(world, comm.get_default_topology().ranks_per_node, rank), accum, 4)
             if c.kind == "all_reduce"]
    return {"calls": sum(c.calls for c in colls), **totals(colls)["all_reduce"]}


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


def _expected_split(engine, accum: int) -> dict[str, dict[str, int]]:
    """``(1, g, o)``'s counters for one boundary, by hand (``zeropp.comm.accounting``): every micro-batch an exact
    fp32 reduce-scatter over the ``g`` group delivering ``o / g`` rows of every unit's ``o``-layout (``(o / g) N``
    elements per rank, ``N`` the units' shard elements in all); at the boundary one over the ``o / g`` peers
    delivering ``N``, then (``o`` below the world) the all-reduce over the replicas; the stepped shards all-gathered
    over the ``o`` group."""
    split = engine.mics
    numel = sum(u.shard_numel for u in engine.units)
    rows = split.gradient_split.rows

    def ring(chunk: int, topo, calls: int = 1) -> comm.Traffic:
        once = gather_traffic(chunk, topo.world_size, topo.same_node_count(topo.group))
        t = comm.Traffic()
        for _ in range(calls):
            t = t + once
        return t

    traffic = {"reduce_scatter": ring(rows * numel * 4, split.gradient_topology, accum)
               + ring(numel * 4, split.peer_topology),
               "all_gather": ring(numel * 4, split.shard_topology)}
    out = {kind: {"sent_intra": t.sent_intra, "sent_inter": t.sent_inter, "recv_intra": t.recv_intra,
                  "recv_inter": t.recv_inter} for kind, t in traffic.items()}
    if split.replicas > 1:
        out["all_reduce"] = {f: v for f, v in _expected_all_reduce(engine).items() if f != "calls"}
    return out


def _train_beside(engine, ref, rank: int, world: int, micro: int, accum: int, clip: float,
                  steps: int) -> list[tuple[float, float]]:
    """``steps`` steps of ``engine`` and of the single-process reference ``ref`` (AdamW, clipping at ``clip``) on the
    same batches, the byte counters reset before the last; with ``clip``, each step's (engine, reference) gradient
    norms."""
    ref_opt = torch_optimizer(ADAMW, list(ref.parameters()))
    norms = []
    for step, (inputs, targets) in enumerate(batches(steps, micro * accum * world)):
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
    return norms


def _check_states_and_norms(engine, plan: Plan | None, world: int, micro: int,
                            norms: list[tuple[float, float]]) -> None:
    """The engine's model-state bytes equal ``zeropp.plan.memory``'s for ``plan`` (the tiny GPT, seq 64, fp32; not
    checked when None), and each (engine, reference) gradient norm of ``norms`` agrees within 1e-5."""
    if plan is not None:
        mem = memory(from_preset("tiny:nobias"), plan, world, micro, 64, 4)
        assert state_bytes(engine) == {key: mem[key] for key in ("params", "grads", "optimizer")}, (
            state_bytes(engine), mem)
    for got, want in norms:
        assert abs(got - want) <= 1e-5 * want, (got, want)


def split_cases(rank: int, world: int, root: str, splits: list[list[int]], checkpoints: bool,
                steps: int = 4, references: dict | None = None) -> dict:
    """``(1, g, o)`` for each ``(g, o)`` of ``splits`` at accumulation 2 with clipping: against single-process training
    (``"p1-g{g}-o{o}"``: the worst relative errors; the clipped norms within 1e-5), every rank's weights
    (``-weights``), the groups' layout, the last boundary's byte counters against the formula (``_expected_split``)
    and ``zeropp.plan``'s traffic, the model states' bytes against ``zeropp.plan.memory``; for the first split, an
    Inf in one gradient element on rank 1 at step 1 skips that step on every rank alike, leaving masters, shards and
    moments unchanged bit for bit (``"p1-g{g}-o{o}-inf"``: per step whether it was skipped); each run's whole
    weights into ``references`` under ``(1, g, o)`` (``grouped_resident_cases``). With ``checkpoints``
    (the first split): stage 2 -> ``(1, g, o)`` -> ``(1, 1, o)`` -> stage 3 -> ``(1, g, o)``, each load bit for bit."""
    out: dict = {}
    micro, accum, clip = 1, 2, 0.5
    for g, o in splits:
        config = _config(micro, accum, _split_zero(g, o), clip)
        model, ref = GPT(MODEL, seed=rank), GPT(MODEL, seed=0)
        engine, opt, _, _ = zeropp.initialize(model=model, config=config)
        split = engine.mics
        assert engine.stage == 2 and split.size == o and engine.comm.world_size == o and split.replicas == world // o
        assert split.gradient_topology.world_size == g and split.peer_topology.world_size == o // g
        assert split.gradient_split.rows == o // g and all(u.grad_accumulator.shape == (o // g, u.shard_numel)
                                                           for u in engine.units)
        node = set(split.world.nodes[split.world.node])
        assert set(split.gradient_topology.ranks) <= node or node <= set(split.gradient_topology.ranks)
        norms = _train_beside(engine, ref, rank, world, micro, accum, clip, steps)
        stats = comm.stats()
        got = {kind: {f: v for f, v in t.items() if f != "calls"} for kind, t in stats.items()
               if kind in ("reduce_scatter", "all_gather", "all_reduce") and t["calls"]}
        want = _expected_split(engine, accum)
        assert got == want, ("formula", got, want)
        plan = Plan(Partition(1, g, o))
        planned = totals(collectives(from_preset("tiny:nobias"), plan,
                                     Layout(world, split.world.ranks_per_node, rank), accum, 4))
        assert got == planned, ("zeropp.plan", got, planned)
        _check_states_and_norms(engine, plan, world, micro, norms)
        errors = relative_errors(engine.full_parameters(), ref)
        key = f"p1-g{g}-o{o}"
        out[key] = {"norm": max(e[0] for e in errors.values()), "max": max(e[1] for e in errors.values())}
        out[key + "-weights"] = {n: float(p.double().sum()) for n, p in engine.full_parameters().items()}
        if references is not None:
            references[(1, g, o)] = {n: p.detach().clone() for n, p in engine.full_parameters().items()}
        engine.destroy()
        if (g, o) == tuple(splits[0]):
            out[key + "-inf"] = _split_skip(rank, world, g, o)
    if checkpoints and splits:
        _split_checkpoints(rank, world, root, *splits[0])
    return out


def _split_zero(g: int, o: int) -> dict:
    return {"stage": 2, "zeropp": {"partition": {"parameters": 1, "gradients": g, "optimizer": o}}}


def _spoil(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: the gradient with an Inf in its element 3."""
    grad = grad.clone()
    grad.view(-1)[3] = float("inf")
    return grad


def _split_skip(rank: int, world: int, g: int, o: int, steps: int = 3) -> list[bool]:
    """``(1, g, o)`` in fp32 with an Inf in one element of one weight's gradient on rank 1 at step 1 (its first
    micro-batch): per step whether it was skipped (the same on every rank: the Inf reaches the other ranks through
    the boundary's reductions, before the check); the skipped step leaves masters, shards, whole parameters and
    moments unchanged bit for bit (checked here)."""
    engine, opt, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=_config(1, 2, _split_zero(g, o)))
    weight = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
    record = []
    for step, batch in enumerate(batches(steps, 2 * world)):
        handle = None
        if step == 1 and rank == 1:
            handle = weight.register_hook(_spoil)
        before = _masters_and_state(engine, opt)
        _train(engine, rank, world, 1, 2, [batch])
        if handle is not None:
            handle.remove()
        after = _masters_and_state(engine, opt)
        assert all(torch.equal(before[n], after[n]) for n in before) == engine.overflow, step
        assert all(not u.grad_accumulator.any() for u in engine.units)  # nothing carried into the next window
        record.append(engine.overflow)
    engine.destroy()
    return record


def _split_checkpoints(rank: int, world: int, root: str, g: int, o: int) -> None:
    """Stage 2 saves; ``(1, g, o)`` loads it (the same weights, bit for bit), trains a step and saves; ``(1, 1, o)``
    loads that, trains and saves; stage 3 loads that, trains and saves; ``(1, g, o)`` loads that. Each load bit for
    bit."""
    _checkpoint_chain(rank, world, Path(root) / "ckpt-split",
                      (("stage2", {"stage": 2}), ("split", _split_zero(g, o)), ("stage1-o", _zero(1, o, 2)),
                       ("stage3", {"stage": 3}), ("split-again", _split_zero(g, o))))


def _checkpoint_chain(rank: int, world: int, ckpt: Path, chain: tuple[tuple[str, dict], ...]) -> None:
    """Each ``(tag, zero)`` of ``chain`` in turn: an engine under ``zero`` loads the previous one's checkpoint (the
    same weights, bit for bit), trains a step and saves under ``tag``."""
    data = batches(1, 2 * world)
    saver, previous = None, None
    for seed, (tag, zero) in enumerate(chain):
        engine = zeropp.initialize(model=GPT(MODEL, seed=seed + 10), config=_config(2, 1, zero))[0]
        if saver is not None:
            engine.load_checkpoint(ckpt, tag=previous)
            want = saver.full_parameters()
            assert all(torch.equal(want[n], p) for n, p in engine.full_parameters().items()), tag
            saver.destroy()
        _train(engine, rank, world, 2, 1, data)
        engine.save_checkpoint(ckpt, tag=tag)
        saver, previous = engine, tag
    saver.destroy()


def mics_cases(rank: int, world: int, root: str, sizes: list[int], checkpoints: bool, splits: list[list[int]],
               precision: int = 0, residents: list[list[int]] = (),
               steps: int = 4) -> dict:
    """For each group size in ``sizes`` and each of ``CASES`` (MiCS at accumulation 1 and 2, clipping on in the
    second; ``(1, 1, k)`` and ``(1, k, k)`` at accumulation 2, for the last size only: the layouts' last sizes are
    a group inside a node, a whole node and two nodes): train against the single-process reference and
    return the worst relative errors; check the groups' layout, that every rank ends with the same weights, the
    byte counters of one boundary; with ``precision`` (a group size), bf16 and fp16 at the grouped points over it
    (``precision_cases``); then, with ``checkpoints``, move a checkpoint MiCS -> ZeRO-3 -> MiCS and MiCS ->
    ``(1, k, k)`` -> ``(1, 1, k)`` -> MiCS; then ``split_cases`` for ``splits``, and ``grouped_resident_cases`` for
    ``residents`` against those runs and MiCS's at accumulation 2."""
    references: dict = {}
    out: dict = split_cases(rank, world, root, splits, checkpoints, steps, references)
    exact: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
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
            norms = _train_beside(engine, ref, rank, world, micro, accum, clip, steps)
            stats = comm.stats()
            assert stats["all_reduce"] == _expected_all_reduce(engine), (stats["all_reduce"],
                                                                          _expected_all_reduce(engine))
            point = {1: (1, 1, k), 2: (1, k, k), 3: (k, k, k)}[stage]
            assert _planned_all_reduce(Plan(Partition(*point)), world, rank, accum) == stats["all_reduce"]
            rs = stats["reduce_scatter"]
            same = sum(mics.world.node_of(q) == mics.world.node for q in mics.groups[mics.index])
            assert rs["sent_inter"] == 0 if same == k else rs["sent_inter"] > 0, rs
            if stage < 3:
                for kind, want in _expected_stage12(engine, accum).items():
                    got = {f: v for f, v in stats[kind].items() if f != "calls"}
                    assert got == want, (kind, got, want)
                planned = totals(collectives(from_preset("tiny:nobias"), Plan(Partition(*point)),
                                             Layout(world, mics.world.ranks_per_node, rank), accum, 4))
                got = {kind: {f: v for f, v in stats[kind].items() if f != "calls"} for kind in planned}
                assert got == planned, ("zeropp.plan", got, planned)
                _check_states_and_norms(engine, Plan(Partition(*point)), world, micro, [])
            _check_states_and_norms(engine, None, world, micro, norms)
            errors = relative_errors(engine.full_parameters(), ref)
            key = f"s{stage}-k{k}-m{micro}-a{accum}-clip{clip}"
            if stage == 3 and accum == 1:
                exact[k] = (mics_masters(engine), {n: p.detach().clone() for n, p in ref.named_parameters()})
            elif stage == 3:
                references[(k, k, k)] = {n: p.detach().clone() for n, p in engine.full_parameters().items()}
            out[key] = {"norm": max(e[0] for e in errors.values()), "max": max(e[1] for e in errors.values())}
            out[key + "-weights"] = {n: float(p.double().sum()) for n, p in engine.full_parameters().items()}
            engine.destroy()
    out.update(grouped_resident_cases(rank, world, residents, references, steps))
    if checkpoints and residents:
        out.update(grouped_resident_extras(rank, world, root, tuple(residents[0])))
    elif residents and residents[-1][2] < world:  # the replicas: the first group writes, every group loads
        zero = _grouped_resident_zero(residents[-1])
        _checkpoint_chain(rank, world, Path(root) / "ckpt-grouped-resident",
                          (("resident", zero), ("stage3", {"stage": 3}), ("resident-again", zero)))
        out["resident-replicas-checkpoints"] = True
    for k in sizes:
        out.update(quantized_cases(rank, world, k, exact[k], steps, references))
        if k > comm.get_default_topology().ranks_per_node:
            out.update(hpz_case(rank, world, k, exact[k][0], steps))
    for point in residents:
        if point[1] == point[2]:  # (p, k, k): qwZ and qgZ as MiCS over k
            out.update(grouped_resident_quantized(rank, world, tuple(point), references[("qwz8-qgz4", point[2])],
                                                  steps))
    if precision:
        out.update(precision_cases(rank, world, precision))
    out.update(resident_cases(rank, world, root, checkpoints))
    if checkpoints:
        out.update(auto_cases(rank, world, root))
        out.update(_checkpoints(rank, world, root, sizes[0]))
        out.update(_quantized_checkpoints(rank, world, root, sizes[0]))
        for key, zero in (("refused", {"stage": 3, "mics_shard_size": sizes[0], "zero_hpz_partition_size": 2}),
                          ("refused-grouped", {**_zero(1, sizes[0], 2), "zero_quantized_gradients": True})):
            try:  # initialize refuses what the grouped points do not combine with, before building anything
                zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, zero))
                raise AssertionError(f"{zero} was accepted")
            except ConfigError as e:
                out[key] = str(e)
    return out


PRECISION_POINTS = ((3, 1), (1, 2), (2, 2))
"""(stage, accumulation) of each grouped point ``precision_cases`` runs in bf16: MiCS, ``(1, 1, k)``, ``(1, k, k)``."""


def _masters_and_state(engine, opt) -> dict[str, torch.Tensor]:
    """What a skipped step leaves alone, bit for bit: each unit's fp32 master and compute shards, its whole
    parameters (stages 1 and 2) and the optimizer's moments."""
    snap = {}
    for i, unit in enumerate(engine.units):
        snap[f"master{i}"], snap[f"shard{i}"] = unit.master.clone(), unit.shard.clone()
        if not unit.sharded:
            snap[f"full{i}"] = unit.full.clone()
        for kind, ts in opt.state.items():
            snap[f"{kind}{i}"] = ts[i].clone()
    return snap


def precision_cases(rank: int, world: int, k: int, steps: int = 3) -> dict:
    """bf16 at each of ``PRECISION_POINTS`` over ``k``, and at ``(1, k, world)``, against bf16 at the same stage
    over the world with the same micro-batch and accumulation (``"bf16-s{stage}-a{accum}"``: the distance of the
    fp32 masters relative to the update, and the masters' sums for the every-rank check; the stage's own point, not
    ZeRO-3, since stage 1 sums its micro-batches in the bf16 ``.grad``: 1.8e-2 of the update from ZeRO-3 at
    accumulation 2); the grouped resident point ``(2, k, world)`` in bf16 against ``(1, k, world)``'s masters, bit
    for bit (``"grouped-resident-bf16-bit-identical"``); then fp16 (loss scale 2^8, hysteresis 1) under MiCS,
    ``(1, 1, k)`` and ``(1, k, k)`` with an Inf in one element of one weight's gradient on rank 1 (one group) at
    step 1: per step whether it was skipped and
    the loss scale (equal on every rank, checked here after each step: the Inf reaches the other groups through the
    cross-group all-reduce, which runs before the check), the skipped step leaving masters, shards and moments
    unchanged bit for bit (checked here), and the distance to fp16 ZeRO-3 with the same Inf. At every grouped run
    the last step's cross-group all-reduce counters equal ``_expected_all_reduce``'s (checked here): the fp32
    gradient shards, 4 bytes an element in bf16 and fp16 too, twice what the compute dtype would send. Last, fp16
    at the resident point ``(node, W, W)`` with the same Inf: the same record as fp16 ZeRO-3, the skipped step
    exchanging nothing and leaving the resident slices as they were, and ZeRO-3's fp32 masters bit for bit
    (``"fp16-resident-inf-bit-identical"``)."""
    out: dict = {}
    data = batches(steps, 2 * 2 * world)

    def run(config: dict, accum: int, inject: bool) -> tuple[dict[str, torch.Tensor], list[tuple[bool, float]]]:
        engine, opt, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=config)
        resident = engine.weight_deltas is not None
        weight = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
        record = []
        for step, batch in enumerate(data):
            handle = None
            if inject and step == 1 and rank == 1:
                handle = weight.register_hook(_spoil)
            before = _masters_and_state(engine, opt)
            slices = [u.secondary.clone() for u in engine.units] if resident and step == 1 else []
            comm.reset_stats()
            _train(engine, rank, world, 2, accum, [batch])
            if handle is not None:
                handle.remove()
            after = _masters_and_state(engine, opt)
            assert all(torch.equal(before[n], after[n]) for n in before) == engine.overflow, (config, step)
            if slices and engine.overflow:  # the Inf's step: nothing exchanged: the resident slices stay as they were
                assert comm.stats()["exchange"]["calls"] == 0, comm.stats()["exchange"]
                assert all(torch.equal(a, u.secondary) for a, u in zip(slices, engine.units)), step
            record.append((engine.overflow, engine.loss_scale))
            mine = torch.tensor(record[-1], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(every, mine)
            assert all(torch.equal(e, mine) for e in every), ("skipped or scaled unlike other ranks", step, every)
        if engine.mics is not None and engine.mics.replicas > 1:  # (1, k, W) has no cross-group all-reduce
            assert comm.stats()["all_reduce"] == _expected_all_reduce(engine), (config, comm.stats()["all_reduce"])
        masters = mics_masters(engine)
        engine.destroy()
        return masters, record

    bf16 = {"bf16": {"enabled": True}}
    for stage, accum in PRECISION_POINTS:
        got, _ = run({**_config(2, accum, _zero(stage, k, accum)), **bf16}, accum, False)
        want, _ = run({**_config(2, accum, {"stage": stage}), **bf16}, accum, False)
        key = f"bf16-s{stage}-a{accum}"
        out[key] = _rel_to_update(got, want)
        out[key + "-weights"] = {n: float(p.double().sum()) for n, p in got.items()}
    got, _ = run({**_config(2, 2, _split_zero(k, world)), **bf16}, 2, False)  # against the last: stage 2
    out["bf16-split-a2"] = _rel_to_update(got, want)
    out["bf16-split-a2-weights"] = {n: float(p.double().sum()) for n, p in got.items()}
    resident, _ = run({**_config(2, 2, _grouped_resident_zero((2, k, world))), **bf16}, 2, False)
    out["grouped-resident-bf16-bit-identical"] = all(torch.equal(resident[n], got[n]) for n in got)
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    want, want_record = run({**_config(2, 1, {"stage": 3}), **fp16}, 1, True)
    for stage in (3, 1, 2):
        got, record = run({**_config(2, 1, _zero(stage, k, 1)), **fp16}, 1, True)
        key = f"fp16-s{stage}-inf"
        out[key] = {"record": record, "zero3_record": want_record, "vs_zero3": _rel_to_update(got, want)}
        out[key + "-weights"] = {n: float(p.double().sum()) for n, p in got.items()}
    got, record = run({**_config(2, 1, _resident_zero("node")), **fp16}, 1, True)
    assert record == want_record and all(torch.equal(got[n], want[n]) for n in want), (record, want_record)
    out["fp16-resident-inf-bit-identical"] = True
    return out


def hpz_case(rank: int, world: int, k: int, exact: dict[str, torch.Tensor], steps: int) -> dict:
    """MiCS over ``k`` ranks of whole nodes with hpZ over each node (every unit gathered at every use): the same
    fp32 masters as exact MiCS (``exact``), bit for bit, and the last step's all-gathers send across nodes only the
    forward's gathers over the group (the backward's gather the secondaries inside the node)."""
    config = _config(2, 1, {"stage": 3, "mics_shard_size": k, "zero_hpz_partition_size": 2,
                            "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0})
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=config)
    assert engine.comm.hpz == 2
    data = batches(steps, 2 * world)
    _train(engine, rank, world, 2, 1, data[:-1])
    comm.reset_stats()
    _train(engine, rank, world, 2, 1, data[-1:])
    topo = engine.comm.topology
    same = topo.same_node_count(topo.group)
    forward = sum((k - same) * u.shard_numel * 4 for u in engine.units)
    assert comm.stats()["all_gather"]["sent_inter"] == forward, (comm.stats()["all_gather"], forward)
    masters = mics_masters(engine)
    engine.destroy()
    return {f"k{k}-hpz-bit-identical": all(torch.equal(masters[n], exact[n]) for n in exact)}


def _auto_want(world: int, d: int, stage: int = 3, memory: float | None = None,
               **options) -> tuple[int, int, int] | None:
    """The planner's first choice for the tiny GPT's preset (computed here from the preset, not from the module) on
    the default cluster of this layout, with ``memory`` bytes per rank when given, among the points it marks
    runnable (``Plan.unsupported``) at ``stage`` or below with ``options``: the fitting one of least step time (to
    ``zeropp.plan.rank``'s 6 digits; then fewer calls, then less memory); None when none fits. The stage of a point
    is the planner's (``Partition.stage``, ``grouped_stage``, ``resident``)."""
    spec, cluster = from_preset("tiny:nobias"), Cluster.default(world // d, d)
    if memory is not None:
        cluster = dataclasses.replace(cluster, memory=memory)
    fitting = {}
    for part in partitions(world, d):
        plan = Plan(part, **options)
        at = part.stage(world) or part.grouped_stage(world) or (3 if part.resident(world) else None)
        if at is None or at > stage or plan.unsupported(world, d) is not None:
            continue
        t = predict(spec, plan, cluster, Batch(2, spec.seq, 1, 4))
        if t.fits:
            fitting[(part.params, part.grads, part.optimizer)] = (float(f"{t.step_time:.6g}"), t.calls,
                                                                  t.memory_total)
    return min(fitting, key=fitting.__getitem__) if fitting else None


def _memories(world: int, d: int, *only: Partition) -> list[int]:
    """Memory per rank (bytes) that the tiny GPT's preset needs at each point of this layout (or at ``only``'s),
    sorted, as the planner counts it (exact options, micro-batch 2, fp32)."""
    spec, cluster = from_preset("tiny:nobias"), Cluster.default(world // d, d)
    return sorted({predict(spec, Plan(part), cluster, Batch(2, spec.seq, 1, 4)).memory_total
                   for part in only or partitions(world, d)})


def _explicit_zero(point: tuple[int, int, int], world: int, extra: dict) -> dict:
    """The ``zero_optimization`` block a user writes for ``point``, with ``extra``'s keys: the stage alone for a
    stage's point, ``mics_shard_size`` for MiCS, ``zeropp.partition`` with its stage otherwise."""
    p, g, o = point
    stages = {(1, 1, world): 1, (1, world, world): 2, (world, world, world): 3}
    if point in stages:
        return {"stage": stages[point], **extra}
    if p == g == o:
        return {"stage": 3, "mics_shard_size": p, **extra}
    stage = 3 if p > 1 else 1 if g == 1 else 2
    return {"stage": stage, "zeropp": {"partition": {"parameters": p, "gradients": g, "optimizer": o}}, **extra}


def _auto_resolve(rank: int, root: str, zero: dict, memory: float | None = None):
    """``auto_partition.resolve`` (what ``zeropp.initialize`` runs first) of ``zero`` for the tiny GPT with
    ``$ZEROPP_PLAN_CLUSTER`` naming the default cluster of this layout with ``memory`` bytes per rank (when given):
    the resolved config and what it printed."""
    printed = io.StringIO()
    topo = comm.get_default_topology()
    path = Path(root) / f"cluster-{rank}.json"
    if memory is not None:
        cluster = dataclasses.replace(Cluster.default(topo.num_nodes, topo.ranks_per_node), memory=memory)
        path.write_text(cluster.to_json())
        os.environ[ENV_CLUSTER] = str(path)
    try:
        with redirect_stdout(printed):
            config = auto_partition.resolve(load_config(_config(2, 1, zero), topo.world_size), GPT(MODEL, seed=0), topo)
    finally:
        os.environ.pop(ENV_CLUSTER, None)
    return config, printed.getvalue()


def auto_cases(rank: int, world: int, root: str, steps: int = 2) -> dict:
    """``"partition": "auto"`` at the default memory (80 GiB), at a memory between ZeRO-3's and the next larger
    point's (only ZeRO-3 fits) and one between the next two, each with exact collectives, and with qgZ, with hpZ
    (which the stage-1/2 points and MiCS inside a node refuse) and with stage 2 (a ceiling): the point and stage it
    resolves to are ``_auto_want``'s, and rank 0 alone prints them. At the default memory and where memory forces
    ZeRO-3, ``zeropp.initialize`` with the resolved config trains as the explicit config of the picked point
    (``_explicit_zero``), bit for bit. A memory below every point's is refused on every rank."""
    d = comm.get_default_topology().ranks_per_node
    need = _memories(world, d)
    zero3_memory = _memories(world, d, Partition(world, world, world))[0]
    above = [m for m in need if m > zero3_memory]
    memories = {"default": None, "zero3": (zero3_memory + above[0]) / 2, "mid": (above[0] + above[1]) / 2}
    auto = {"zeropp": {"partition": "auto"}}
    cases = [(name, {"stage": 3, **auto}, budget, {}) for name, budget in memories.items()]
    cases += [("qgz", {"stage": 3, "zero_quantized_gradients": True, **auto}, None, {"gradient_bits": 4}),
              ("hpz", {"stage": 3, "zero_hpz_partition_size": 2, **auto}, None, {"hpz": 2}),
              ("stage2", {"stage": 2, **auto}, None, {})]
    data = batches(steps, 2 * world)
    out: dict = {}
    for name, zero, budget, options in cases:
        config, printed = _auto_resolve(rank, root, zero, budget)
        point = config.zero_optimization.partition_point(world, d)
        want = _auto_want(world, d, zero["stage"], budget, **options)
        assert point == want, (name, point, want)
        stage = config.zero_optimization.stage
        assert ("-> stage {}, ({}, {}, {})".format(stage, *point) in printed) == (rank == 0), (name, printed)
        out[f"auto-{name}"] = point
        if name in ("default", "zero3"):
            explicit = _explicit_zero(point, world, {})
            engines = [zeropp.initialize(model=GPT(MODEL, seed=rank), config=c)[0]
                       for c in (config, _config(2, 1, explicit))]
            assert all(e.config.zero_optimization.partition_point(world, d) == point for e in engines)
            assert [e.stage for e in engines] == [stage, explicit["stage"]], (name, stage, explicit)
            for e in engines:
                _train(e, rank, world, 2, 1, data)
            a, b = (mics_masters(e) for e in engines)
            assert all(torch.equal(a[n], b[n]) for n in b), name
            for e in engines:
                e.destroy()
    try:
        _auto_resolve(rank, root, {"stage": 3, **auto}, need[0] / 2)
        raise AssertionError("auto with too little memory was accepted")
    except ConfigError as e:
        out["auto-refused"] = str(e)
    return out


def mics_masters(engine) -> dict[str, torch.Tensor]:
    """The fp32 master weights by parameter name, whole: an exact all-gather of each unit's master shards over the
    engine's shard group (the whole model under MiCS too: every group holds a replica)."""
    out = {}
    for unit in engine.units:
        full = torch.empty(unit.full.numel())
        comm.all_gather(unit.master, topology=engine.comm.topology, out=full)
        for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
            out[name] = full[off : off + shape.numel()].view(shape).clone()
    return out


def _rel_to_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``||got - want|| / ||want - init||`` over all parameters, ``init`` rank 0's starting weights: the distance
    to a run, against how far that run moved the weights."""
    init = dict(GPT(MODEL, seed=0).named_parameters())
    flat = [torch.cat([d[n].detach().reshape(-1) for n in sorted(want)]) for d in (got, want, init)]
    return ((flat[0] - flat[1]).norm() / (flat[1] - flat[2]).norm()).item()


def _expected_quantized_all_reduce(engine, bits: int, block: int) -> dict[str, int]:
    """The quantized cross-group all-reduce's counters for one boundary, by hand from ``zeropp.comm.all_reduce``'s
    formula: ``R`` replicas, ``r`` of them per node on ``n = R / r`` nodes, each slice of ``s`` elements packed to
    ``B`` bytes; the qgZ reduce-scatter sends ``n`` packs to each of the ``r - 1`` node peers (when ``r > 1``) and
    one to each of the ``n - 1`` other nodes, the all-gather one pack to each of the other ``R - 1`` replicas."""
    mics = engine.mics
    numel = sum(u.shard_numel for u in engine.units)
    big_r = mics.replicas
    r = max(1, mics.world.ranks_per_node // mics.size)
    n = big_r // r
    b = BlockFormat(bits, block).packed_bytes(-(-numel // big_r))
    intra = (r - 1) * n * b + (r - 1) * b
    inter = (n - 1) * b + (big_r - r) * b
    return {"calls": 1, "sent_intra": intra, "sent_inter": inter, "recv_intra": intra, "recv_inter": inter}


def quantized_cases(rank: int, world: int, k: int, exact: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                    steps: int, references: dict | None = None) -> dict:
    """MiCS over ``k`` with qwZ (int8) and qgZ (int4, the cross-group all-reduce included), trained as
    ``mics_cases``'s accumulation-1 case: its distance to that exact MiCS run and to single-process training
    (``exact``: their master weights), relative to their update; that every rank ends with the same weights; the
    cross-group all-reduce's counters against the formula; then the quantized all-reduce alone on fresh inputs
    (``_replica_bound``). The masters go into ``references`` under ``("qwz8-qgz4", k)``
    (``grouped_resident_quantized``)."""
    config = _config(2, 1, {"stage": 3, "mics_shard_size": k, "zero_quantized_weights": True,
                            "zero_quantized_gradients": True})
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=config)
    mics = engine.mics
    assert mics.replica_topology is not None and mics.replica_bits == 4
    data = batches(steps, 2 * world)
    _train(engine, rank, world, 2, 1, data[:-1])
    comm.reset_stats()
    _train(engine, rank, world, 2, 1, data[-1:])
    block = engine.config.zero_optimization.zeropp.block_size
    got, want = comm.stats()["all_reduce"], _expected_quantized_all_reduce(engine, 4, block)
    assert got == want, (got, want)
    assert _planned_all_reduce(Plan(Partition(k, k, k), weight_bits=8, gradient_bits=4), world, rank, 1) == got
    masters = mics_masters(engine)
    if references is not None:
        references[("qwz8-qgz4", k)] = masters
    key = f"k{k}-qwz8-qgz4"
    out = {key + "-vs-mics": _rel_to_update(masters, exact[0]),
           key + "-vs-single": _rel_to_update(masters, exact[1]),
           key + "-weights": {n: float(p.double().sum()) for n, p in masters.items()}}
    for bits in (8, 4, 2):
        out[f"k{k}-bound{bits}"] = _replica_bound(mics, bits, rank)
    engine.destroy()
    return out


def _replica_bound(mics, bits: int, rank: int, numel: int = 1001, block: int = 64) -> dict[str, float]:
    """``comm.all_reduce(bits=...)`` (AVG) over the replica group on fresh inputs (replica ``i``'s scaled by
    ``i + 1``, each shard position its own, made on every rank from seeds): the worst error over the bound of
    ``zeropp.comm.all_reduce``'s docstring (per element, from the block absmax of each replica's input and of the
    exact mean), the worst error, and whether the replicas' outputs are bit-identical."""
    replicas, topo = mics.replicas, mics.replica_topology
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(91 + 10 * i + mics.position + bits)) * (i + 1)
              for i in range(replicas)]
    mine = inputs[mics.index].clone()
    comm.all_reduce(mine, topology=topo, op=comm.ReduceOp.AVG, bits=bits, block_size=block)
    mean = torch.stack(inputs).double().mean(0)
    s = -(-numel // replicas)
    blocks = -(-s // block)

    def block_absmax(x: torch.Tensor) -> torch.Tensor:  # per element: the absmax of its block (blocks per slice)
        slices = torch.zeros(replicas * s, dtype=x.dtype)
        slices[:numel] = x
        padded = torch.zeros(replicas, blocks * block, dtype=x.dtype)
        padded[:, :s] = slices.view(replicas, s)
        absmax = padded.view(replicas, blocks, block).abs().amax(2, keepdim=True).expand(-1, -1, block)
        return absmax.reshape(replicas, -1)[:, :s].reshape(-1)[:numel]

    q = BlockFormat(bits, block).qmax
    hops = 2 if topo.ranks_per_node > 1 else 1
    e1 = torch.stack([block_absmax(x.double()) for x in inputs]).mean(0) / (2 * q)
    if hops == 2:
        e1 = e1 * (2 + 1 / (2 * q))
    bound = e1 * (1 + 1 / (2 * q)) + block_absmax(mean) / (2 * q) + 1e-6 * mean.abs().max()
    error = (mine.double() - mean).abs()
    outs = [torch.empty_like(mine) for _ in range(replicas)]
    torch.distributed.all_gather(outs, mine, group=mics.replica_group)
    return {"ratio": (error / bound).max().item(), "max": error.max().item(), "hops": hops,
            "same": all(torch.equal(o, outs[0]) for o in outs)}


def _quantized_checkpoints(rank: int, world: int, root: str, k: int) -> dict:
    """MiCS over ``k`` with qgZ saves, ZeRO-3 (exact) loads it (the same fp32 weights, bit for bit), steps once and
    saves, and MiCS with qgZ loads that (bit for bit)."""
    data = batches(2, 2 * world)
    qgz = {"stage": 3, "mics_shard_size": k, "zero_quantized_gradients": True}
    first, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, qgz))
    _train(first, rank, world, 2, 1, data[:1])
    first.save_checkpoint(Path(root) / "ckpt", tag="mics-qgz")
    zero3, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=5), config=_config(2, 1, {"stage": 3}))
    zero3.load_checkpoint(Path(root) / "ckpt", tag="mics-qgz")
    saved = first.full_parameters()
    assert all(torch.equal(saved[n], p) for n, p in zero3.full_parameters().items())
    _train(zero3, rank, world, 2, 1, data[1:])
    zero3.save_checkpoint(Path(root) / "ckpt", tag="zero3-after-qgz")
    back, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=6), config=_config(2, 1, qgz))
    back.load_checkpoint(Path(root) / "ckpt", tag="zero3-after-qgz")
    assert all(torch.equal(zero3.full_parameters()[n], p) for n, p in back.full_parameters().items())
    _train(back, rank, world, 2, 1, data[:1])  # and trains on
    for e in (first, zero3, back):
        e.destroy()
    return {"qgz_checkpoints": True}


def _tiny_engine(zero: dict, seed: int):
    """An engine of the tiny GPT (weights from ``seed``) under ``zero``, 2 sequences per rank per step."""
    return zeropp.initialize(model=GPT(MODEL, seed=seed), config=_config(2, 1, zero))[0]


def _same_weights(a, b) -> bool:
    """Whether engines ``a`` and ``b`` hold the same whole parameters, bit for bit."""
    return all(torch.equal(a.full_parameters()[n], p) for n, p in b.full_parameters().items())


def _checkpoints(rank: int, world: int, root: str, k: int) -> dict:
    """Save under MiCS over ``k``, load under ZeRO-3 over the world and under ``(1, k, k)`` (the same weights, bit
    for bit), train all three on (the resumed runs against MiCS's), save under ZeRO-3 and load under MiCS and
    ``(1, 1, k)``, save under ``(1, k, k)`` and load under ``(1, 1, k)``, save that and load it under MiCS (each bit
    for bit)."""
    out: dict = {}
    data = batches(2, 2 * world)
    ckpt = Path(root) / "ckpt"
    first = _tiny_engine(_zero(3, k, 1), 0)
    _train(first, rank, world, 2, 1, data[:1])
    path = first.save_checkpoint(ckpt, tag="mics")
    assert path == ckpt / "mics"
    zero3, grouped2 = _tiny_engine({"stage": 3}, 5), _tiny_engine(_zero(2, k, 2), 7)
    for e in (zero3, grouped2):
        e.load_checkpoint(ckpt, tag="mics")
        assert _same_weights(first, e)
    for e in (first, zero3, grouped2):
        _train(e, rank, world, 2, 1, data[1:])
    for key, e in (("resumed_zero3_vs_mics", zero3), ("resumed_grouped2_vs_mics", grouped2)):
        out[key] = max(v[0] for v in relative_errors(e.full_parameters(),
                                                     _as_module(first.full_parameters())).values())
    moves = ((zero3, "zero3", _zero(3, k, 1)), (grouped2, "grouped2", _zero(1, k, 2)))
    loaded = []
    for saver, tag, zero in moves:
        saver.save_checkpoint(ckpt, tag=tag)
        back = _tiny_engine(zero, 6)
        if loaded:  # the (1, 1, k) engine also loads ZeRO-3's checkpoint first
            back.load_checkpoint(ckpt, tag="zero3")
            assert _same_weights(zero3, back)
        back.load_checkpoint(ckpt, tag=tag)
        assert _same_weights(saver, back), tag
        loaded.append(back)
    loaded[1].save_checkpoint(ckpt, tag="grouped1")
    mics_again = _tiny_engine(_zero(3, k, 1), 8)
    mics_again.load_checkpoint(ckpt, tag="grouped1")
    assert _same_weights(loaded[1], mics_again)
    for e in (first, zero3, grouped2, *loaded, mics_again):
        e.destroy()
    return out


def _as_module(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = GPT(MODEL, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    return model


def _resident_zero(p: int | str, accum_zero: dict | None = None) -> dict:
    """The resident point ``(p, W, W)`` at stage 3, every unit gathered at every use (so each forward and backward
    gather is counted), with ``accum_zero``'s extra keys."""
    return {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "zeropp": {"partition": {"parameters": p, "gradients": "world", "optimizer": "world"}},
            **(accum_zero or {})}


def _expected_resident(engine, accum: int) -> dict[str, dict[str, int]]:
    """The resident point's counters for one applied step, by hand: every unit's exact stepped shard (``S b``
    bytes) sent to each holder but this rank (``exchange``, once), the holders found from the partition layout
    (the ``h``-rank partitions are runs of ``h`` local indices of a node, or ``h / d`` whole nodes; the secondary
    at position ``i`` holds shards ``i G .. (i + 1) G - 1``, ``G = W / h``); every forward and backward gather of
    every unit inside the partition, ``(h - 1) G S b`` bytes each, ``(h - same) G S b`` of them across nodes
    (``same`` the partition's ranks on this rank's node: ``h`` inside a node, ``d`` for whole nodes): two per
    micro-batch, one for the root unit (whole from its forward to the end of the backward)."""
    topo, h = engine.comm.topology, engine.comm.hpz
    world, me = topo.world_size, topo.rank
    group = world // h
    d = topo.ranks_per_node
    partitions = ([node[i : i + h] for node in topo.nodes for i in range(0, d, h)] if d % h == 0 else
                  [[r for node in topo.nodes[m : m + h // d] for r in node] for m in range(0, len(topo.nodes), h // d)])

    def position(r: int) -> int:
        g = topo.ranks[r]
        return next(sorted(part).index(g) for part in partitions if g in part)

    def node(r: int) -> int:
        return topo.node_of(topo.ranks[r])

    b = engine.units[0].full.element_size()
    s = sum(u.shard_numel for u in engine.units) * b
    uses = sum((1 if u.name == "" else 2) * u.shard_numel for u in engine.units) * b * accum
    holders = [j for j in range(world) if position(j) == me // group and j != me]
    owners = [o for o in range(position(me) * group, (position(me) + 1) * group) if o != me]
    same = [sum(node(q) == node(me) for q in peers) for peers in (holders, owners)]
    exchange = {"calls": 1, "sent_intra": same[0] * s, "sent_inter": (len(holders) - same[0]) * s,
                "recv_intra": same[1] * s, "recv_inter": (len(owners) - same[1]) * s}
    same_node = min(h, d)
    intra, inter = (same_node - 1) * group * uses, (h - same_node) * group * uses
    calls = sum(1 if u.name == "" else 2 for u in engine.units) * accum
    gather = {"calls": calls, "sent_intra": intra, "sent_inter": inter, "recv_intra": intra, "recv_inter": inter}
    return {"exchange": exchange, "all_gather": gather}


def resident_cases(rank: int, world: int, root: str, checkpoints: bool, steps: int = 4) -> dict:
    """The resident point ``(p, W, W)`` (``zeropp.engine.weight_deltas``' exact mode) for ``p`` the ranks per node and,
    where a node has 4 ranks, 2, and at 4 x 2 also 4 (two whole nodes): all trained beside one exact ZeRO-3 run
    (accumulation 2, clipping on, an Inf in one gradient element on rank 1 at step 1), the same fp32 masters, compute
    weights and gradient norms bit for bit at every step; the skipped step moves nothing and changes nothing; the last
    step's byte counters equal ``_expected_resident`` and ``zeropp.plan``'s prediction of the point, the
    reduce-scatter's equal ZeRO-3's, and the model states' and secondaries' bytes equal ``zeropp.plan.memory``. With
    ``checkpoints`` a checkpoint moves ZeRO-3 -> ``(node, W, W)`` -> ZeRO-3, bit for bit, and a refused combination is
    reported; at 4 x 2 (without ``checkpoints``) ``(4, W, W)`` -> ZeRO-3 -> ``(4, W, W)`` bit for bit
    (``"resident-4-checkpoints"``) and qgZ refused there (``"refused-spanning"``: the message)."""
    out: dict = {}
    d = comm.get_default_topology().ranks_per_node
    data = batches(steps, 2 * world)
    sizes = resident_sizes(world, d)
    residents = {p: zeropp.initialize(model=GPT(MODEL, seed=rank), config=_config(1, 2, _resident_zero(p), 0.5))[0]
                 for p in sizes}
    zero3 = zeropp.initialize(model=GPT(MODEL, seed=rank),
                              config=_config(1, 2, _resident_zero(world, {"zeropp": {}}), 0.5))[0]
    engines = [*residents.values(), zero3]  # one ZeRO-3 run beside every resident point
    assert zero3.comm.hpz == 1
    for p, resident in residents.items():
        assert resident.comm.hpz == (d if p == "node" else p)
        assert resident.mics is None and resident.weight_deltas is not None and resident.weight_deltas.exact
    for step, batch in enumerate(data):
        stats = {}
        for engine in engines:
            w = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
            handle = w.register_hook(_spoil) if step == 1 and rank == 1 else None
            before = _masters_and_state(engine, engine.optimizer) if step == 1 else None
            secondaries = [u.secondary.clone() for u in engine.units] if step == 1 and engine is not zero3 else None
            if step == steps - 1 or step == 1:
                comm.reset_stats()
            _train(engine, rank, world, 1, 2, [batch])
            stats[id(engine)] = comm.stats()
            if handle is not None:
                handle.remove()
            if step == 1:  # the Inf reached every rank through the reduce-scatter: skipped everywhere
                assert engine.overflow and engine.skipped_steps == 1
                after = _masters_and_state(engine, engine.optimizer)
                assert all(torch.equal(before[n], after[n]) for n in before)
                if secondaries is not None:
                    assert stats[id(engine)]["exchange"]["calls"] == 0, stats[id(engine)]
                    assert all(torch.equal(a, u.secondary) for a, u in zip(secondaries, engine.units))
        want = mics_masters(zero3)
        for p, resident in residents.items():
            got = mics_masters(resident)
            assert all(torch.equal(got[n], want[n]) for n in want), (p, step)
            assert resident.get_global_grad_norm() == zero3.get_global_grad_norm(), (p, step)
            if step == steps - 1:
                counted = stats[id(resident)]
                for kind, expected in _expected_resident(resident, 2).items():
                    assert counted[kind] == expected, (p, kind, counted[kind], expected)
                assert counted["reduce_scatter"] == stats[id(zero3)]["reduce_scatter"]
                plan = Plan(Partition(resident.comm.hpz, world, world))
                planned = totals(collectives(from_preset("tiny:nobias"), plan, Layout(world, d, rank), 2, 4))
                got = {kind: {f: v for f, v in counted[kind].items() if f != "calls"} for kind in planned}
                assert got == planned, ("zeropp.plan", p, got, planned)
                mem = memory(from_preset("tiny:nobias"), plan, world, 1, 64, 4)
                assert state_bytes(resident) == {key: mem[key] for key in ("params", "grads", "optimizer")}, (
                    state_bytes(resident), mem)
                assert mem["secondary"] == sum(u.secondary.nbytes for u in resident.units), mem
                out[f"resident-{p}-zero3-inter"] = stats[id(zero3)]["all_gather"]["sent_inter"]
                out[f"resident-{p}-inter"] = counted["exchange"]["sent_inter"]
    b = zero3.full_parameters()
    for p, resident in residents.items():
        a = resident.full_parameters()
        assert all(torch.equal(a[n], b[n]) for n in b)
        out[f"resident-{p}-bit-identical"] = True
        out[f"resident-{p}-weights"] = {n: float(t.double().sum()) for n, t in a.items()}
    for engine in engines:
        engine.destroy()
    if checkpoints:
        out.update(_resident_checkpoints(rank, world, root))
        out.update(resident_combos(rank, world))
    elif 2 * d in sizes:  # the copy over two whole nodes
        zero = _resident_zero(2 * d)
        _checkpoint_chain(rank, world, Path(root) / "ckpt-spanning",
                          (("resident", zero), ("stage3", {"stage": 3}), ("resident-again", zero)))
        out[f"resident-{2 * d}-checkpoints"] = True
        try:
            zeropp.initialize(model=GPT(MODEL, seed=0),
                              config=_config(2, 1, _resident_zero(2 * d, {"zero_quantized_gradients": True})))
            raise AssertionError(f"qgZ at ({2 * d}, {world}, {world}) was accepted")
        except ConfigError as e:
            out["refused-spanning"] = str(e)
    return out


def resident_sizes(world: int, d: int) -> list[int | str]:
    """The resident points ``(p, W, W)`` ``resident_cases`` trains: ``"node"``, 2 on nodes of 4, and two whole nodes
    where the world has four nodes of 2 (4 x 2)."""
    return ["node"] + ([2] if d == 4 else []) + ([2 * d] if d == 2 and world == 4 * d else [])


def _resident_checkpoints(rank: int, world: int, root: str) -> dict:
    """ZeRO-3 trains a step and saves; ``(node, W, W)`` loads it (the same weights, bit for bit), steps beside
    ZeRO-3 (bit for bit) and saves; ZeRO-3 loads that (bit for bit). Then both take a ``gathered_parameters``
    write-back from rank 1 and step on (bit for bit), and a refused combination's message."""
    data = batches(3, 2 * world)
    ckpt = Path(root) / "ckpt"
    zero3 = _tiny_engine({"stage": 3}, 0)
    _train(zero3, rank, world, 2, 1, data[:1])
    zero3.save_checkpoint(ckpt, tag="zero3-for-resident")
    resident = _tiny_engine(_resident_zero("node"), 5)
    resident.load_checkpoint(ckpt, tag="zero3-for-resident")
    assert _same_weights(zero3, resident)
    for e in (zero3, resident):
        _train(e, rank, world, 2, 1, data[1:2])
    assert _same_weights(zero3, resident)
    resident.save_checkpoint(ckpt, tag="resident")
    back = _tiny_engine({"stage": 3}, 6)
    back.load_checkpoint(ckpt, tag="resident")
    assert _same_weights(resident, back)
    for e in (zero3, back, resident):
        _train(e, rank, world, 2, 1, data[2:])
    assert _same_weights(zero3, back) and _same_weights(zero3, resident)
    for e in (zero3, resident):  # a write-back replaces the slices of one unit outside the tier
        with e.gathered_parameters(e.module.blocks[1], modifier_rank=1), torch.no_grad():
            if rank == 1:
                e.module.blocks[1].mlp.c_fc.weight.mul_(0.5)
        _train(e, rank, world, 2, 1, data[:1])
    assert _same_weights(zero3, resident)
    for e in (zero3, resident, back):
        e.destroy()
    try:
        zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, _resident_zero(
            "node", {"offload_param": {"device": "cpu"}})))
        raise AssertionError("offload_param at the resident point was accepted")
    except ConfigError as e:
        return {"resident-checkpoints": True, "refused-resident": str(e)}


RESIDENT_COMBOS = {
    "qwz8-qgz4": ({"zero_quantized_weights": True, "zero_quantized_gradients": True}, {}, {}),
    "offload-cpu": ({"offload_optimizer": {"device": "cpu"}}, {}, {}),
    "bf16": ({}, {}, {"bf16": {"enabled": True}}),
    "deltas": ({}, {"weight_deltas": True}, {}),
    "onebit": ({}, {}, {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "weight_decay": 0.1,
                                                                       "freeze_step": 1}}}),
}
"""What the resident point composes with (docs/partition.md; OneBitAdam's second step is compressed): name ->
(``zero_optimization`` keys, ``zeropp`` keys, top-level keys), each run at ``(node, W, W)`` and at ZeRO-3 with
the same options (with hpZ over the node for weight deltas, which need it there)."""


def resident_combos(rank: int, world: int, steps: int = 2) -> dict:
    """Each of ``RESIDENT_COMBOS`` at ``(node, W, W)`` against ZeRO-3 with the same options: the same fp32 masters
    after ``steps`` steps, bit for bit (qwZ's gathers quantize the same blocks of the same values, inside the node
    from the slices' pack or over the world from the shards), or, with weight deltas, hpZ + weight deltas over the
    node's ranks, which the resident point then is."""
    out = {}
    d = comm.get_default_topology().ranks_per_node
    data = batches(steps, 2 * world)
    for name, (zero, zeropp_keys, top) in RESIDENT_COMBOS.items():
        masters = []
        for base in (_resident_zero("node"), {"stage": 3, **({"zero_hpz_partition_size": d} if zeropp_keys else {})}):
            config = {**_config(2, 1, {**base, **zero, "zeropp": {**base.get("zeropp", {}), **zeropp_keys}}), **top}
            engine = zeropp.initialize(model=GPT(MODEL, seed=rank), config=config)[0]
            _train(engine, rank, world, 2, 1, data)
            masters.append(mics_masters(engine))
            engine.destroy()
        out[f"resident-{name}-bit-identical"] = all(torch.equal(masters[0][n], masters[1][n]) for n in masters[1])
    return out


def _grouped_resident_zero(point: list[int] | tuple[int, ...], **extra) -> dict:
    """A grouped resident point ``(p, g, o)`` at stage 3, every unit gathered at every use (each forward and backward
    gather counted), with ``extra`` ``zero_optimization`` keys."""
    return {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "zeropp": {"partition": dict(zip(("parameters", "gradients", "optimizer"), point))}, **extra}


def _expected_grouped_resident(engine, accum: int) -> dict[str, dict[str, int]]:
    """A grouped resident point's counters for one applied step, by hand (``zeropp.comm.accounting``): the
    gradient reductions of ``(1, g, o)`` (``_expected_split``: every micro-batch over the ``g`` group, at the
    boundary over the peers when ``g < o``, then over the replicas) or of MiCS over ``o`` (every micro-batch over
    the shard group, then the replicas), and the resident point's gathers inside the ``p`` group and its exchange
    inside the shard group (``_expected_resident`` on the engine's shard topology)."""
    groups = engine.mics
    numel = sum(u.shard_numel for u in engine.units)
    if groups.gradient_split is not None:
        out = {kind: dict(t) for kind, t in _expected_split(engine, accum).items() if kind != "all_gather"}
    else:
        topo = groups.shard_topology
        once = gather_traffic(numel * 4, topo.world_size, topo.same_node_count(topo.group))
        t = comm.Traffic()
        for _ in range(accum):
            t = t + once
        out = {"reduce_scatter": {"sent_intra": t.sent_intra, "sent_inter": t.sent_inter,
                                  "recv_intra": t.recv_intra, "recv_inter": t.recv_inter}}
        if groups.replicas > 1:
            out["all_reduce"] = {f: v for f, v in _expected_all_reduce(engine).items() if f != "calls"}
    for kind, counted in _expected_resident(engine, accum).items():
        out[kind] = {f: v for f, v in counted.items() if f != "calls"}
    return out


def grouped_resident_cases(rank: int, world: int, points: list[list[int]], references: dict, steps: int = 4) -> dict:
    """Each grouped resident point ``(p, g, o)`` of ``points`` at accumulation 2 with clipping, the batches of
    ``_train_beside``: the groups' and the resident copy's layout; the last step's byte counters against the formula
    (``_expected_grouped_resident``) and ``zeropp.plan``'s traffic; the model states' and the resident copy's bytes
    against ``zeropp.plan.memory``; the whole weights bit for bit those of ``references[(1, g, o)]`` (``g < o``) or
    ``references[(g, g, g)]`` (MiCS, ``g = o``), trained by ``split_cases`` / ``mics_cases`` on the same batches
    (``"resident-p{p}-g{g}-o{o}"``: True)."""
    out: dict = {}
    micro, accum, clip = 1, 2, 0.5
    d = comm.get_default_topology().ranks_per_node
    for point in map(tuple, points):
        p, g, o = point
        engine = zeropp.initialize(model=GPT(MODEL, seed=rank),
                                   config=_config(micro, accum, _grouped_resident_zero(point), clip))[0]
        groups = engine.mics
        assert engine.stage == 3 and engine.comm.hpz == p and engine.comm.world_size == o
        assert engine.weight_deltas is not None and engine.weight_deltas.exact
        assert groups.replicas == world // o and (groups.gradient_split is None) == (g == o)
        for i, (inputs, targets) in enumerate(batches(steps, micro * accum * world)):
            if i == steps - 1:
                comm.reset_stats()
            _train(engine, rank, world, micro, accum, [(inputs, targets)])
        stats = comm.stats()
        got = {kind: {f: v for f, v in t.items() if f != "calls"} for kind, t in stats.items() if t["calls"]}
        want = _expected_grouped_resident(engine, accum)
        assert got == want, ("formula", point, got, want)
        plan = Plan(Partition(*point))
        planned = totals(collectives(from_preset("tiny:nobias"), plan, Layout(world, d, rank), accum, 4))
        assert got == planned, ("zeropp.plan", point, got, planned)
        mem = memory(from_preset("tiny:nobias"), plan, world, micro, 64, 4)
        assert state_bytes(engine) == {key: mem[key] for key in ("params", "grads", "optimizer")}, (
            point, state_bytes(engine), mem)
        assert mem["secondary"] == sum(u.secondary.nbytes for u in engine.units), (point, mem)
        reference = references[(1, g, o) if g < o else (g, g, g)]
        full = engine.full_parameters()
        assert all(torch.equal(full[n], t) for n, t in reference.items()), point
        out["resident-p{}-g{}-o{}".format(*point)] = True
        engine.destroy()
    return out


def grouped_resident_extras(rank: int, world: int, root: str, point: tuple[int, int, int], steps: int = 3) -> dict:
    """At the grouped resident ``point`` (fp32, accumulation 2): an Inf in one gradient element on rank 1 at step 1
    skips that step on every rank alike (``"resident-skip"``: per step whether it was skipped), leaving masters,
    shards, moments and the resident copy unchanged bit for bit, with no exchange; a checkpoint moves ZeRO-3 ->
    ``point`` -> MiCS over ``g`` -> ``point`` -> ZeRO-3, each load bit for bit; qgZ is refused
    (``"refused-grouped-resident"``: the message)."""
    engine = zeropp.initialize(model=GPT(MODEL, seed=rank), config=_config(1, 2, _grouped_resident_zero(point)))[0]
    weight = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
    record = []
    for step, batch in enumerate(batches(steps, 2 * world)):
        handle = weight.register_hook(_spoil) if step == 1 and rank == 1 else None
        before = _masters_and_state(engine, engine.optimizer)
        secondaries = [u.secondary.clone() for u in engine.units]
        comm.reset_stats()
        _train(engine, rank, world, 1, 2, [batch])
        if handle is not None:
            handle.remove()
        after = _masters_and_state(engine, engine.optimizer)
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        kept = all(torch.equal(a, u.secondary) for a, u in zip(secondaries, engine.units))
        assert unchanged == kept == engine.overflow, step
        assert (comm.stats()["exchange"]["calls"] == 0) == engine.overflow, step
        assert all(u.grad_accumulator is None or not u.grad_accumulator.any() for u in engine.units)
        record.append(engine.overflow)
    engine.destroy()
    zero = _grouped_resident_zero(point)
    _checkpoint_chain(rank, world, Path(root) / "ckpt-grouped-resident",
                      (("stage3", {"stage": 3}), ("resident", zero), ("mics", _zero(3, point[1], 2)),
                       ("resident-again", zero), ("stage3-again", {"stage": 3})))
    try:
        zeropp.initialize(model=GPT(MODEL, seed=0),
                          config=_config(2, 1, _grouped_resident_zero(point, zero_quantized_gradients=True)))
        raise AssertionError(f"qgZ at {point} was accepted")
    except ConfigError as e:
        return {"resident-skip": record, "refused-grouped-resident": str(e)}


def grouped_resident_quantized(rank: int, world: int, point: tuple[int, int, int],
                               reference: dict[str, torch.Tensor], steps: int) -> dict:
    """``(p, k, k)`` with qwZ (int8) and qgZ (int4), trained as ``quantized_cases``' MiCS over ``k`` with the same
    options: the fp32 masters bit for bit those of that run (``reference``; the gathers inside the ``p`` group send
    the resident copy's qwZ pack, whose blocks are the shards' blocks; the reductions are MiCS's), and the last
    step's byte counters equal ``zeropp.plan``'s traffic for the plan (``"resident-p{p}-g{k}-o{k}-qwz8-qgz4"``:
    True)."""
    zero = _grouped_resident_zero(point, zero_quantized_weights=True, zero_quantized_gradients=True)
    engine = zeropp.initialize(model=GPT(MODEL, seed=rank), config=_config(2, 1, zero))[0]
    assert engine.comm.hpz == point[0] and engine.mics.replica_bits == 4 and engine.comm.weight_bits == 8
    data = batches(steps, 2 * world)
    _train(engine, rank, world, 2, 1, data[:-1])
    comm.reset_stats()
    _train(engine, rank, world, 2, 1, data[-1:])
    got = {kind: {f: v for f, v in t.items() if f != "calls"} for kind, t in comm.stats().items() if t["calls"]}
    plan = Plan(Partition(*point), weight_bits=8, gradient_bits=4)
    planned = totals(collectives(from_preset("tiny:nobias"), plan,
                                 Layout(world, comm.get_default_topology().ranks_per_node, rank), 1, 4))
    assert got == planned, ("zeropp.plan", point, got, planned)
    masters = mics_masters(engine)
    assert all(torch.equal(masters[n], t) for n, t in reference.items()), point
    engine.destroy()
    return {"resident-p{}-g{}-o{}-qwz8-qgz4".format(*point): True}
