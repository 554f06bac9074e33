"""``zero_optimization.zeropp.weight_deltas``: stage 3 with hpZ sends each step's weight *change*, quantized, instead
of gathering the weights again (SDP4Bit's quantized weight differences, on ZeRO-3's secondary partition).

Without it, hpZ drops every unit's secondary partition after each optimizer step, and the first forward gather of
the next step all-gathers the new weights over the data-parallel group (across nodes, qwZ-quantized when on) to make
it again. With it, the secondary partition stays resident (``Unit.resident_secondary``) and, after each applied
step, every shard owner sends ``Q(w - r)`` to the ranks whose secondary holds its shard, where ``w`` is its new
compute shard (the values exact ZeRO-3 computes with: the fp32 master rounded to the compute dtype), ``r`` the
reconstruction of that shard every holder keeps in its secondary, and ``Q`` the ``delta_bits`` block format
(``zeropp.quant.format``, ``block_size`` elements per float32 scale). Every holder then sets ``r <- r + D(Q(w - r))``
(the sum in float32, rounded once to the compute dtype: ``zeropp.comm.add_delta``). The owner keeps its own copy of
``r`` (``reconstruction``) and updates it with the same pack, so the next delta is taken against exactly what the
holders hold: the quantization error of one step is part of the next step's delta, never accumulated (an owner
that is its own holder copies the new reconstruction into its slice: the same bits, one sum fewer). After the
update ``|w - r| <= scale / 2`` per block (round to nearest; ``scale = absmax(w - r_old) / qmax``, ``qmax`` 7 for int4,
127 for int8), plus the rounding of ``r`` to the compute dtype. The forward and backward gathers of every unit then
run from the secondaries inside the hpZ partition (a node-local group): no weight bytes cross nodes in them.

What the forward sees. Without qwZ (``zero_quantized_weights`` off, or a ``rules`` format with ``weight_bits``
null) the gathers send the secondaries exactly: every rank computes with ``r``. With qwZ each holder quantizes its
secondary once after each change (delta, refresh: ``Unit.pack_secondary``) in qwZ's format (``weight_bits``,
``block_size``), and the gathers until the next change send that pack (``Collectives.gather_secondary_packed``);
every rank, the holder too, computes with ``D(Q(r))`` per block, ``Q`` qwZ's round-to-nearest block quantization:
exactly what ZeRO++'s qwZ gather gives for weights ``r`` (a secondary is ``G`` whole shards and every shard a whole
number of blocks, so the blocks are the shards' blocks). So under qwZ the forward's weights differ from the
compute weights ``w`` by the delta error above plus qwZ's own error on ``r``, where ZeRO++'s qwZ alone has the
latter (on ``w``). The sender's deltas stay taken against ``r``, not ``D(Q(r))``: qwZ's rounding is redone from
``r`` at each step and never accumulates.

Which ranks. With ``P`` data-parallel ranks, shard size ``S`` and hpZ partition size ``h``, the secondary of a rank at
position ``i`` of its partition holds elements ``[i L, (i + 1) L)`` of the unit's flat buffer, ``L = P S / h``: the
shards of the ``G = P / h`` ranks ``i G .. (i + 1) G - 1``. So the owner of shard ``o`` sends to the ``G`` ranks at
position ``o // G`` of their partitions (one per partition; itself possibly among them), ``(P - d) / h`` of them on
other nodes (``d`` ranks per node). One ``zeropp.comm.exchange_parts`` per step moves every unit's pack, one part
(one all-to-all) per unit.

Scheduling. ``after_step`` starts the step's exchange and returns with it in flight, its parts issued in the order
the next forward gathers the units (the engine's persistent units, which ``_begin_forward`` gathers first, then the
latest forward's order, ``Prefetcher.last_order``; units it did not use after them, in this tier's order: the same
on every rank, as the gathers already require). A unit's part *lands* (waited for, added into the owner's
reconstruction and the secondary's slices, the secondary re-packed under qwZ) when its secondary is first read or
replaced (``Unit.secondary``: the forward's gather, prefetched or on demand, any later gather, a write-back) or its
reconstruction is (``reconstruction``). So the later units' parts cross the link while the forward computes with
the earlier ones. The prefetcher starts at most one unit whose part is in flight per look-ahead
(``Unit.secondary_in_flight``; ``zeropp.engine.prefetch``): its gather lands the part first, waiting for it, so the
first forward after a step gathers one unit ahead while the parts of the later ones still cross the link. That state
is the same on every rank at the same point (the parts land at the same reads), so every rank starts the same
gathers in the same order, as the gathers' collectives require (whether a part has *arrived* would differ between
ranks and is never looked at). ``settle`` lands every
part: at the start of the next ``after_step`` and of ``refresh``, and in the engine before a checkpoint save or
load, a state dict, ``load_state_dict``, ``gathered_parameters`` and ``destroy``; nothing reads a half-updated
secondary. Each part's sums are those of landing it at once (the same tensors, in the same order), so training is
bit for bit the synchronous exchange's. A skipped step starts nothing; refreshes wait for their own exchange.
While in flight the tier holds each unit's pack (its send copies in the backend) until the unit lands, as the
synchronous exchange held them for its duration.

Memory per rank (compute dtype of ``b`` bytes per element), for every stage-3 unit with trainable parameters:
``(G + 1) S b`` bytes, permanently: the secondary (``G S`` elements; hpZ alone holds it from the first gather of a
step to the optimizer step) and the owner's reconstruction (``S``); with qwZ also the secondary's pack, ``G S B``
(``B = weight_bits / 8 + 4 / block_size``). The step adds transient pack buffers of about ``(G + 1) S (delta_bits
/ 8 + 4 / block_size)`` bytes; on CUDA tensors also one float32 temporary of ``S`` elements (the difference
``w - r``, which the native CPU kernels quantize without one: ``zeropp.quant.quantize_delta``).

Bytes per step, per rank (``comm.stats()["exchange"]``), with ``D = sum_units S (delta_bits / 8 + 4 / block_size)``
(one rank's packs of every unit): sent across nodes ``(P - d) / h * D`` by every rank; inside the node ``D`` to
each holder on the owner's node but itself (``d / h`` holders there, this rank one of them when its partition
position is ``rank // G``). Each rank receives ``D`` from each owner of its secondary but itself, across nodes for
the owners on other nodes: per rank that differs from what it sends, on average over the ranks it is the same.
hpZ alone instead all-gathers
every unit once per step over the data-parallel group: ``(P - d) S B`` across nodes, ``B`` = ``weight_bits / 8 + 4 /
block_size`` with qwZ, else ``b``. The ratio is ``(delta_bits / 8 + 4 / block_size) / (h B)``: with ``h = d = 8``,
int4 deltas and int8 qwZ, 0.064. Each gather of a unit from the secondaries (``comm.stats()["all_gather"]``, every
forward and backward gather: all of them inside the node) sends ``(h - 1) G S B`` bytes, the same ``B`` (qwZ's
pack, or ``b`` without qwZ). hpZ alone sends ``(P - 1) S B`` in a step's first gather of a unit, over the
data-parallel group (``(d - 1) S B`` of it inside the node), and ``(h - 1) G S b`` exactly in each later one.

Refresh. An exact refresh makes every secondary and reconstruction the compute shards' exact values again (one exact
all-gather of the compute shards per unit over the data-parallel group; ``(P - d) S b`` bytes across nodes, counted
as ``"all_gather"``): at construction, after ``load_checkpoint``/``load_state_dict`` (``ZeroEngine``), every
``delta_refresh_interval`` applied steps (0: never; the error does not grow, so no refresh is needed for accuracy),
and on ``ZeroEngine.refresh_weight_deltas()``. With ``delta_refresh_bits: 8`` a refresh is quantized instead
(SDP4Bit's int8 start): every reconstruction and secondary starts from zero and the owner sends the int8 pack of its
whole compute shard, the delta against zero, to the holders, by the same ``exchange`` as a step's deltas: ``(P - d)
/ h * sum S (1 + 4 / block_size)`` bytes across nodes, counted as ``"exchange"`` (against ``(P - d) S b`` for the
exact all-gather: ``h b / (1 + 4 / block_size)`` times less, 7.8x at ``h = 2`` in fp32). After it ``|w - r| <= scale
/ 2`` per block with ``scale = absmax(w) / 127`` (plus the rounding of ``r``), and the next steps' deltas carry that
error away with the weights' change. A unit whose secondary was dropped or replaced outside this tier (a
``gathered_parameters(modifier_rank=...)`` write-back, after which the next gather rebuilt it the hpZ way) is
refreshed (as above) at the next step instead of being sent a delta. A skipped step (non-finite gradients) sends
nothing: the weights did not change. The reconstruction is not saved in checkpoints: a load refreshes, so a resumed
run equals an uninterrupted run that refreshes at the step of the save.

Exact mode: the resident point ``(p, W, W)`` (``zeropp.partition``; ``zeropp.config.partition.resident_size``), and
the grouped resident points ``(p, g, o)``, where all of this runs inside the ``o``-rank shard group (the engine's
``Collectives``' topology, ``P = o``; ``zeropp.engine.partition``).
Without weight deltas (``delta_bits`` None) the same tier keeps the secondaries over ``h = p`` ranks (of a node, or
``p / d`` whole nodes: ``Topology.partition_of``) as the parameters' permanent partition and, after each applied step, each owner sends its *exact* stepped compute
shard (``S b`` bytes, the compute dtype) to the same holders by the same ``exchange``; each holder copies it into
its secondary. No reconstruction is kept (the secondary holds the compute shards' values exactly), no periodic
refresh is needed, and a refresh (construction, loads, ``refresh()``) is that same exchange. Every forward and
backward gather then runs inside the ``h``-rank partition on the exact compute weights (or, under qwZ, on qwZ's pack
of them: ``pack_secondary``, as above), so training is exact ZeRO-3's, bit for bit: the same layout (no block
alignment unless qwZ or qgZ ask for it), the same gradient reduce-scatter over the world, the same step. Bytes per
applied step, per rank (``"exchange"``): ``sum_units S b`` to each holder but itself, ``(P - d) / h`` of them
across nodes and ``d / h`` (less one when this rank is its own holder) inside; against hpZ's step-first gather,
``(P - d) S b`` across nodes per unit, ``1 / h`` of it. With ``h`` whole nodes the ``P / h`` holders are one per
partition, the one in this rank's own partition inside its node or not, all others across nodes. (Weight deltas' exact refresh all-gathers whole units
instead, to keep their byte counts; with deltas the resident point is hpZ with weight deltas, not exact.)
"""

