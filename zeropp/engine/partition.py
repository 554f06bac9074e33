"""The grouped points in the engine: a stage's engine run inside node-aligned groups of ``k`` ranks, ``k`` below
the world, with the groups' gradient shards averaged once per accumulation boundary (``zeropp.config.partition``):
MiCS ``(k, k, k)`` at stage 3 (``mics_shard_size`` or ``zeropp.partition``), ``(1, 1, k)`` at stage 1 and
``(1, k, k)`` at stage 2 (``zeropp.partition``; AMSP's replicated parameters with G and OS sharded over ``k``); and
``(1, g, o)`` with ``1 < g < o`` at stage 2 (``SplitGroups``, last paragraph).

The ``W`` ranks are cut into ``W / k`` node-aligned *shard groups* of ``k`` ranks: ``k`` consecutive local indices of
one node when ``k`` divides the ranks per node ``d``, else ``k / d`` consecutive whole nodes. Inside its shard group
the engine is ZeRO-1/2/3 over ``k`` ranks: its ``Collectives`` run over ``shard_topology`` (a ``comm.Topology`` of
the group), so parameter gathers (stage 3), gradient reduce-scatters, the optimizer step on the shard, the gathers of
the stepped shards (stages 1 and 2), the norm and Inf/NaN all-reduces, entry checks and checkpoint agreement stay
inside the group. Each group holds a full replica of the model's state; the rank at position ``i`` of every group
holds shard ``i``, and those ``W / k`` ranks form its *replica group*.

Once per accumulation boundary (MiCS's amortization: the micro-batches' reduce-scatters inside the group are summed
into each rank's fp32 gradient shard at stages 2 and 3; stage 1 reduce-scatters its accumulated whole gradients
once, at the boundary) ``sync_gradients`` averages every unit's gradient shard over the replica group in one fp32
all-reduce (``comm.all_reduce``, counted as ``"all_reduce"``), before the Inf/NaN check, clipping and the step;
every group then steps the same shard to the same weights. With qgZ (``zero_quantized_gradients``) that all-reduce
is quantized in ``gradient_bits`` (``quantize_replicas``: a qgZ reduce-scatter and a quantized all-gather over the
replica group's own topology, error bound in ``zeropp.comm.all_reduce``); every replica dequantizes the same packs,
so the groups still step to the same weights. The reduce-scatter inside the group is ZeRO-3's qgZ one (its error
feedback, rotation, stochastic rounding and intra-node bits apply there; the cross-group all-reduce rounds to
nearest without residuals). qwZ gathers inside the group as at ZeRO-3 (the ``Collectives`` on ``shard_topology``),
and so does hpZ for groups of whole nodes (``k`` above the ranks per node: the secondary inside each node of the
group; ``mics_refusals`` refuses it otherwise).

The weights start from the first rank's: ``broadcast_module`` sends every parameter and buffer of a model built
eagerly over the world before the units are built (each group's units then broadcast inside the group as at ZeRO-3).
A checkpoint is written by the first group alone (``save``): the groups hold the same state, so it is ZeRO-3's
checkpoint at ``k`` ranks (stage 1's or 2's for those points), and loads at any world size, stage or partition;
every group loads it.

The units' fp32 gradient shards are views into one buffer (``attach``, before the first backward), so the
cross-group all-reduce runs in place on it, with no temporary copy.

``(1, g, o)``, ``1 < g < o`` (``o`` up to the world; ``partition_groups`` picks the class): stage 2's engine over
the ``o``-rank shard groups (the units laid out over ``o`` ranks, the optimizer stepping the ``1 / o`` shard, the
stepped shards all-gathered over ``o``), with its gradient reduction split in two. Every micro-batch each unit's
gradient is reduce-scattered exactly over this rank's ``g`` group only (``shard_group_ranks`` over ``g``, inside
the shard group; ``Collectives``' ``GradientSplit``): the rank receives the ``o / g`` rows of the ``o`` layout that
belong to the ranks at its position in every ``g`` group of its shard group (its *peers*), added into the units'
fp32 ``grad_accumulator`` views of one buffer. At the boundary ``SplitGroups.sync_gradients`` reduce-scatters that
buffer over the peers (exact fp32, one call for all units), which leaves each rank its own row (the shard group's
mean of its ``1 / o`` sub-shard) in its gradient shard, zeroes the buffer and, when ``o`` is below the world,
all-reduces the shards over the replica groups as above. A checkpoint is stage 2's at ``o`` ranks.

The grouped *resident* points ``(p, g, o)``, ``2 <= p < o`` with ``o`` below the world or ``g`` below ``o``
(``zeropp.config.partition.resident_size``): stage 3's engine over the same groups as ``(1, g, o)``
(``SplitGroups`` for ``g < o``, ``MicsGroups`` over ``o`` for ``g = o``), its units laid out over the ``o``-rank
shard group, with the parameters kept as hpZ's secondary partition over ``p`` ranks inside it (``o / p`` rows of the
``o`` layout each): ``p`` ranks of a node, or ``p / d`` whole nodes for ``p`` a multiple of the ranks per node ``d``
(``comm.Topology.partition_of``; then the gathers cross nodes and the collectives are exact only,
``zeropp.config.partition.spanning_refusals``), made permanent as at the resident point ``(p, W, W)``: every forward
and backward gather runs inside the ``p`` group, the gradients are reduced as above (over the ``g`` group every
micro-batch, over the peers at the boundary, over the replicas when ``o`` is below the world), every group steps
its ``1 / o`` shards, and one exact exchange inside the shard group sends each stepped compute shard to the
holders of its row (``zeropp.engine.weight_deltas``' exact mode), which rebuilds the ``1 / p`` parameter copy. So
``(k, k, o)`` is MiCS over ``k`` for parameters and gradients with the boundary's reduce-scatter across the ``o / k``
groups and the optimizer states over ``o``, and ``(p, k, k)`` is MiCS over ``k`` with the parameters over ``p``.
Training is the same, bit for bit, as ``(1, g, o)`` (and ``(p, k, k)`` as MiCS over ``k``): the same layout,
reductions and step. ``(p, k, k)`` takes qwZ and qgZ as MiCS does (the gathers inside the ``p`` group send the
resident copy's qwZ pack, the reductions are MiCS's quantized ones), again bit for bit MiCS's with them; with
``g < o`` the collectives are exact (``zeropp.config.partition.grouped_resident_refusals``). A checkpoint is stage
3's at ``o`` ranks, written by the first group (``save``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..quant import DEFAULT_BLOCK_SIZE
from .collectives import GradientSplit
from .unit import Unit

T = TypeVar("T")


def shard_group_ranks(topology: comm.Topology, size: int) -> list[list[int]]:
    """Every shard group of ``size`` ranks of ``topology`` (global ranks, ascending in each), in order: runs of
    ``size`` local indices inside each node when ``size`` divides the ranks per node, else runs of ``size / d``
    whole nodes (``size`` a multiple of ``d`` dividing the world; ``zeropp.config.partition`` checked it)."""
    d = topology.ranks_per_node
    if d % size == 0:
        return [sorted(node[i : i + size]) for node in topology.nodes for i in range(0, d, size)]
    per = size // d
    nodes = topology.nodes
    return [sorted(r for node in nodes[m : m + per] for r in node) for m in range(0, len(nodes), per)]


class MicsGroups:
    """The shard and replica groups of a grouped point (MiCS or the stage-1/2 points) over ``size`` ranks (module
    docstring); creating it is a collective over ``topology``'s group (every rank makes its own groups, in the same
    order).

    Attributes:
        world: the data-parallel topology (all ``W`` ranks).
        size: ranks per shard group, ``k``.
        groups: every shard group's global ranks (``shard_group_ranks``); ``index``: this rank's group;
            ``position``: this rank's place in it (the shard it holds).
        shard_topology: the ``comm.Topology`` of this rank's shard group (the engine's ``Collectives`` run on it).
        replica_ranks: the ranks holding the same shard in every group, by group; ``replica_group``: their group.
    """

    def __init__(self, topology: comm.Topology, size: int) -> None:
        self.world = topology
        self.size = size
        self.groups = shard_group_ranks(topology, size)
        self.index = next(i for i, g in enumerate(self.groups) if topology.global_rank in g)
        mine = self.groups[self.index]
        self.position = mine.index(topology.global_rank)
        self.shard_topology = comm.Topology(topology.subgroup(mine), ranks_per_node=min(size, topology.ranks_per_node),
                                            host=topology.host, timeout=topology.timeout)
        self.replica_ranks = [g[self.position] for g in self.groups]
        self.replica_group = topology.subgroup(self.replica_ranks)
        self.replica_bits: int | None = None
        self.replica_block_size = DEFAULT_BLOCK_SIZE
        self.replica_topology: comm.Topology | None = None
        self.gradient_split: GradientSplit | None = None
        """The engine's ``Collectives`` reduce-scatter gradients over the shard group (None) or, ``SplitGroups``,
        over a ``g`` group inside it."""
        self.gradients = torch.zeros(0)
        """Every unit's fp32 ``grad_shard`` end to end (``attach``): the units' ``grad_shard`` are views into it."""

    def quantize_replicas(self, bits: int, block_size: int) -> None:
        """Quantize the cross-group gradient all-reduce in ``bits`` (blocks of ``block_size``) from now on; a
        collective over the replica group (it builds the group's ``comm.Topology``: ``max(1, d / k)`` of its ranks
        share each node, one per group inside the node)."""
        world = self.world
        per_node = max(1, world.ranks_per_node // self.size)
        self.replica_topology = comm.Topology(self.replica_group, per_node, host=world.host, timeout=world.timeout)
        self.replica_bits, self.replica_block_size = bits, block_size

    @property
    def replicas(self) -> int:
        """Shard groups, ``W / k``."""
        return len(self.groups)

    @torch.no_grad()
    def broadcast_module(self, module: nn.Module) -> None:
        """Give every rank the world's first rank's parameters and buffers (a model built eagerly on every rank)."""
        first = self.world.ranks[0]
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=first, group=self.world.group)

    def attach(self, units: list[Unit]) -> None:
        """Make every unit's (zero) ``grad_shard`` a view into one fp32 buffer, ``gradients``, in unit order, so
        that ``sync_gradients`` reduces them in place (no temporary copy). Before the first backward."""
        self.gradients = _flat_views(units, 1, "grad_shard")

    def sync_gradients(self, units: list[Unit]) -> None:
        """Average every unit's fp32 gradient shard over the replica group: one all-reduce, in place, of
        ``gradients`` (the shards laid end to end, ``attach``; ``comm.all_reduce``, ``ReduceOp.AVG``; quantized after
        ``quantize_replicas``)."""
        if not self.gradients.numel() or self.replicas == 1:
            return
        if self.replica_topology is None:
            comm.all_reduce(self.gradients, group=self.replica_group, topology=self.world, op=comm.ReduceOp.AVG)
        else:
            comm.all_reduce(self.gradients, topology=self.replica_topology, op=comm.ReduceOp.AVG,
                            bits=self.replica_bits, block_size=self.replica_block_size)

    def save(self, write: Callable[[], T]) -> T:
        """Run ``write`` (a checkpoint save, a collective of the shard group) on the first group only; its result
        (or its error, raised on every rank) is broadcast over each replica group to the other groups."""
        outcome: list[tuple[BaseException | None, T | None]] = [(None, None)]
        if self.index == 0:
            try:
                outcome[0] = (None, write())
            except BaseException as e:
                outcome[0] = (e, None)
        dist.broadcast_object_list(outcome, src=self.replica_ranks[0], group=self.replica_group)
        error, result = outcome[0]
        if error is not None:
            raise error
        return result  # type: ignore[return-value]


class SplitGroups(MicsGroups):
    """The groups of ``(1, g, o)``, ``1 < g < o`` (module docstring): the ``o``-rank shard groups and their replica
    groups (``MicsGroups`` over ``o``; one group and no replicas when ``o`` is the world), and inside each shard
    group its ``o / g`` node-aligned ``g`` groups (``shard_group_ranks``). Creating it is a collective over
    ``topology``'s group.

    Attributes:
        gradient_topology: this rank's ``g`` group (the micro-batches' reduce-scatter).
        peer_topology: the ``o / g`` ranks of this rank's shard group at its position in their ``g`` group, by
            ascending rank (the boundary's reduce-scatter).
        gradient_split: what the engine's ``Collectives`` reduce over (``GradientSplit``).
        accumulator: every unit's ``grad_accumulator`` (``attach``), ``(o / g, N)`` fp32 with ``N`` the units'
            shard elements in all: row ``q`` is peer ``q``'s row of every unit, end to end.
    """

    def __init__(self, topology: comm.Topology, gradients: int, optimizer: int) -> None:
        super().__init__(topology, optimizer)
        mine = self.groups[self.index]
        parts = [part for part in shard_group_ranks(topology, gradients) if set(part) <= set(mine)]
        part = next(part for part in parts if topology.global_rank in part)
        j = part.index(topology.global_rank)
        d = topology.ranks_per_node
        self.gradient_topology = comm.Topology(topology.subgroup(part), ranks_per_node=min(gradients, d),
                                               host=topology.host, timeout=topology.timeout)
        self.peer_topology = comm.Topology(topology.subgroup(sorted(p[j] for p in parts)),
                                           ranks_per_node=max(1, min(optimizer, d) // gradients),
                                           host=topology.host, timeout=topology.timeout)
        order = [mine.index(r) for i in range(gradients) for r in sorted(p[i] for p in parts)]
        self.gradient_split = GradientSplit(self.gradient_topology, torch.tensor(order, dtype=torch.int64))
        self.accumulator = torch.zeros(0)

    def attach(self, units: list[Unit]) -> None:
        """``MicsGroups.attach``, and every unit's ``grad_accumulator`` made a ``(o / g, S)`` view into one zero
        fp32 buffer, ``accumulator``."""
        super().attach(units)
        self.accumulator = _flat_views(units, self.gradient_split.rows, "grad_accumulator")  # type: ignore[union-attr]

    def sync_gradients(self, units: list[Unit]) -> None:
        """At the boundary: reduce-scatter ``accumulator`` over the peers (exact fp32, ``ReduceOp.AVG``: each rank
        gets its own row, the shard group's mean of its ``1 / o`` sub-shard of every unit) into ``gradients`` (the
        ``grad_shard`` views), zero ``accumulator``, then average ``gradients`` over the replica groups
        (``MicsGroups.sync_gradients``; none when ``o`` is the world)."""
        if self.accumulator.numel():
            comm.reduce_scatter(self.accumulator, op=comm.ReduceOp.AVG, topology=self.peer_topology,
                                out=self.gradients)
            self.accumulator.zero_()
        super().sync_gradients(units)


def partition_groups(topology: comm.Topology, point: tuple[int, int, int]) -> MicsGroups | None:
    """The groups the engine runs the partition ``point`` ``(p, g, o)`` over ``topology`` with: ``SplitGroups`` for
    ``1 < g < o``, ``MicsGroups`` over ``o`` for the other grouped points (``o`` below the world), None for the
    stages' own points and ``(p, W, W)`` (the resident points' parameter copy is the engine's hpZ partition, not a
    group here). A collective over ``topology``'s group."""
    _, g, o = point
    if 1 < g < o:
        return SplitGroups(topology, g, o)
    return MicsGroups(topology, o) if o < topology.world_size else None


def _flat_views(units: list[Unit], rows: int, attribute: str) -> torch.Tensor:
    """One zero fp32 buffer of ``rows`` rows of every unit's ``shard_numel`` elements end to end, on the units'
    gradient device; each unit's ``attribute`` set to its columns (a 1-D view for one row, else ``(rows, S)``)."""
    numel = sum(unit.shard_numel for unit in units)
    device = units[0].grad_shard.device if units else torch.device("cpu")
    flat = torch.zeros(rows * numel, dtype=torch.float32, device=device)
    view = flat.view(rows, numel)
    at = 0
    for unit in units:
        part = view[:, at : at + unit.shard_numel]
        setattr(unit, attribute, part[0] if rows == 1 else part)
        at += unit.shard_numel
    return flat
