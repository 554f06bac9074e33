"""Worker functions for tests/engine/test_partition.py: the grouped points (``zeropp.engine.partition``: MiCS
``(k, k, k)`` at stage 3, ``(1, 1, k)`` at stage 1, ``(1, k, k)`` at stage 2) on real gloo processes, against plain
single-process training (engine_workers.py's reference), their byte counters against the formulas and against
``zeropp.plan``'s prediction (the cross-group all-reduce's calls and bytes at every point, exact and qgZ; at stages
1 and 2 every kind, with the model states' bytes), and checkpoints moved between MiCS,
ZeRO-3 and the grouped stage-1/2 points; MiCS with qwZ and qgZ
(``quantized_cases``) against exact MiCS, the quantized cross-group all-reduce against its bound, checkpoints
MiCS+qgZ <-> ZeRO-3, and bf16 and fp16 (an overflow skipped on every group alike) at the grouped points
(``precision_cases``). One launch per layout runs every case."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import torch
from engine_workers import MODEL, batches, relative_errors, state_bytes, torch_optimizer

import zeropp
from zeropp import comm
from zeropp.comm.accounting import gather_traffic
from zeropp.config import ConfigError
from zeropp.models import GPT
from zeropp.plan import Batch, Cluster, Partition, Plan, from_preset, predict
from zeropp.plan.memory import memory
from zeropp.plan.traffic import Layout, collectives, totals
from zeropp.plan.space import shard_factors
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


def mics_cases(rank: int, world: int, root: str, sizes: list[int], checkpoints: bool, steps: int = 4) -> dict:
    """For each group size in ``sizes`` and each of ``CASES`` (MiCS at accumulation 1 and 2, clipping on in the
    second; ``(1, 1, k)`` and ``(1, k, k)`` at accumulation 2, for the last size only: the layouts' last sizes are
    a group inside a node, a whole node and two nodes): train against the single-process reference and
    return the worst relative errors; check the groups' layout, that every rank ends with the same weights, the
    byte counters of one boundary; then, with ``checkpoints``, move a checkpoint MiCS -> ZeRO-3 -> MiCS and MiCS ->
    ``(1, k, k)`` -> ``(1, 1, k)`` -> MiCS."""
    out: dict = {}
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
                mem = memory(from_preset("tiny:nobias"), Plan(Partition(*point)), world, micro, 64, 4)
                assert state_bytes(engine) == {key: mem[key] for key in ("params", "grads", "optimizer")}, (
                    state_bytes(engine), mem)
            for got, want in norms:
                assert abs(got - want) <= 1e-5 * want, (got, want)
            errors = relative_errors(engine.full_parameters(), ref)
            key = f"s{stage}-k{k}-m{micro}-a{accum}-clip{clip}"
            if stage == 3 and accum == 1:
                exact[k] = (mics_masters(engine), {n: p.detach().clone() for n, p in ref.named_parameters()})
            out[key] = {"norm": max(e[0] for e in errors.values()), "max": max(e[1] for e in errors.values())}
            out[key + "-weights"] = {n: float(p.double().sum()) for n, p in engine.full_parameters().items()}
            engine.destroy()
    for k in sizes:
        out.update(quantized_cases(rank, world, k, exact[k], steps))
        if k > comm.get_default_topology().ranks_per_node:
            out.update(hpz_case(rank, world, k, exact[k][0], steps))
    if checkpoints:
        out.update(precision_cases(rank, world, sizes[0]))
        out.update(auto_cases(rank, world))
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
    """bf16 at each of ``PRECISION_POINTS`` over ``k`` against bf16 at the same stage over the world with the same
    micro-batch and accumulation (``"bf16-s{stage}-a{accum}"``: the distance of the fp32 masters relative to the
    update, and the masters' sums for the every-rank check; the stage's own point, not ZeRO-3, since stage 1 sums
    its micro-batches in the bf16 ``.grad``: 1.8e-2 of the update from ZeRO-3 at accumulation 2); then fp16 (loss
    scale 2^8, hysteresis 1) under MiCS and ``(1, 1, k)`` with an Inf in one element of one weight's gradient on
    rank 1 (one group) at step 1: per step whether it was skipped and the loss scale (equal on every rank: the Inf
    reaches the other groups through the cross-group all-reduce, which runs before the check), the skipped step
    leaving masters, shards and moments unchanged bit for bit (checked here), and the distance to fp16 ZeRO-3 with
    the same Inf."""
    out: dict = {}
    data = batches(steps, 2 * 2 * world)

    def run(config: dict, accum: int, inject: bool) -> tuple[dict[str, torch.Tensor], list[tuple[bool, float]]]:
        engine, opt, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=config)
        weight = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
        record = []
        for step, batch in enumerate(data):
            handle = None
            if inject and step == 1 and rank == 1:
                def spoil(g: torch.Tensor) -> torch.Tensor:
                    g = g.clone()
                    g.view(-1)[3] = float("inf")
                    return g
                handle = weight.register_hook(spoil)
            before = _masters_and_state(engine, opt)
            _train(engine, rank, world, 2, accum, [batch])
            if handle is not None:
                handle.remove()
            after = _masters_and_state(engine, opt)
            assert all(torch.equal(before[n], after[n]) for n in before) == engine.overflow, (config, step)
            record.append((engine.overflow, engine.loss_scale))
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
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    want, want_record = run({**_config(2, 1, {"stage": 3}), **fp16}, 1, True)
    for stage in (3, 1):
        got, record = run({**_config(2, 1, _zero(stage, k, 1)), **fp16}, 1, True)
        key = f"fp16-s{stage}-inf"
        out[key] = {"record": record, "zero3_record": want_record, "vs_zero3": _rel_to_update(got, want)}
        out[key + "-weights"] = {n: float(p.double().sum()) for n, p in got.items()}
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


def auto_cases(rank: int, world: int, steps: int = 2) -> dict:
    """``"partition": "auto"`` with qgZ: the point it applies is the fastest of ZeRO-3 and the MiCS points as
    ``zeropp.plan.predict`` times them for the tiny GPT's preset on the default cluster of this layout (fitting
    ones; computed here from the preset, not from the module); rank 0 alone prints it; training then matches the
    explicit config of that point bit for bit. With hpZ (which MiCS refuses) it applies ZeRO-3."""
    zero = {"stage": 3, "zero_quantized_gradients": True, "zeropp": {"partition": "auto"}}
    printed = io.StringIO()
    with redirect_stdout(printed):
        auto, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=_config(2, 1, zero))
    topo = auto.topology
    n, d = topo.num_nodes, topo.ranks_per_node
    spec, cluster = from_preset("tiny:nobias"), Cluster.default(n, d)
    times = {k: predict(spec, Plan(Partition(k, k, k), gradient_bits=4), cluster, Batch(2, spec.seq, 1, 4))
             for k in shard_factors(world, d) if k >= 2}
    want = min((k for k in times if times[k].fits), key=lambda k: times[k].step_time)
    k = auto.config.zero_optimization.partition_point(world, d)[0]
    assert k == want and (auto.mics is None) == (k == world), (k, want)
    assert (f"({k}, {k}, {k})" in printed.getvalue()) == (rank == 0), printed.getvalue()
    explicit_zero = {"stage": 3, "zero_quantized_gradients": True, **({"mics_shard_size": k} if k < world else {})}
    explicit, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=rank), config=_config(2, 1, explicit_zero))
    data = batches(steps, 2 * world)
    for engine in (auto, explicit):
        _train(engine, rank, world, 2, 1, data)
    a, b = mics_masters(auto), mics_masters(explicit)
    assert all(torch.equal(a[name], b[name]) for name in a)
    with redirect_stdout(io.StringIO()):
        hpz, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, {
            "stage": 3, "zero_hpz_partition_size": 2, "zeropp": {"partition": "auto"}}))
    assert hpz.mics is None and hpz.config.zero_optimization.partition_point(world, d) == (world,) * 3
    for engine in (auto, explicit, hpz):
        engine.destroy()
    return {"auto": k}


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
                    steps: int) -> dict:
    """MiCS over ``k`` with qwZ (int8) and qgZ (int4, the cross-group all-reduce included), trained as
    ``mics_cases``'s accumulation-1 case: its distance to that exact MiCS run and to single-process training
    (``exact``: their master weights), relative to their update; that every rank ends with the same weights; the
    cross-group all-reduce's counters against the formula; then the quantized all-reduce alone on fresh inputs
    (``_replica_bound``)."""
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
