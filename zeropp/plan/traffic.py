"""The collectives a plan runs in one optimizer step and the bytes each moves, per rank and per link class.

Bytes come from the formulas the engine's counters record and its tests check (``zeropp.comm.accounting``:
``gather_traffic`` for ring all-gathers and exact reduce-scatters, ``all_to_all_traffic`` for qgZ's two hops; pack
sizes from ``zeropp.quant.BlockFormat.packed_bytes``), applied to the engine's unit layout (``shard_numel``, the
layout of ``zeropp.engine.unit.flat_layout``). For the partitions the engine runs (stages 1-3, hpZ, weight deltas,
the grouped stage-1/2 points ``(1, 1, k)``, ``(1, k, k)`` and ``(1, g, o)``, MiCS and the resident points
``(p, g, o)``, ``1 < p < o``) the totals per kind equal
``zeropp.comm.stats()`` after one step (tests/engine/test_zeropp.py, tests/engine/test_partition.py); the other
points of the space use the same formulas on their groups.

Per step with ``A`` micro-batches, ``P`` ranks, ``d`` per node, ``n`` nodes, each unit of shard ``S`` elements:

* stage 3: every unit is gathered before its forward and (all but the root, which stays whole) again before its
  backward, every micro-batch, over the P group (qwZ bits when on). hpZ (``h``): the first gather of a step goes
  over the data-parallel group and keeps a secondary of ``P S / h`` elements, the others gather the secondaries
  exactly inside the node; weight deltas keep the secondaries across steps (one ``exchange`` of int4 deltas per
  step, no data-parallel gather), and with qwZ every gather inside the node sends the secondary's qwZ pack, made
  once per step after the exchange;
* gradients: one reduce-scatter per unit per micro-batch (stage 2, 3: G sharded), or per step (stage 1: G whole);
  exact (ring, in the compute dtype) or qgZ (an all-to-all inside the node of ``n`` packs per peer, then one across
  nodes of one pack per peer);
* stages 1 and 2 gather the stepped shards after the optimizer step (qwZ bits when on);
* the resident points ``(p, g, o)``, ``1 < p < o`` (``zeropp.engine.weight_deltas``' exact mode): the units
  sharded over the ``o`` ranks of the OS group (``P`` at ``(p, P, P)``), every forward and backward gather from the
  secondaries over ``p`` ranks (of a node, or ``p / d`` whole nodes: then ``d`` of them on this rank's node;
  ``o S / p`` elements each; under qwZ their pack, made once per step), and
  one ``exchange`` per step of every unit's exact stepped shard (``S b`` bytes) to the holders of this rank's shard
  inside the OS group; the gradients reduced as below;
* G sharded over fewer ranks than OS (``(1, g, o)``, ``g < o``): each micro-batch's reduce-scatter over the G group
  delivers ``o / g`` rows of the OS layout (``(o / g) S_o`` elements per rank), accumulated in float32; at the
  boundary one exact float32 reduce-scatter of every unit's rows, end to end, across the ``o / g`` G groups of the
  OS group (``zeropp.engine.partition.SplitGroups``) leaves each rank its ``S_o`` per unit;
* OS sharded over fewer than ``P`` ranks (the grouped points the engine runs, MiCS, ``(1, 1, k)``, ``(1, k, k)`` and
  ``(1, g, o)``, and the points it does not): gradients reduced within the OS group as above and all-reduced across
  the groups once per step, the stepped OS shards gathered into the P layout. As the engine
  runs it (``zeropp.engine.partition.MicsGroups.sync_gradients``), that all-reduce is one call per step on every
  unit's float32 gradient shard laid end to end (``N`` elements, whatever the compute dtype), cut into
  ``ceil(N / R)``-element slices over the ``R`` groups. With qgZ (G sharded) it is quantized
  (``zeropp.comm.all_reduce(bits=...)``, as the engine runs it under MiCS): its bytes are
  ``zeropp.comm.all_reduce``'s formula, its time a ring all-reduce of packed slices.

Persistent units (``stage3_param_persistence_threshold``) and reuse (``stage3_max_reuse_distance``) are not modelled:
every unit is gathered at each use, as with a threshold of 0 (units of large models are far above DeepSpeed's 1e5).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..comm.accounting import Traffic, all_to_all_traffic, gather_traffic
from ..quant.format import DEFAULT_BLOCK_SIZE, BlockFormat
from .model import ModelSpec, UnitSpec
from .space import Plan

PHASES = ("forward", "backward", "boundary", "step")
"""When a collective runs: under the forward or backward compute (overlappable), at the end of the accumulation
window, or after the optimizer step (exposed)."""


@dataclass(frozen=True)
class Collective:
    """One collective of a step, ``calls`` times per step.

    Attributes:
        kind: the ``zeropp.comm.stats()`` kind that counts it ("all_gather", "reduce_scatter", "exchange"), or
            "all_reduce" for the cross-group gradient reduction.
        what: what it moves, for reports.
        unit: the unit's name.
        phase: one of ``PHASES``.
        algorithm: "ring" (gloo and NCCL all-gather and reduce-scatter: ``group - 1`` steps of ``chunk`` bytes;
            an all-reduce twice that) or "pairwise" (all-to-all and exchange: ``chunk`` bytes straight to each peer).
        group: ranks in the group.
        same_node: ranks of the group on this rank's node, itself included.
        groups_per_node: groups that have ranks on one node and run at the same time (they share its link).
        chunk: bytes per ring step (ring) or per peer (pairwise).
        calls: calls per optimizer step.
        traffic: this rank's bytes per call (``zeropp.comm.accounting``).
        kernel_bytes: memory traffic of the call's quantization kernels (bytes read and written).
    """

    kind: str
    what: str
    unit: str
    phase: str
    algorithm: str
    group: int
    same_node: int
    groups_per_node: int
    chunk: int
    calls: int
    traffic: Traffic
    kernel_bytes: float = 0.0


def shard_numel(unit: UnitSpec, align: int, ranks: int) -> int:
    """Elements of one rank's shard of ``unit`` sharded over ``ranks`` with every parameter starting on a multiple of
    ``align`` (``zeropp.engine.unit.flat_layout``'s ``S``)."""
    end = 0
    for n in unit.numels:
        end = -(-end // align) * align + n
    return -(-end // (ranks * align)) * align if end else 0


def pack_bytes(numel: int, bits: int | None, dtype_bytes: int) -> int:
    """Bytes of ``numel`` elements on the wire: a qwZ/qgZ pack of ``bits`` (codes and float32 block scales), or the
    values in the compute dtype."""
    return BlockFormat(bits, DEFAULT_BLOCK_SIZE).packed_bytes(numel) if bits else numel * dtype_bytes


def alignment(plan: Plan) -> int:
    """``zeropp.engine.Collectives.alignment``: the block size when anything is quantized, else 1."""
    return DEFAULT_BLOCK_SIZE if plan.weight_bits or plan.gradient_bits or plan.weight_deltas else 1


@dataclass(frozen=True)
class Layout:
    """Where rank ``rank`` of ``world`` (``ranks_per_node`` per node, node-contiguous) sits."""

    world: int
    ranks_per_node: int
    rank: int = 0

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def same_node(self, group: int, stride: int = 1) -> int:
        """Members of this rank's node in a group of ``group`` ranks ``stride`` apart (node-aligned)."""
        return max(1, min(group, self.ranks_per_node // stride)) if stride < self.ranks_per_node else 1

    def groups_per_node(self, group: int, stride: int = 1) -> int:
        return self.ranks_per_node // self.same_node(group, stride)


def _gather(what: str, unit: str, phase: str, calls: int, group: int, same: int, per_node: int, numel: int,
            bits: int | None, dtype_bytes: int, packed: bool = False) -> Collective:
    """An all-gather of ``numel`` elements per rank; quantized: one quantize (unless ``packed``: the pack was made
    before) and ``group`` dequantizes per call."""
    chunk = pack_bytes(numel, bits, dtype_bytes)
    kernel = (numel * (dtype_bytes + chunk / numel) * (group + (not packed))) if bits and numel else 0.0
    return Collective("all_gather", what, unit, phase, "ring", group, same, per_node, chunk, calls,
                      gather_traffic(chunk, group, same), kernel)


def _reduce(unit: str, phase: str, calls: int, group: int, layout: Layout, numel: int, plan: Plan,
            dtype_bytes: int) -> list[Collective]:
    """A reduce-scatter of ``group * numel`` elements to ``numel`` per rank over a node-aligned group; under qgZ a
    group inside one node runs hop 1 alone (``zeropp.comm.reduce_scatter``: the ``d`` packs summed into the fp32
    output)."""
    d = min(group, layout.ranks_per_node)
    nodes = group // d
    if not plan.gradient_bits or group == 1:
        chunk = numel * dtype_bytes
        return [Collective("reduce_scatter", "gradient reduce-scatter", unit, phase, "ring", group, d,
                           layout.ranks_per_node // d, chunk, calls, gather_traffic(chunk, group, d))]
    fmt = BlockFormat(plan.gradient_bits, DEFAULT_BLOCK_SIZE)
    first = BlockFormat(plan.gradient_bits_intra or plan.gradient_bits, DEFAULT_BLOCK_SIZE) if d > 1 else fmt
    pack1, pack = first.packed_bytes(numel), fmt.packed_bytes(numel)
    out = []
    if d > 1:  # hop 1 (swizzled quantize of all P slices, then the fused reduce-requantize of d runs)
        last = nodes * pack if nodes > 1 else numel * 4  # one node: the d packs dequantized and summed
        kernel = group * numel * dtype_bytes + group * pack1 + d * nodes * pack1 + last
        out.append(Collective("reduce_scatter", "qgZ hop 1 (intra-node)", unit, phase, "pairwise", d, d, 1,
                              nodes * pack1, calls, all_to_all_traffic(nodes * pack1, d - 1, 0), kernel))
    if nodes == 1:
        return out
    kernel = nodes * pack + numel * 4 + (0 if d > 1 else group * numel * dtype_bytes + group * pack)
    out.append(Collective("reduce_scatter", "qgZ hop 2 (inter-node)", unit, phase, "pairwise", nodes, 1,
                          layout.ranks_per_node, pack, calls, all_to_all_traffic(pack, 0, nodes - 1), kernel))
    return out


def _all_reduce(numel: int, replicas: int, layout: Layout, stride: int, bits: int | None = None) -> Collective:
    """The engine's cross-group gradient all-reduce (``zeropp.engine.partition.MicsGroups.sync_gradients``): one call
    per step on ``numel`` float32 elements (every unit's gradient shard laid end to end) over ``replicas`` ranks
    ``stride`` apart. Exact: a ring all-reduce, a reduce-scatter and an all-gather of ``s = ceil(numel / replicas)``
    elements each, so twice a gather's bytes of ``4 s`` (``zeropp.comm.all_reduce``). Quantized (``bits``): slices
    of ``B`` packed bytes, ``r`` replicas per node on ``n`` nodes; the qgZ reduce-scatter sends ``n`` packs to each
    node peer and one to each other node, the all-gather one pack to every other replica (``zeropp.comm.all_reduce``),
    timed as a ring all-reduce of ``B``; its kernels quantize and dequantize the tensor twice (read, packs, reduced
    slice)."""
    same = layout.same_node(replicas, stride)
    per_node = layout.groups_per_node(replicas, stride)
    s = -(-numel // replicas)
    if bits is None:
        chunk = s * 4
        t = gather_traffic(chunk, replicas, same)
        return Collective("all_reduce", "cross-group gradient all-reduce", "(all)", "boundary", "ring", replicas,
                          same, per_node, chunk, 1, t + t)
    pack = BlockFormat(bits, DEFAULT_BLOCK_SIZE).packed_bytes(s)
    nodes = replicas // same
    intra, inter = (same - 1) * (nodes + 1) * pack, (nodes - 1 + replicas - same) * pack
    kernel = 2 * numel * 4 + 3 * replicas * pack + s * 4 + pack
    return Collective("all_reduce", "cross-group gradient all-reduce (quantized)", "(all)", "boundary", "ring",
                      replicas, same, per_node, pack, 1, Traffic(intra, inter, intra, inter), kernel)


def _peer_reduce(numel: int, peers: int, layout: Layout, stride: int) -> Collective:
    """``(1, g, o)``, ``g < o``: the boundary's exact reduce-scatter across the ``o / g`` G groups of an OS group
    (``zeropp.engine.partition.SplitGroups.sync_gradients``): one call per step on the ``peers * numel`` float32
    rows this rank accumulated (``numel``: every unit's OS shard, end to end) over ``peers`` ranks ``stride``
    apart, each receiving its ``4 numel`` bytes."""
    same = layout.same_node(peers, stride)
    chunk = numel * 4
    return Collective("reduce_scatter", "boundary gradient reduce-scatter across the G groups", "(all)", "boundary",
                      "ring", peers, same, layout.groups_per_node(peers, stride), chunk, 1,
                      gather_traffic(chunk, peers, same))


def _delta_exchange(model: ModelSpec, plan: Plan, layout: Layout, align: int, dtype_bytes: int) -> Collective:
    """Weight deltas: one exchange per step of every unit's int4 delta pack to the holders of this rank's shard
    (``zeropp.engine.weight_deltas``: positions are ranks modulo ``h``, consecutive ranks inside a node or whole
    consecutive nodes; the secondary at position ``i``
    holds the shards of ranks ``i G .. (i + 1) G - 1``, ``G = P / h``); its kernels include, with qwZ, the one
    quantize per step of each updated secondary (``G S`` elements) that the intra-node gathers then send. At the
    resident points without deltas, the exact stepped shards instead (``S b`` bytes per unit, no kernel but qwZ's
    repack), inside this rank's OS group of ``o`` ranks (``P`` at ``(p, P, P)``; the units are laid out over it and
    ``G = o / h``)."""
    d = layout.ranks_per_node
    ranks = plan.partition.optimizer if plan.partition.resident(layout.world) else layout.world
    h = plan.secondary(layout.world)
    exact = not plan.weight_deltas
    fmt = BlockFormat(4, DEFAULT_BLOCK_SIZE)
    nbytes = sum(count * (shard_numel(u, align, ranks) * dtype_bytes if exact
                          else fmt.packed_bytes(shard_numel(u, align, ranks))) for u, count in model.groups())
    group = ranks // h
    base = layout.rank // ranks * ranks  # the OS group's first rank (node-aligned groups are consecutive ranks)

    def position(r: int) -> int:
        return r % h

    def node(r: int) -> int:
        return (base + r) // d

    me = layout.rank - base
    holders = [j for j in range(ranks) if position(j) == me // group and j != me]
    owners = [j for j in range(position(me) * group, (position(me) + 1) * group) if j != me]
    sent_intra = sum(node(j) == node(me) for j in holders)
    recv_intra = sum(node(j) == node(me) for j in owners)
    t = Traffic(sent_intra * nbytes, (len(holders) - sent_intra) * nbytes, recv_intra * nbytes,
                (len(owners) - recv_intra) * nbytes)
    repack = 0.0
    if plan.weight_bits:
        for u, count in model.groups():
            secondary = group * shard_numel(u, align, ranks)
            repack += count * (secondary * dtype_bytes + pack_bytes(secondary, plan.weight_bits, dtype_bytes))
    what, kernel = ("stepped-shard exchange", 0.0) if exact else ("weight-delta exchange",
                                                                  2.0 * nbytes * (1 + len(holders)))
    return Collective("exchange", what, "(all)", "step", "pairwise", len(holders) + 1, sent_intra + 1, d, nbytes, 1,
                      t, kernel + repack)


def collectives(model: ModelSpec, plan: Plan, layout: Layout, accum: int, dtype_bytes: int) -> list[Collective]:
    """Every collective of one optimizer step of ``plan`` for rank ``layout.rank`` (see the module docstring);
    ``dtype_bytes`` is the compute dtype's size (the exact gathers and reduce-scatters move it; the cross-group
    all-reduce moves float32)."""
    world = layout.world
    if accum < 1:
        raise ValueError(f"gradient accumulation steps {accum!r} must be at least 1")
    part = plan.partition
    p, g, o = part.params, part.grads, part.optimizer
    align = alignment(plan)
    h = plan.secondary(world)
    resident = part.resident(world) is not None
    out: list[Collective] = []
    cross = 0  # elements of this rank's gradient shards all-reduced across the groups, every unit's
    for unit, count in model.groups():
        if unit.numel == 0:
            continue
        start = len(out)
        name = unit.name
        if p > 1:
            sp = shard_numel(unit, align, o if resident else p)  # resident: the units are laid out over o
            backward = 0 if name == "" else accum  # the root unit stays whole from its forward to its backward
            same, per_node = layout.same_node(p), layout.groups_per_node(p)
            secondary = (o if resident else p) * sp // h
            kept = plan.weight_deltas or resident  # the secondaries stay from step to step
            if h > 1 and not kept:  # the step's first gather makes the secondaries
                out.append(_gather("parameter gather", name, "forward", 1, p, same, per_node, sp, plan.weight_bits,
                                   dtype_bytes))
            if h > 1:
                bits = plan.weight_bits if kept else None  # kept: the secondary's qwZ pack
                for phase, calls in (("forward", accum - (not kept)), ("backward", backward)):
                    if calls:
                        out.append(_gather("hpZ secondary gather", name, phase, calls, h, layout.same_node(h),
                                           layout.groups_per_node(h), secondary, bits, dtype_bytes, packed=True))
            else:
                for phase, calls in (("forward", accum), ("backward", backward)):
                    if calls:
                        out.append(_gather("parameter gather", name, phase, calls, p, same, per_node, sp,
                                           plan.weight_bits, dtype_bytes))
        so = shard_numel(unit, align, o)
        if g > 1:  # the engine's layout: the o-layout's rows, o / g of them per rank of the G group
            out += _reduce(name, "backward", accum, g, layout, (o // g) * so, plan, dtype_bytes)
        else:
            out += _reduce(name, "boundary", 1, o, layout, so, plan, dtype_bytes)
        cross += count * so
        if o > p and not resident:
            so = shard_numel(unit, align, o)
            group = o // p
            out.append(_gather("stepped-shard gather", name, "step", 1, group, layout.same_node(group, p),
                               layout.groups_per_node(group, p), so, plan.weight_bits, dtype_bytes))
        out[start:] = [replace(c, calls=c.calls * count) for c in out[start:]]  # identical units: planned once
    if 1 < g < o and cross:
        out.append(_peer_reduce(cross, o // g, layout, g))
    if o < world and cross:  # the ranks a gradient shard is reduced over: the OS group
        out.append(_all_reduce(cross, world // o, layout, o, plan.gradient_bits if g > 1 else None))
    if plan.weight_deltas or resident:
        out.append(_delta_exchange(model, plan, layout, align, dtype_bytes))
    return out


def totals(colls: list[Collective]) -> dict[str, dict[str, int]]:
    """Bytes per step by ``zeropp.comm.stats()`` kind: ``{kind: {"sent_intra", "sent_inter", "recv_intra",
    "recv_inter"}}`` (this rank, summed over calls)."""
    out: dict[str, dict[str, int]] = {}
    for c in colls:
        t = out.setdefault(c.kind, dict.fromkeys(("sent_intra", "sent_inter", "recv_intra", "recv_inter"), 0))
        t["sent_intra"] += c.calls * c.traffic.sent_intra
        t["sent_inter"] += c.calls * c.traffic.sent_inter
        t["recv_intra"] += c.calls * c.traffic.recv_intra
        t["recv_inter"] += c.calls * c.traffic.recv_inter
    return out
