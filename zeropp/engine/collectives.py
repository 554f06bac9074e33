"""The engine's one door to communication: every byte the engine moves goes through ``Collectives``.

The weight all-gather and the gradient reduce-scatter call ``zeropp.comm`` with the configured ``bits``
(``None``: exact; 8/4: qwZ/qgZ) and block size, so switching ZeRO++ on is a matter of the values held here. The
engine never calls a quantization kernel itself (engine -> comm -> quant). The small collectives that ``zeropp.comm``
does not provide (the broadcasts of the weights — initial, and ``gathered_parameters``' write-back — and the
all-reduce of the squared gradient norm) are plain ``torch.distributed`` calls on the topology's data-parallel
group; ``wait_all_arrived`` is ``comm.Arrival``'s check on a gloo side group of its own
(``zeropp.engine.entry_check``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import comm
from ..quant import DEFAULT_BLOCK_SIZE, BlockFormat


@dataclass(frozen=True, eq=False)
class GradientSplit:
    """Gradients sharded finer than the optimizer states, ``(1, g, o)`` with ``g < o`` (``zeropp.engine.partition``):
    the units are laid out over the ``o`` ranks of the ``Collectives``' topology (row ``r`` of a unit's flat buffer
    viewed as ``(o, S)``: the ``o``-group rank ``r``'s shard), but each micro-batch's gradients are reduce-scattered
    over this rank's ``g`` group only, each rank receiving ``o / g`` rows.

    Attributes:
        topology: this rank's ``g`` group (its rank ``j``: the ``j``-th chunk of the send order).
        order: ``o`` row indices, int64: the send order of the rows, ``g`` chunks of ``o / g`` rows; chunk ``j``
            holds the rows of the ranks at position ``j`` of every ``g`` group of the ``o`` group, in the order of
            their own group (the peers that reduce-scatter the chunk again at the boundary), so that peer ``q``
            ends with its own row.
    """

    topology: comm.Topology
    order: torch.Tensor

    @property
    def rows(self) -> int:
        """Rows each rank receives per reduce-scatter, ``o / g``."""
        return self.order.numel() // self.topology.world_size


class Collectives:
    """Collectives over ``topology``'s data-parallel group with the engine's ZeRO++ settings: one format (the bits
    below); ``for_format`` gives the same collectives in another (``zeropp.rules``).

    Args:
        topology: the data-parallel group and its node layout.
        weight_bits: ``None`` (exact) or 8/4 for the qwZ weight all-gather.
        gradient_bits: ``None`` (exact) or 8/4/2 for the qgZ gradient reduce-scatter (its inter-node hop).
        gradient_bits_intra: ``None`` (both hops in ``gradient_bits``) or 8/4/2: the bits of qgZ's intra-node hop
            (``comm.reduce_scatter``'s ``intra_bits``; needs ``gradient_bits``).
        block_size: elements per quantization block.
        hpz: hpZ partition size (1: off), a divisor of ``topology.ranks_per_node``; its group is created here.
        error_feedback: whether units keep a qgZ ``ErrorFeedback`` (needs ``gradient_bits``): ``True`` with float32
            residuals, ``"loco"`` with LoCo's 8-bit moving-average ones (``error_feedback_beta``).
        error_feedback_beta: LoCo's moving-average coefficient (``comm.ErrorFeedback``'s ``beta``).
        gradient_rotation: ``None``, or the block size of qgZ's Hadamard rotation (``comm.reduce_scatter``'s
            ``rotation``; needs ``gradient_bits``).
        stochastic_rounding: qgZ rounds stochastically, each reduction with its own seed (``rounding_seed``;
            needs ``gradient_bits``).
        delta_bits: ``None``, or 8/4 for the weight deltas of ``zeropp.engine.weight_deltas`` (``exchange``).
        communication_dtype: the dtype of the exact gradient reduce-scatter (``communication_data_type``):
            float32 sums in fp32 on the wire (``comm.reduce_scatter``'s plain exact path); bfloat16/float16 send
            each rank's gradient in that dtype and sum it at the receiver in float64 (its ``wire_dtype`` path).
            qgZ ignores it (it quantizes from fp32).
        onebit: OneBitAdam's compressed momentum is exchanged (``reduce_scatter_onebit``), in blocks of
            ``block_size``.
        arrival_timeout: how long ``wait_all_arrived`` waits on the group's first rank (``comm.Arrival.of``: its
            side group is made with the first engine over ``topology``, a collective over the data-parallel group,
            when it has more than one rank).
        gradient_split: ``(1, g, o)``: the gradient reduce-scatter runs over a ``g`` group of ``topology``'s ``o``
            ranks (``GradientSplit``; exact only); ``None`` (default): over ``topology``.
    """

    def __init__(
        self,
        topology: comm.Topology,
        *,
        weight_bits: int | None = None,
        gradient_bits: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hpz: int = 1,
        error_feedback: bool | str = False,
        error_feedback_beta: float = 0.0,
        gradient_rotation: int | None = None,
        gradient_bits_intra: int | None = None,
        stochastic_rounding: bool = False,
        delta_bits: int | None = None,
        communication_dtype: torch.dtype = torch.float32,
        onebit: bool = False,
        arrival_timeout: timedelta,
        gradient_split: GradientSplit | None = None,
    ) -> None:
        if error_feedback and gradient_bits is None:
            raise ValueError("error_feedback needs quantized gradients (gradient_bits 8 or 4)")
        if gradient_rotation is not None and gradient_bits is None:
            raise ValueError(f"gradient_rotation={gradient_rotation} needs quantized gradients (gradient_bits 8 or 4)")
        if gradient_bits_intra is not None and gradient_bits is None:
            raise ValueError(f"gradient_bits_intra={gradient_bits_intra} needs quantized gradients (gradient_bits)")
        if stochastic_rounding and gradient_bits is None:
            raise ValueError("stochastic_rounding needs quantized gradients (gradient_bits 8, 4 or 2)")
        if gradient_split is not None and gradient_bits is not None:
            raise ValueError("gradient_split reduce-scatters exactly; qgZ (gradient_bits) is not built for it")
        self.gradient_split = gradient_split
        self.topology = topology
        self.weight_bits = weight_bits
        self.gradient_bits = gradient_bits
        self.block_size = block_size
        self.hpz = hpz
        self.error_feedback = error_feedback
        self.error_feedback_beta = error_feedback_beta
        self.gradient_rotation = gradient_rotation
        self.gradient_bits_intra = gradient_bits_intra
        self.stochastic_rounding = stochastic_rounding
        self.delta_bits = delta_bits
        self.communication_dtype = communication_dtype
        self.onebit = onebit
        self.partition_rank = 0
        self.partition_group = None
        if hpz > 1:
            ranks = topology.partition_ranks(hpz)  # raises unless hpz divides ranks_per_node or is whole nodes
            self.partition_rank = ranks.index(topology.global_rank)  # the group's order: ascending global rank
            self.partition_group = topology.partition_group(hpz)
        self.arrival = comm.Arrival.of(topology) if topology.world_size > 1 else None
        self.arrival_timeout = arrival_timeout
        # one Collectives per format, shared by every for_format copy
        self._formats: dict[tuple[int | None, int | None], Collectives] = {(weight_bits, gradient_bits): self}

    def for_format(self, weight_bits: int | None, gradient_bits: int | None) -> Collectives:
        """These collectives with other bits (``zero_optimization.zeropp.rules``: the units of one format): the same
        groups, block size and dtypes; ``error_feedback``, ``gradient_rotation``, ``gradient_bits_intra`` and
        ``stochastic_rounding`` where
        they are on and ``gradient_bits`` quantizes. One object
        per format (``self`` for this one's), so units of one format can share a bucket."""
        other = self._formats.get((weight_bits, gradient_bits))
        if other is None and gradient_bits is not None and self.gradient_split is not None:
            raise ValueError(f"gradient_bits={gradient_bits} (zeropp.rules) with a gradient_split: the split "
                             "reduce-scatters exactly; qgZ is not built for it")
        if other is None:
            other = copy.copy(self)
            other.weight_bits, other.gradient_bits = weight_bits, gradient_bits
            other.error_feedback = self.error_feedback if gradient_bits is not None else False
            other.gradient_rotation = self.gradient_rotation if gradient_bits is not None else None
            other.gradient_bits_intra = self.gradient_bits_intra if gradient_bits is not None else None
            other.stochastic_rounding = self.stochastic_rounding and gradient_bits is not None
            self._formats[(weight_bits, gradient_bits)] = other
        return other

    def new_error_feedback(self) -> comm.ErrorFeedback | None:
        """A unit's qgZ residuals (``None`` when ``error_feedback`` is off): float32, or LoCo's 8-bit store."""
        if not self.error_feedback:
            return None
        if self.error_feedback == "loco":
            return comm.ErrorFeedback("loco", self.error_feedback_beta)
        return comm.ErrorFeedback()

    @property
    def hop1_bits(self) -> int | None:
        """Bits of qgZ's intra-node hop: ``gradient_bits_intra`` when set, else ``gradient_bits`` (``None``: exact)."""
        return self.gradient_bits_intra if self.gradient_bits_intra is not None else self.gradient_bits

    @property
    def alignment(self) -> int:
        """Elements each unit's parameter offsets and shard size are multiples of: the block size when anything
        is quantized, weight deltas and 1-bit compression included (blocks then never straddle two parameters), else
        1 (see ``zeropp.engine.unit``)."""
        quantized = (self.weight_bits, self.gradient_bits, self.delta_bits)
        return self.block_size if self.onebit or any(bits is not None for bits in quantized) else 1

    @property
    def gradient_dtype(self) -> torch.dtype:
        """dtype of the flat gradient buffer a unit hands to ``reduce_scatter_grads``: float32 under qgZ, else
        ``communication_dtype``."""
        return torch.float32 if self.gradient_bits is not None else self.communication_dtype

    @property
    def gradient_rows(self) -> int:
        """Rows of a unit's ``(P, S)`` flat gradient each rank receives per reduce-scatter: 1, or ``o / g`` with a
        ``gradient_split``."""
        return 1 if self.gradient_split is None else self.gradient_split.rows

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def rank(self) -> int:
        """This rank's position in the data-parallel group: the shard it owns."""
        return self.topology.rank

    def gather_params(self, shard: torch.Tensor, out: torch.Tensor) -> comm.CollectiveWork:
        """Start the all-gather of every rank's parameter ``shard`` into the flat ``out`` (``world_size *
        shard.numel()``); ``out`` holds the values once the returned handle's ``wait()`` returns."""
        return comm.all_gather(
            shard, bits=self.weight_bits, topology=self.topology, out=out, block_size=self.block_size, async_op=True
        )

    def gather_secondary(self, secondary: torch.Tensor, out: torch.Tensor) -> comm.CollectiveWork:
        """hpZ: start the all-gather of the partition's secondary shards into ``out`` (``hpz * secondary.numel()``),
        exact and inside the node: the secondaries already hold the (dequantized) values of the data-parallel
        gather."""
        return comm.all_gather(
            secondary, bits=None, group=self.partition_group, topology=self.topology, out=out, async_op=True
        )

    def pack_secondary(self, secondary: torch.Tensor) -> torch.Tensor | None:
        """Weight deltas: the qwZ pack (``weight_bits``, this block size) of a resident hpZ ``secondary``, which
        ``gather_secondary_packed`` sends instead of the values; ``None`` without qwZ (the gathers stay exact)."""
        if self.weight_bits is None:
            return None
        return comm.pack_shard(secondary, self.weight_bits, block_size=self.block_size)

    def gather_secondary_packed(self, pack: torch.Tensor, numel: int, out: torch.Tensor) -> comm.CollectiveWork:
        """Weight deltas under qwZ: start the all-gather of the partition's secondary packs (``pack_secondary`` of
        ``numel`` elements each) inside the node, dequantized into ``out`` (``hpz * numel``, this rank's part
        too): the values qwZ's data-parallel gather gives for the same weights (the secondary's blocks are its
        shards' blocks: every shard is a whole number of blocks)."""
        work = comm.all_gather_packed(pack, numel, self.weight_bits, group=self.partition_group,
                                      topology=self.topology, out=out, async_op=True, block_size=self.block_size)
        assert isinstance(work, comm.CollectiveWork)
        return work

    def gather_exact(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """All-gather every rank's ``shard`` into ``out`` exactly (never quantized), e.g. the fp32 master shards for a
        consolidated state dict."""
        comm.all_gather(shard, bits=None, topology=self.topology, out=out)

    def pack_delta(self, target: torch.Tensor, reference: torch.Tensor, bits: int | None = None) -> torch.Tensor:
        """The ``bits`` (default ``delta_bits``) pack of ``target - reference`` (``comm.pack_delta``, this engine's
        block size)."""
        return comm.pack_delta(target, reference, self._delta_format(bits))

    def add_delta(self, pack: torch.Tensor, into: torch.Tensor, bits: int | None = None) -> None:
        """Add the dequantized ``pack`` (of ``bits``, default ``delta_bits``) into ``into`` in place
        (``comm.add_delta``)."""
        comm.add_delta(pack, into, self._delta_format(bits))

    def delta_pack_bytes(self, numel: int) -> int:
        """Bytes of the delta pack of ``numel`` elements: codes then one float32 scale per block."""
        return self._delta_format().packed_bytes(numel)

    def _delta_format(self, bits: int | None = None) -> BlockFormat:
        if self.delta_bits is None:
            raise ValueError("weight deltas are off (delta_bits is None)")
        return BlockFormat(self.delta_bits if bits is None else bits, self.block_size)

    def exchange_parts(self, parts: list[torch.Tensor], send_to: list[int],
                       receive_from: list[int]) -> list[comm.CollectiveWork]:
        """``exchange`` of the uint8 ``parts`` laid end to end, one handle per part, all in flight
        (``comm.exchange_parts``; every rank calls it with the same part sizes)."""
        return comm.exchange_parts(parts, send_to=send_to, receive_from=receive_from, topology=self.topology)

    def rounding_seed(self, micro_step: int, unit_name: str) -> int | None:
        """The seed of qgZ's stochastic rounding for the reduction of unit ``unit_name`` (the first unit of a
        bucket) in micro-step ``micro_step`` (``ZeroEngine.micro_steps``): the first 4 bytes, little-endian, of
        SHA-256 of ``f"qgz/{micro_step}/{unit_name}"``, so every reduction rounds with its own noise and a run (or a
        resumed one) repeats its bytes; ``comm.reduce_scatter`` derives each hop's and rank's seed from it.
        ``None`` (round to nearest) unless ``stochastic_rounding``."""
        if not self.stochastic_rounding:
            return None
        return comm.derive_seed("qgz", micro_step, unit_name)

    def reduce_scatter_grads(
        self, full: torch.Tensor, out: torch.Tensor, error_feedback: comm.ErrorFeedback | None = None,
        seed: int | None = None,
    ) -> comm.CollectiveWork:
        """Start averaging the flat gradient ``full`` (of ``gradient_dtype``) over the ranks, this rank's slice
        (``comm.shard_range``) into the fp32 ``out`` (qgZ when ``gradient_bits`` is set, rotated when
        ``gradient_rotation`` is, with ``error_feedback``'s residuals when given, rounded stochastically from
        ``seed`` (``rounding_seed``) when given; exact in ``communication_dtype`` otherwise). Handles must be
        waited on in the order they were started, the same on every rank (qgZ's second hop runs inside
        ``wait()``). With a ``gradient_split``: ``full``'s ``P`` rows are copied into its send order (one copy of
        ``full``) and averaged over its ``g`` group, ``out`` receiving ``gradient_rows`` rows (chunk ``j`` of the
        order for the group's rank ``j``)."""
        wire = None if self.gradient_bits is not None or full.dtype == torch.float32 else full.dtype
        topology, split = self.topology, self.gradient_split
        if split is not None:
            full = torch.index_select(full.view(self.world_size, -1), 0, split.order.to(full.device)).view(-1)
            topology = split.topology
        return comm.reduce_scatter(
            full, bits=self.gradient_bits, op=comm.ReduceOp.AVG, topology=topology, out=out,
            block_size=self.block_size, error_feedback=error_feedback, wire_dtype=wire, async_op=True,
            rotation=self.gradient_rotation, intra_bits=self.gradient_bits_intra, seed=seed,
        )

    def reduce_scatter_onebit(self, x: torch.Tensor, out: torch.Tensor, error: torch.Tensor) -> None:
        """OneBitAdam: average the 1-bit compression of every rank's flat ``x`` (fp32, ``P * S``), this rank's
        slice into ``out`` (``S``), this rank's compression error into ``error`` (``comm.onebit_reduce_scatter``,
        blocks of ``block_size``)."""
        comm.onebit_reduce_scatter(x, out, error, block_size=self.block_size, topology=self.topology)

    def count_local_reduce_scatter(self) -> None:
        """One rank: a gradient reduce-scatter done locally (the gradient is its own mean) is counted in
        ``comm.stats()`` as the collective would be, moving no bytes."""
        comm.accounting.record("reduce_scatter", comm.accounting.Traffic())

    def wait_all_arrived(self) -> None:
        """Return once every rank of the data-parallel group has called this (none at one rank); raises
        ``comm.ArrivalError`` when they do not within ``arrival_timeout`` (``comm.Arrival.wait_all``)."""
        if self.arrival is not None:
            self.arrival.wait_all(self.arrival_timeout)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.topology.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` with global rank ``src``'s values (a member of the data-parallel group), in place."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.topology.group)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` with the first rank's values, in place."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.topology.ranks[0], group=self.topology.group)
        return tensor