from __future__ import annotations

import torch

from ..comm import CollectiveWork, Topology
from .collectives import Collectives
from .unit import Landing, Unit


def delta_plan(topology: Topology, hpz: int) -> tuple[list[int], list[int]]:
    """``(holders, owners)`` for this rank (``topology.rank``): the data-parallel ranks whose hpZ secondary holds
    this rank's shard, and the ranks whose shards this rank's secondary holds (ascending; this rank possibly in
    either). A rank's position in its hpZ partition is its index there (``Topology.partition_of``: its local index
    modulo ``hpz`` inside a node, or for a partition of whole nodes its place among their ranks); the secondary at
    position ``i`` holds shards ``i G .. (i + 1) G - 1``, ``G = world / hpz`` (module docstring)."""
    group = topology.world_size // hpz

    def position(rank: int) -> int:
        g = topology.ranks[rank]
        return topology.partition_of(g, hpz).index(g)

    me = topology.rank
    holders = [j for j in range(topology.world_size) if position(j) == me // group]
    return holders, list(range(position(me) * group, (position(me) + 1) * group))


class WeightDeltas:
    """The weight-delta tier of an engine's stage-3 units (see the module docstring). Construction is a collective
    (the first exact refresh); so are ``after_step`` and ``refresh``, which every rank calls at the same points.

    Args:
        units: the engine's units (those with a sharded trainable buffer take part).
        comm: the engine's collectives, with ``hpz > 1``; ``delta_bits`` set for weight deltas, None for the exact
            mode (the resident point, module docstring).
        refresh_interval: applied steps between refreshes (0: none but the explicit ones).
        refresh_bits: ``None`` for exact refreshes, or 8 for int8 ones (module docstring).

    Attributes:
        exact: the exact mode (no ``delta_bits``): the stepped shards are sent as they are.
        holders: the data-parallel ranks whose secondary holds this rank's shard (this rank possibly among them).
        owners: the data-parallel ranks whose shards this rank's secondary holds.
        steps_since_refresh: applied steps since the last full refresh.
    """

    def __init__(self, units: list[Unit], comm: Collectives, *, refresh_interval: int = 0,
                 refresh_bits: int | None = None) -> None:
        if comm.hpz <= 1:
            raise ValueError(f"weight deltas and the resident point need hpZ's partition (hpz={comm.hpz})")
        self.exact = comm.delta_bits is None
        if self.exact and (refresh_interval or refresh_bits is not None):
            raise ValueError(f"the exact mode (delta_bits None) sends exact shards every step: refresh_interval="
                             f"{refresh_interval} and refresh_bits={refresh_bits} apply to weight deltas only")
        if refresh_interval < 0:
            raise ValueError(f"refresh_interval={refresh_interval} must be 0 (no periodic refresh) or positive")
        self.comm = comm
        self.refresh_interval = refresh_interval
        self.refresh_bits = refresh_bits
        self.units = [u for u in units if u.sharded and u.shard_numel]
        self.holders, self.owners = delta_plan(comm.topology, comm.hpz)
        position = comm.partition_rank
        if self.owners[0] != position * len(self.owners):
            raise RuntimeError(f"rank {comm.rank}: hpZ partition position {position} disagrees with the topology's "
                               f"{self.owners[0] // len(self.owners)}")
        self._first_owner = self.owners[0]
        self._reconstruction: list[torch.Tensor] = []
        self._installed: list[torch.Tensor | None] = [None] * len(self.units)
        for unit in self.units:
            unit.resident_secondary = True
        self.steps_since_refresh = 0
        self.refresh()

    def reconstruction(self, unit: Unit) -> torch.Tensor:
        """The reconstruction of this rank's shard of ``unit`` (compute dtype, ``unit.shard_numel`` elements): what
        the holders' secondaries hold for it (the compute shard itself in the exact mode). Lands the unit's part of
        an exchange in flight first."""
        if self.exact:
            return unit.shard
        unit.land()
        return self._reconstruction[self.units.index(unit)]

    def settle(self) -> None:
        """Land every unit's part of the exchange in flight (module docstring, "Scheduling"); no-op when none is.
        Local: every rank issued the exchange, so waiting for it needs no other call."""
        for unit in self.units:
            unit.land()

    @property
    def resident_bytes(self) -> int:
        """Bytes this tier keeps on this rank between steps: the secondaries, their qwZ packs (under qwZ) and the
        reconstructions."""
        own = self._reconstruction if not self.exact else [u.shard[:0] for u in self.units]
        return sum(u.secondary.nbytes + u.secondary_pack_bytes + r.nbytes
                   for u, r in zip(self.units, own) if u.secondary is not None)

    @torch.no_grad()
    def refresh(self, units: list[Unit] | None = None) -> None:
        """Make the secondaries and reconstructions of ``units`` (default: all) the compute shards' values: exact, one
        exact all-gather per unit over the data-parallel group; with ``refresh_bits``, quantized, one exchange of
        every picked unit's pack against zero. A collective, at a step boundary (units not in use); lands the
        exchange in flight first and waits for its own."""
        self.settle()
        picked = range(len(self.units)) if units is None else [self.units.index(u) for u in units]
        if self.exact:
            self._send_exact(list(picked))
        elif self.refresh_bits is not None:
            self._refresh_quantized(list(picked))
        else:
            self._refresh_exact(picked)
        if units is None:
            self.steps_since_refresh = 0

    def _refresh_exact(self, picked: range | list[int]) -> None:
        """The exact refresh of the units ``picked``: one exact all-gather of each's compute shards."""
        for k in picked:
            unit = self.units[k]
            whole = torch.empty(unit.full.numel(), dtype=unit.full.dtype, device=unit.full.device)
            self.comm.gather_exact(unit.device_shard(), whole)
            unit.release_shard()
            a, b = unit.secondary_range()
            unit.secondary = whole[a:b].clone()
            unit.pack_secondary()
            self._installed[k] = unit.secondary
            own = unit.shard.to(unit.full.device, copy=True)
            if k < len(self._reconstruction):
                self._reconstruction[k] = own
            else:
                self._reconstruction.append(own)

    @torch.no_grad()
    def after_step(self, order: list[Unit] | None = None) -> None:
        """After an applied optimizer step (the compute shards hold the new weights): a refresh when
        ``refresh_interval`` steps have passed since the last, else each unit's delta to its holders (units whose
        secondary was replaced outside this tier are refreshed). A collective. The deltas (and the exact mode's
        shards) are left in flight, one part per unit in ``order`` (the units the next forward uses first; the
        others after it, in this tier's order; the same on every rank), each landed when its unit's secondary is
        first read (module docstring, "Scheduling")."""
        self.settle()
        self.steps_since_refresh += 1
        ranked: dict[int, int] = {}
        for i, u in enumerate(order or []):
            ranked.setdefault(id(u), i)
        first = sorted(range(len(self.units)), key=lambda k: ranked.get(id(self.units[k]), len(ranked)))
        if self.exact:
            self._send_exact(first, wait=False)
            return
        if self.refresh_interval and self.steps_since_refresh >= self.refresh_interval:
            self.refresh()
            return
        stale = [u for u, s in zip(self.units, self._installed) if u.secondary is not s]
        if stale:
            self.refresh(stale)
        self._send([k for k in first if self.units[k] not in stale], wait=False)

    def _refresh_quantized(self, picked: list[int]) -> None:
        """Zero the secondaries and reconstructions of the units ``picked``, then send each its ``refresh_bits``
        pack against zero."""
        for k in picked:
            unit = self.units[k]
            a, b = unit.secondary_range()
            unit.secondary = torch.zeros(b - a, dtype=unit.full.dtype, device=unit.full.device)
            self._installed[k] = unit.secondary
            zeros = torch.zeros(unit.shard_numel, dtype=unit.full.dtype, device=unit.full.device)
            if k < len(self._reconstruction):
                self._reconstruction[k] = zeros
            else:
                self._reconstruction.append(zeros)
        self._send(picked, self.refresh_bits)

    def _send(self, picked: list[int], bits: int | None = None, *, wait: bool = True) -> None:
        """Each unit of ``picked`` sends ``Q(w - r)`` in ``bits`` (default ``delta_bits``) to its holders, which
        add it to their secondaries, and adds it to its own reconstruction: one exchange, a part per unit in the
        order of ``picked``, each landed (``_DeltaLanding``) at once or, without ``wait``, at its unit's first read."""
        if not picked:
            return
        comm, me = self.comm, self.comm.rank
        packs = [comm.pack_delta(self.units[k].device_shard(), self._reconstruction[k], bits) for k in picked]
        for k in picked:
            self.units[k].release_shard()
        works = comm.exchange_parts(packs, [j for j in self.holders if j != me], [o for o in self.owners if o != me])
        for k, pack, work in zip(picked, packs, works):
            self._start_landing(k, _DeltaLanding(self, k, pack, work, bits), wait)

    def _send_exact(self, picked: list[int], *, wait: bool = True) -> None:
        """The exact mode: each unit of ``picked`` sends its compute shard, as it is, to its holders, which copy it
        into their secondaries (one exchange, a part per unit, landed as in ``_send``; a secondary dropped outside
        this tier is made anew)."""
        if not picked:
            return
        comm, me = self.comm, self.comm.rank
        # copies: the optimizer may write the shards before a part lands
        shards = [self.units[k].device_shard().view(torch.uint8).clone() for k in picked]
        for k in picked:
            self.units[k].release_shard()
        works = comm.exchange_parts(shards, [j for j in self.holders if j != me], [o for o in self.owners if o != me])
        for k, own, work in zip(picked, shards, works):
            self._start_landing(k, _ExactLanding(self, k, own, work), wait)

    def _start_landing(self, k: int, landing: Landing, wait: bool) -> None:
        unit = self.units[k]
        assert unit.landing is None, unit.name  # settle() landed the previous exchange
        unit.landing = landing
        if wait:
            unit.land()

    def _rows(self, own: torch.Tensor, received: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(owner, its part)`` for every owner of this rank's secondary, ascending, this rank's own part ``own``."""
        others = iter(received)
        me = self.comm.rank
        return [(o, own if o == me else next(others)) for o in self.owners]


class _DeltaLanding:
    """One unit's delta pack in flight (``WeightDeltas._send``): ``land()`` adds this rank's own pack to its
    reconstruction and every other owner's pack to its slice of the secondary, then re-packs the secondary for qwZ.

    Where this rank's secondary holds its own shard, that slice gets a copy of the new reconstruction instead of a
    second sum: the slice and the reconstruction hold the same bits before every landing (a refresh sets both to the
    compute shards' values or to zero, a landing keeps them equal), and the sum is elementwise (``add_delta``: each
    element from its own code, its block's scale and its old value, wherever the tensor starts: what every other
    holder's slice of this shard already relies on), so the copy is the bits the sum would give."""

    def __init__(self, tier: WeightDeltas, k: int, pack: torch.Tensor, work: CollectiveWork, bits: int | None):
        self.tier, self.k, self.pack, self.work, self.bits = tier, k, pack, work, bits

    def land(self) -> None:
        tier, unit = self.tier, self.tier.units[self.k]
        rows = tier._rows(self.pack, self.work.wait())
        size = unit.shard_numel
        own = tier._reconstruction[self.k]
        tier.comm.add_delta(self.pack, own, self.bits)
        secondary = unit.secondary
        assert secondary is not None
        for o, row in rows:
            start = (o - tier._first_owner) * size
            if o == tier.comm.rank:
                # this rank's own slice: the sum just made in its reconstruction (see the class docstring)
                secondary[start : start + size].copy_(own)
            else:
                tier.comm.add_delta(row, secondary[start : start + size], self.bits)
        unit.pack_secondary()


class _ExactLanding:
    """One unit's exact shard in flight (``WeightDeltas._send_exact``): ``land()`` copies every owner's shard into
    its slice of the secondary (made anew when it was dropped outside the tier), then re-packs it for qwZ."""

    def __init__(self, tier: WeightDeltas, k: int, own: torch.Tensor, work: CollectiveWork):
        self.tier, self.k, self.own, self.work = tier, k, own, work

    def land(self) -> None:
        tier, k = self.tier, self.k
        unit = tier.units[k]
        rows = tier._rows(self.own, self.work.wait())
        size = unit.shard_numel
        a, b = unit.secondary_range()
        if unit.secondary is None or unit.secondary is not tier._installed[k]:
            unit.secondary = torch.empty(b - a, dtype=unit.full.dtype, device=unit.full.device)
        secondary = unit.secondary
        for o, row in rows:
            start = (o - tier._first_owner) * size
            secondary[start : start + size].view(torch.uint8).copy_(row)
        unit.pack_secondary()
        tier._installed[k] = secondary
