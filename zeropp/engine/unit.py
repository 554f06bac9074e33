"""``Unit``: one group of parameters sharded and communicated together, with its fp32 master and gradient shards.

The unit's trainable parameters are laid end to end in one flat buffer, padded to ``P * S`` elements (``P`` ranks);
rank ``r`` owns elements ``[r * S, (r + 1) * S)`` (the slice ``zeropp.comm.reduce_scatter`` gives it) and keeps for
them ``shard`` (compute dtype), ``master`` and ``grad_shard`` (fp32). One flat buffer per unit makes each gather and
each gradient reduction one collective; with qwZ or qgZ every parameter starts on a quantization block, so no block
mixes two parameters. The module's ``nn.Parameter`` objects are kept and point into ``full``, the whole buffer (at
stage 3 only while gathered). Frozen parameters of a stage-3 unit live in a second buffer, ``FrozenFlat``. A unit
has one format, its ``comm``'s bits: ``zeropp.rules`` splits a module's parameters into one unit per format
(``zeropp.engine.rules``), so several units may share a module.

The layout, alignment and its memory cost, hpZ's secondary shard, gather and free, frozen parameters, construction
and the gradient reduction (``reduce_gradients``, ``reduce_bucketed``): the unit layout section of docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from .. import comm as _comm
from .collectives import Collectives

if TYPE_CHECKING:
    from .param_offload import SwappedShard


class Landing(Protocol):
    """A unit's part of a weight-delta exchange in flight (``zeropp.engine.weight_deltas``): ``land()`` waits for
    its bytes and applies them to the unit's secondary."""

    def land(self) -> None: ...


def flat_layout(numels: list[int], align: int, world: int) -> tuple[list[int], int, int]:
    """The layout of tensors of ``numels`` elements in one flat buffer sharded over ``world`` ranks (see the module
    docstring): each tensor's offset (a multiple of ``align``), the end of the last one, and the shard size ``S``
    (a multiple of ``align``; the buffer has ``world * S`` elements)."""
    offsets: list[int] = []
    numel = 0
    for n in numels:
        numel = -(-numel // align) * align  # each parameter starts on the block grid
        offsets.append(numel)
        numel += n
    shard_numel = -(-numel // (world * align)) * align if numel else 0
    return offsets, numel, shard_numel


class Unit:
    """The flat sharded parameter group of one module (see the module docstring).

    Args:
        name: qualified name of the unit's module (``""`` for the root unit).
        params: ``(qualified name, parameter)`` pairs, trainable, one floating dtype and device.
        comm: the engine's collectives.
        sharded: stage 3 (parameters freed between uses) when true; stages 1 and 2 keep them whole.
        reduce_buffers: the pool the flat gradient buffers come from (the engine shares one among its units).
        frozen: stage 3: the unit's frozen ``(qualified name, parameter)`` pairs, sharded in a ``FrozenFlat``
            (floating ones; others stay whole on every rank).
        broadcast: take the first rank's values (a model built eagerly on every rank); ``False``: every rank
            already holds the same values (a materialised model), nothing is sent.
        optimizer_side: makes the fp32 ``master`` and ``grad_shard`` (an element count and ``"master"`` or
            ``"grad_shard"`` -> an uninitialised fp32 tensor) where an offload tier keeps them
            (``OptimizerOffload.empty``); by default they are made on the parameters' device.
        shard_home: stage 3, ``offload_param``: moves a compute-dtype shard (this unit's and its frozen one) to where
            it lives between uses (``ParamOffload.home``); every gather copies it to the device first
            (``device_shard``). By default the shards stay on the parameters' device.

    ``shard_swap`` (set by ``ParamOffload.attach``, NVMe): the ``SwappedShard`` whose region holds ``shard`` between
    uses; ``gather(wait=False)`` then first starts its read, and every use of ``shard`` makes it resident and
    releases it after (``zeropp.engine.param_offload``).

    Attributes:
        pinned: while positive, ``free()`` leaves the unit whole (``ZeroEngine.gathered_parameters``).
        pending_input_grads: stage 3, units with frozen parameters: gradient hooks on the unit module's inputs
            registered by this forward that have not run yet (``hooks``): their backward may still read the frozen
            weights, so the unit is not freed before they ran.
    """

    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        comm: Collectives,
        *,
        sharded: bool,
        reduce_buffers: ReduceBuffers | None = None,
        frozen: list[tuple[str, nn.Parameter]] | None = None,
        broadcast: bool = True,
        optimizer_side: Callable[[int, str], torch.Tensor] | None = None,
        shard_home: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.name = name
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.comm = comm
        self.reduce_buffers = reduce_buffers if reduce_buffers is not None else ReduceBuffers()
        # one rank: the shard is the whole buffer, so it *is* ``full`` (a view): nothing to gather, copy or free
        self.single = comm.world_size == 1
        self.sharded = sharded and not self.single
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"unit {name or '<root>'!r} mixes dtypes {sorted(map(str, dtypes))} or devices "
                f"{sorted(map(str, devices))}; give all trainable parameters one dtype and device"
            )
        frozen_floating = [(n, p) for n, p in frozen or [] if p.dtype.is_floating_point]
        fallback = self.params or [p for _, p in frozen_floating]  # a unit of frozen parameters only
        dtype = self.params[0].dtype if self.params else fallback[0].dtype if fallback else torch.float32
        device = fallback[0].device if fallback else torch.device("cpu")
        if not dtype.is_floating_point:
            raise TypeError(f"unit {name or '<root>'!r}: parameters of dtype {dtype} cannot be trained")
        self.shapes = [p.shape for p in self.params]
        self.align = comm.alignment
        world, rank = comm.world_size, comm.rank
        # numel: the last parameter's end (parameters and the gaps between them)
        self.offsets, self.numel, self.shard_numel = flat_layout([p.numel() for p in self.params], self.align, world)
        self.start = rank * self.shard_numel  # this rank's slice of the padded flat buffer
        padded = world * self.shard_numel

        self.full = torch.zeros(padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                self.full[off : off + p.numel()].copy_(p.detach().reshape(-1))
        if broadcast:
            comm.broadcast_from_first(self.full)  # every rank starts from the first rank's weights
        local = self.full[self.start : self.start + self.shard_numel]
        self.shard = local if self.single else local.clone() if shard_home is None else shard_home(local)
        if optimizer_side is None:
            self.master = local.to(torch.float32, copy=True)
            self.grad_shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        else:  # an offload tier's home (zeropp.engine.offload)
            self.master = optimizer_side(self.shard_numel, "master").copy_(local)
            self.grad_shard = optimizer_side(self.shard_numel, "grad_shard").zero_()
        self.grad_accumulator: torch.Tensor | None = None
        """``(1, g, o)`` (``comm.gradient_split``): the fp32 ``(o / g, S)`` rows of the flat gradient this rank
        accumulates between boundaries, which each micro-batch's reduce-scatter adds into instead of ``grad_shard``
        (a view set by ``zeropp.engine.partition.SplitGroups.attach``; its boundary reduction fills ``grad_shard``);
        ``None`` otherwise."""
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.hpz = comm.hpz if sharded else 1
        self.landing: Landing | None = None
        """Weight deltas: the exchange in flight that updates ``secondary`` (``zeropp.engine.weight_deltas``); every
        read or replacement of ``secondary`` lands it first (``land``)."""
        self._secondary: torch.Tensor | None = None
        self.resident_secondary = False  # kept across steps, updated by zeropp.engine.weight_deltas
        self._secondary_pack: tuple[torch.Tensor, torch.Tensor] | None = None  # (secondary, its qwZ pack)
        self.error_feedback = comm.new_error_feedback() if comm.error_feedback else None
        self.frozen = (FrozenFlat(frozen_floating, comm, hpz=self.hpz, broadcast=broadcast, shard_home=shard_home)
                       if frozen_floating else None)
        self.shard_swap: SwappedShard | None = None
        self._shard_in_gather = False  # the gather in flight reads shard (not the hpZ secondary)
        self.pinned = 0
        self.pending_input_grads = 0
        self.gathered = True
        self.persistent = False  # stage 3: whole all the time (``zeropp.engine.reuse``); set by the engine
        self._gathering: _comm.CollectiveWork | _BucketPart | None = None  # a started gather not yet waited for
        self._bind()
        if sharded:
            self.free()

    def __repr__(self) -> str:
        return (f"Unit({self.name or '<root>'!r}, params={len(self.params)}, numel={self.numel}, "
                f"shard={self.shard_numel}, gathered={self.gathered})")

    # ---- parameters -----------------------------------------------------------------------------------------

    def _bind(self) -> None:
        """Point every parameter at its slice of ``full``."""
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self.full[off : off + shape.numel()].view(shape)

    def device_shard(self) -> torch.Tensor:
        """The compute shard on the parameters' device, for a collective (``_on_device``); a swapped shard is made
        resident first (``release_shard`` gives it back)."""
        if self.shard_swap is not None:
            self.shard_swap.fetch()
        return _on_device(self.shard, self.full)

    def release_shard(self) -> None:
        """NVMe ``offload_param``: the collective that read the shard is done; its storage may go."""
        if self.shard_swap is not None:
            self.shard_swap.release()

    def swapped_flats(self) -> list[Unit | FrozenFlat]:
        """This unit and its frozen buffer where their shard is swapped (``shard_swap``)."""
        flats = (self, self.frozen) if self.frozen is not None else (self,)
        return [f for f in flats if f.shard_swap is not None]

    def _read_ahead(self) -> bool:
        """NVMe ``offload_param``, a prefetch: whether every shard this gather reads was already resident or being
        read; if not, the reads are started (``ParamOffload.read_ahead``) and the gather waits for the next call."""
        slots = [f.shard_swap for f in self.swapped_flats() if f.secondary is None]
        return not slots or slots[0].owner.read_ahead(slots)

    @property
    def secondary(self) -> torch.Tensor | None:
        """hpZ: this rank's ``1/hpz`` of the gathered values (``secondary_range``), or None; an exchange in flight for
        it (``landing``) is landed first, so no reader sees it half updated."""
        if self.landing is not None:
            self.land()
        return self._secondary

    @secondary.setter
    def secondary(self, value: torch.Tensor | None) -> None:
        if self.landing is not None:
            self.land()
        self._secondary = value

    def land(self) -> None:
        """Weight deltas: finish the exchange in flight for ``secondary`` (``landing``), if any: wait for its part
        and apply it (``zeropp.engine.weight_deltas``)."""
        landing, self.landing = self.landing, None
        if landing is not None:
            landing.land()

    @property
    def secondary_in_flight(self) -> bool:
        """Whether an exchange for ``secondary`` is in flight (``landing``): the same on every rank at the same
        point, since the parts land at the same reads everywhere (the prefetcher starts at most one such unit per look
        ahead, landing its part first: ``zeropp.engine.prefetch``)."""
        return self.landing is not None

    def secondary_range(self) -> tuple[int, int]:
        """hpZ: elements ``[start, stop)`` of ``full`` this rank keeps as its secondary shard (its position
        ``i`` in the partition group: ``i * L`` to ``(i + 1) * L``, ``L = P * S / hpz``)."""
        length = self.full.numel() // self.hpz
        i = self.comm.partition_rank
        return i * length, (i + 1) * length

    def pack_secondary(self) -> None:
        """Weight deltas: quantize the resident secondary, as it is now, in qwZ's format (``comm.weight_bits``; no-op
        without qwZ); until the secondary is replaced or this is called again, the gathers send that pack instead of
        the exact values (``Collectives.gather_secondary_packed``). The tier calls it after every change."""
        assert self.secondary is not None
        pack = self.comm.pack_secondary(self.secondary)
        self._secondary_pack = None if pack is None else (self.secondary, pack)

    @property
    def secondary_pack_bytes(self) -> int:
        """Bytes of the secondary's qwZ pack (``pack_secondary``) while it is the one the gathers send, else 0."""
        packed = self._secondary_pack
        return packed[1].nbytes if packed is not None and packed[0] is self.secondary else 0

    def gather(self, *, wait: bool = True) -> None:
        """Stage 3: make the parameters whole. Without a secondary shard: all-gather the shards (qwZ when on) over
        the data-parallel group and, with hpZ, keep the secondary; with one: all-gather the secondaries inside the
        hpZ partition, node-local (exact, or under qwZ the weight-delta tier's pack: ``pack_secondary``).
        ``wait=False`` (prefetch) only starts the all-gather: the values are in once a later ``gather()`` (or
        ``free()``) has waited for it. No communication if already gathered."""
        if not self.gathered:
            if not wait and not self._read_ahead():
                return
            self.full.untyped_storage().resize_(self._full_nbytes)
            self._shard_in_gather = self.secondary is None
            packed = self._secondary_pack
            if packed is not None and packed[0] is self.secondary:
                self._gathering = self.comm.gather_secondary_packed(packed[1], packed[0].numel(), self.full)
            elif self.secondary is not None:
                self._gathering = self.comm.gather_secondary(self.secondary, self.full)
            else:
                self._gathering = self.comm.gather_params(self.device_shard(), self.full)
            if self.frozen is not None:
                self.frozen.start_gather()
            self.gathered = True
        if wait:
            self._finish_gather()

    def _finish_gather(self) -> None:
        if self.frozen is not None:
            self.frozen.finish_gather()
        work, self._gathering = self._gathering, None
        if work is None:
            return
        work.wait()
        if self._shard_in_gather:
            self._shard_in_gather = False
            self.release_shard()
        if self.hpz > 1 and self.secondary is None and not self.persistent:  # the data-parallel gather: keep the
            # secondary (a persistent unit is never gathered again before the next step)
            a, b = self.secondary_range()
            self.secondary = self.full[a:b].clone()
        self._bind()

    @property
    def gather_exact_communicates(self) -> bool:
        """Whether ``gather_exact`` is a collective now (see its no-op cases)."""
        return not (self.pinned or self.single) and (self.sharded or self.comm.weight_bits is not None)

    def gather_exact(self) -> None:
        """Make the parameters whole from an exact all-gather of the compute shards (never quantized; no hpZ
        secondary made or used): the values the shards hold, for reading or modifying them
        (``ZeroEngine.gathered_parameters``; ``end_exact`` ends it). Stage 3: a unit already whole is freed first
        (it may hold qwZ-dequantized values); stages 1 and 2 under qwZ overwrite the dequantized whole parameters.
        No-op while pinned (an enclosing call already did it), at one rank, and in exact stages 1 and 2."""
        if self.pinned or self.single:
            return
        if not self.sharded:
            if self.comm.weight_bits is not None:
                self.comm.gather_exact(self.shard, self.full)
            return
        self._release()  # a persistent unit too: it may hold qwZ-dequantized values
        self.full.untyped_storage().resize_(self._full_nbytes)
        self.comm.gather_exact(self.device_shard(), self.full)
        self.release_shard()
        if self.frozen is not None:
            self.frozen.gather_exact()
        self.gathered = True
        self._bind()

    def end_exact(self) -> None:
        """After ``gather_exact`` (and ``write_back``), once unpinned: stage 3 frees the unit; stages 1 and 2 under
        qwZ gather the dequantized values back into the whole parameters (what they compute with, as after
        ``publish``)."""
        if self.pinned or self.single:
            return
        if self.sharded:
            self._release()  # a persistent unit too: the next forward gathers it as after a step
        elif self.comm.weight_bits is not None:
            self.comm.gather_params(self.shard, self.full).wait()

    def free(self) -> None:
        """Stage 3: release ``full``'s memory (and the frozen buffer's) and leave the parameters empty. No-op in
        stages 1 and 2, for a persistent unit and while the unit is pinned."""
        if not self.persistent and not self.pinned:
            self._release()

    def _release(self) -> None:
        for flat in self.swapped_flats():  # shards read ahead for a gather that did not come
            if flat.shard_swap.reading:
                flat.shard_swap.release()
        if not self.sharded or not self.gathered:
            return
        self._finish_gather()  # a prefetched gather may still be writing into full
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.full.untyped_storage().resize_(0)
        if self.frozen is not None:
            self.frozen.free()
        self.gathered = False

    @torch.no_grad()
    def write_back(self, src: int) -> None:
        """Take the whole parameters of global rank ``src`` (a member of the data-parallel group) as the unit's new
        weights: broadcast ``full`` (and the frozen buffer) from it, copy this rank's slice into ``shard`` and, for
        the elements whose compute-dtype value differs from the master rounded to that dtype, into ``master`` (so
        elements nobody changed keep their exact fp32 master under bf16/fp16); drop the hpZ secondaries. The unit
        must be whole with exact values (``gather_exact``). A collective."""
        self.comm.broadcast(self.full, src)
        new = self.full[self.start : self.start + self.shard_numel]
        here = moved(new, self.master.device)  # an offloaded master: compared and updated where it lives
        changed = here != self.master.to(new.dtype)
        torch.where(changed, here.to(torch.float32), self.master, out=self.master)
        if not self.single:
            _overwrite_shard(self, new)
        self.secondary = None
        self._secondary_pack = None
        if self.frozen is not None:
            self.frozen.write_back(src)

    @torch.no_grad()
    def exact_values(self) -> dict[int, torch.Tensor]:
        """Every parameter of the unit (trainable and frozen), whole, as a new tensor, by ``id`` of the parameter:
        an exact all-gather of the compute shards into a transient flat buffer, a collective. None while pinned (a
        ``gathered_parameters`` block holds the exact values, ``gather_exact``: they are copied, with whatever the
        block changed in place), at one rank, or in exact stages 1 and 2 (where the whole parameters are the shards'
        values; under qwZ they hold the dequantized values there, so the shards are gathered)."""
        out: dict[int, torch.Tensor] = {}
        for flat in (self, self.frozen) if self.frozen is not None else (self,):
            if self.pinned or flat.single or (not flat.sharded and flat.comm.weight_bits is None):
                whole = flat.full
            else:
                whole = flat.full.new_empty(flat.comm.world_size * flat.shard_numel)
                flat.comm.gather_exact(flat.device_shard(), whole)
                flat.release_shard()
            for p, off, shape in zip(flat.params, flat.offsets, flat.shapes):
                out[id(p)] = whole[off : off + shape.numel()].view(shape).clone()
        return out

    def publish(self) -> None:
        """After an optimizer step: ``publish_shard`` then ``publish_gather``."""
        self.publish_shard()
        self.publish_gather()

    def publish_shard(self, copied: bool = False) -> None:
        """Copy the master shard (stepped) into the compute-dtype ``shard`` (unless ``copied``: the optimizer's step
        already wrote it); stage 3: release the whole parameters and drop the hpZ secondary (they hold the old
        weights; a ``resident_secondary`` is kept: the weight-delta tier updates it). No communication."""
        if self.sharded:
            self._release()
        if not self.resident_secondary:
            self.secondary = None
        if self.shard_swap is not None:  # NVMe offload_param: fresh storage, written behind
            _overwrite_shard(self, self.master)
        elif not copied:
            self.shard.copy_(self.master)

    def publish_gather(self) -> None:
        """Stages 1 and 2: all-gather the shards so that every rank's whole parameters hold the new values (stage
        3, persistent units too: gathered at the next use). Frozen parameters are left as they are."""
        if not self.sharded and not self.single:
            self.comm.gather_params(self.shard, self.full).wait()

    # ---- gradients ------------------------------------------------------------------------------------------

    def reduce_gradients(self, micro_step: int = 0) -> GradientReduction:
        """Start the reduce-scatter of the parameters' ``.grad`` (averaged over ranks) of micro-step ``micro_step``
        (the seed of qgZ's stochastic rounding: ``Collectives.rounding_seed``); the returned handle's
        ``wait()`` adds this rank's slice to ``grad_shard``. The ``.grad`` tensors are dropped at once (their values
        are copied into the flat buffer the collective sends), so a stage-3 unit may be freed before the wait.

        One rank: the average is the gradient itself, so each ``.grad`` is added straight into ``grad_shard`` (the
        same fp32 sums as upcast, identity reduce-scatter, add) with no flat buffer; the call is counted as the
        collective's would be (a ``reduce_scatter`` moving no bytes)."""
        if self.single:
            for p, off in zip(self.params, self.offsets):
                if p.grad is not None:
                    self.grad_shard[off : off + p.numel()].add_(moved(p.grad.reshape(-1), self.grad_shard.device))
                    p.grad = None
            self.comm.count_local_reduce_scatter()
            return GradientReduction(None)
        return reduce_bucketed([self], [self.take_gradients()], micro_step)

    def take_gradients(self) -> list[torch.Tensor | None]:
        """The parameters' ``.grad`` tensors (``None`` for a parameter without one), which are dropped from the
        parameters: the caller holds the only reference (``reduce_bucketed`` packs them)."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    def pack_gradients(self, grads: list[torch.Tensor | None], out: torch.Tensor) -> None:
        """Write ``grads`` (``take_gradients``) in the unit's flat layout into ``out``, a ``(P, S)`` view (row ``r``:
        rank ``r``'s slice; any strides, e.g. the unit's columns of a bucket): zeros in the gaps between parameters,
        in the padding and for a parameter without gradient; each element written once."""
        rows = out.view(1, -1) if out.is_contiguous() else out  # contiguous: one row, no split at slice ends
        width = rows.shape[1]

        def fill(start: int, stop: int, src: torch.Tensor | None) -> None:  # flat [start, stop) <- src or zeros
            at = start
            while at < stop:
                r, c = divmod(at, width)
                n = min(width - c, stop - at)
                if src is None:
                    rows[r, c : c + n].zero_()
                else:
                    rows[r, c : c + n].copy_(src[at - start : at - start + n])
                at += n

        end = 0
        for grad, off, shape in zip(grads, self.offsets, self.shapes):
            fill(end, off, None)
            end = off + shape.numel()
            fill(off, end, None if grad is None else grad.reshape(-1))
        fill(end, rows.numel(), None)

    def param_ranges(self) -> list[tuple[int, int, int]]:
        """``(parameter index, start, stop)`` for each parameter overlapping this rank's shard, ``start``/``stop``
        relative to the shard."""
        out = []
        lo, hi = self.start, self.start + self.shard_numel
        for i, (off, shape) in enumerate(zip(self.offsets, self.shapes)):
            a, b = max(off, lo), min(off + shape.numel(), hi)
            if a < b:
                out.append((i, a - lo, b - lo))
        return out


class FrozenFlat:
    """Stage 3: the frozen parameters of a unit in their own flat sharded buffer (see the module docstring): the
    trainable buffer's layout rules and collectives, the compute-dtype ``shard`` only (no master, gradient or
    optimizer state). Driven by its ``Unit`` (``gather``/``free``/``gather_exact``/``write_back``).

    Args:
        params: ``(qualified name, parameter)`` pairs, frozen, one floating dtype and device.
        comm: the engine's collectives.
        hpz: the hpZ partition size (1: off).
        broadcast: take the first rank's values (see ``Unit``).
    """

    def __init__(self, params: list[tuple[str, nn.Parameter]], comm: Collectives, *, hpz: int,
                 broadcast: bool, shard_home: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.comm = comm
        self.single = comm.world_size == 1
        self.sharded = not self.single
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"frozen parameters {self.param_names} mix dtypes or devices {sorted(map(str, kinds))}; "
                             "give the frozen parameters of a unit one dtype and device")
        self.shapes = [p.shape for p in self.params]
        self.offsets, self.numel, self.shard_numel = flat_layout([p.numel() for p in self.params], comm.alignment,
                                                                  comm.world_size)
        self.start = comm.rank * self.shard_numel
        first = self.params[0]
        self.full = torch.zeros(comm.world_size * self.shard_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                self.full[off : off + p.numel()].copy_(p.detach().reshape(-1))
        if broadcast:
            comm.broadcast_from_first(self.full)
        local = self.full[self.start : self.start + self.shard_numel]
        self.shard = local if self.single else local.clone() if shard_home is None else shard_home(local)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.hpz = hpz
        self.secondary: torch.Tensor | None = None  # hpZ: made at the first gather, kept (the values never change)
        self.shard_swap: SwappedShard | None = None  # NVMe offload_param (see Unit)
        self._shard_in_gather = False
        self._gathering: _comm.CollectiveWork | None = None
        self._bind()

    def _bind(self) -> None:
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = self.full[off : off + shape.numel()].view(shape)

    def start_gather(self) -> None:
        """Start the all-gather into ``full`` (qwZ over the data-parallel group, or the secondaries' exact one inside
        the hpZ partition); ``finish_gather`` waits for it."""
        self.full.untyped_storage().resize_(self._full_nbytes)
        self._shard_in_gather = self.secondary is None
        if self.secondary is not None:
            self._gathering = self.comm.gather_secondary(self.secondary, self.full)
        else:
            self._gathering = self.comm.gather_params(self.device_shard(), self.full)

    def device_shard(self) -> torch.Tensor:
        if self.shard_swap is not None:
            self.shard_swap.fetch()
        return _on_device(self.shard, self.full)

    def release_shard(self) -> None:
        if self.shard_swap is not None:
            self.shard_swap.release()

    def finish_gather(self) -> None:
        work, self._gathering = self._gathering, None
        if work is None:
            return
        work.wait()
        if self._shard_in_gather:
            self._shard_in_gather = False
            self.release_shard()
        if self.hpz > 1 and self.secondary is None:
            length = self.full.numel() // self.hpz
            i = self.comm.partition_rank
            self.secondary = self.full[i * length : (i + 1) * length].clone()
        self._bind()

    @property
    def gather_exact_communicates(self) -> bool:
        """Whether ``gather_exact`` is a collective now (see its no-op cases)."""
        return not (self.pinned or self.single) and (self.sharded or self.comm.weight_bits is not None)

    def gather_exact(self) -> None:
        self.full.untyped_storage().resize_(self._full_nbytes)
        self.comm.gather_exact(self.device_shard(), self.full)
        self.release_shard()
        self._bind()

    def free(self) -> None:
        if not self.sharded:
            return
        self.finish_gather()
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.full.untyped_storage().resize_(0)

    def write_back(self, src: int) -> None:
        """Broadcast ``full`` from global rank ``src`` and keep this rank's slice; drop the hpZ secondary."""
        self.comm.broadcast(self.full, src)
        if not self.single:
            _overwrite_shard(self, self.full[self.start : self.start + self.shard_numel])
        self.secondary = None


def moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when it is there (no call that could wait for a device), else a copy (an
    offload tier's host tensors meeting the device's)."""
    return tensor if tensor.device == device else tensor.to(device)


def _overwrite_shard(flat: Unit | FrozenFlat, values: torch.Tensor) -> None:
    """Copy ``values`` (every element of the shard) into ``flat.shard``; a swapped shard (NVMe ``offload_param``)
    gets fresh storage (no read) and is written behind, its storage going once written."""
    if flat.shard_swap is None:
        flat.shard.copy_(values)
        return
    flat.shard_swap.overwrite()
    flat.shard.copy_(values)
    flat.shard_swap.store()
    flat.shard_swap.release()


def _on_device(shard: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``shard`` itself when it is on ``full``'s device, else (``offload_param``) a copy of it there: asynchronous
    from page-locked memory, on the current stream, which the collective that reads it then uses."""
    if shard.device == full.device:
        return shard
    return shard.to(full.device, non_blocking=shard.is_pinned())


def gather_bucketed(units: list[Unit]) -> None:
    """Stage 3: start ONE all-gather for all of ``units`` that are not gathered (the same on every rank): their
    shards laid end to end, gathered over the data-parallel group (qwZ when on) into a temporary bucket, copied into
    each unit's ``full`` when that unit's gather is waited for (``Unit.gather()``, ``free()``). The values are those
    of one gather per unit: the shards are whole multiples of the quantization block when qwZ is on, so every block
    of the bucket is a block of one unit's shard, quantized on its own. A unit with frozen parameters or a resident
    hpZ secondary (weight deltas) is gathered on its own instead (``gather(wait=False)``). Units of different formats
    (``zeropp.rules``: their ``Collectives`` differ) go in one all-gather per format."""
    formats: dict[Collectives, list[Unit]] = {}
    for unit in units:
        formats.setdefault(unit.comm, []).append(unit)
    if len(formats) > 1:
        for same in formats.values():
            gather_bucketed(same)
        return
    todo = [u for u in units if not u.gathered and u.sharded]
    for unit in todo:
        # on its own: a frozen buffer is a second gather anyway; a resident hpZ secondary is gathered inside the node
        if unit.frozen is not None or unit.secondary is not None:
            unit.gather(wait=False)
    todo = [u for u in todo if u.frozen is None and u.secondary is None]
    if not todo:
        return
    comm = todo[0].comm
    if len(todo) == 1:  # nothing to merge
        todo[0].gather(wait=False)
        return
    sizes = [u.shard_numel for u in todo]
    width = sum(sizes)
    shards = torch.cat([u.device_shard() for u in todo])
    bucket = torch.empty(comm.world_size * width, dtype=shards.dtype, device=shards.device)
    work = comm.gather_params(shards, bucket)
    at = 0
    for unit, size in zip(todo, sizes):
        unit.full.untyped_storage().resize_(unit._full_nbytes)
        unit._gathering = _BucketPart(work, bucket.view(comm.world_size, width), at, size, unit.full)
        unit.gathered = True
        at += size


def reduce_bucketed(
    units: list[Unit], grads: list[list[torch.Tensor | None]], micro_step: int = 0
) -> GradientReduction:
    """Start ONE gradient reduce-scatter for all of ``units`` (more than one rank; the same units in the same order
    on every rank), whose gradients ``grads`` holds (``Unit.take_gradients``, one list per unit; packed here, in one
    copy, into a flat buffer of ``Collectives.gradient_dtype`` from the units' ``ReduceBuffers``). The returned
    handle's ``wait()`` adds this rank's slice of each unit's average to its ``grad_shard``.

    Layout: with unit ``u``'s flat buffer viewed as ``(P, S_u)`` (row ``r``: rank ``r``'s slice), the bucket is
    their concatenation along the columns, ``(P, W)`` with ``W = sum S_u``: rank ``r``'s part of the bucket is the
    concatenation of every unit's slice ``r``, split back into the units' shards on arrival. Every element is
    averaged over the same ranks' values in the same order as in a reduce-scatter of its unit alone, so the values
    are bit-identical to one collective per unit: exact fp32, the ``communication_data_type`` wire (summed per
    element in float64) and qgZ, whose blocks start at each slice start and, with every ``S_u`` a multiple of the
    block size, are exactly the units' own blocks (with stochastic rounding, ``micro_step`` and the first unit's name
    seed the bucket's noise, ``Collectives.rounding_seed``: the noise follows the bucket, the rounding stays unbiased).
    With qgZ error feedback each unit keeps its own residuals, in the layout of a reduce-scatter of it alone
    (``comm.BucketErrorFeedback``: the bucket's residual is theirs as columns), so the values, the residuals and
    their checkpoints are bit-identical to one collective per unit (with stochastic rounding: the same noise
    distribution, as above). Units of different formats (``zeropp.rules``: one collective has one format) cannot
    share a bucket: a ``ValueError``."""
    if any(u.comm is not units[0].comm for u in units):
        raise ValueError("reduce_bucketed: the units have different gradient formats (zeropp.rules); reduce each "
                         "format in its own call")
    comm, first = units[0].comm, units[0]
    world = comm.world_size
    width = sum(u.shard_numel for u in units)
    flat = first.reduce_buffers.take(world * width, first.full.device, comm.gradient_dtype)
    rows = flat.view(world, width)
    at = 0
    for unit, unit_grads in zip(units, grads, strict=True):
        unit.pack_gradients(unit_grads, rows[:, at : at + unit.shard_numel])
        at += unit.shard_numel
    received = torch.empty(comm.gradient_rows * width, dtype=torch.float32, device=flat.device)
    error_feedback = first.error_feedback
    if error_feedback is not None and len(units) > 1:
        error_feedback = _comm.BucketErrorFeedback([u.error_feedback for u in units], [u.shard_numel for u in units])
    work = comm.reduce_scatter_grads(flat, received, error_feedback=error_feedback,
                                     seed=comm.rounding_seed(micro_step, first.name))
    targets = [u.grad_shard if u.grad_accumulator is None else u.grad_accumulator for u in units]
    return GradientReduction(work, received, targets, flat, first.reduce_buffers, rows=comm.gradient_rows)


class _BucketPart:
    """One unit's part of a ``gather_bucketed`` all-gather: ``wait()`` waits for the shared collective (once) and
    copies the unit's columns of the ``(P, width)`` bucket into its ``full`` (``(P, size)``)."""

    def __init__(self, work: _comm.CollectiveWork, bucket: torch.Tensor, at: int, size: int, full: torch.Tensor):
        self._work, self._bucket, self._at, self._size, self._full = work, bucket, at, size, full

    def wait(self) -> None:
        self._work.wait()  # a second wait on the shared handle returns at once
        self._full.view(self._bucket.shape[0], self._size).copy_(self._bucket[:, self._at : self._at + self._size])


class ReduceBuffers:
    """Flat gradient buffers (fp32, or the ``communication_data_type``) for gradient reduce-scatters, reused from
    one reduction to the next of the same size and dtype.

    A fresh multi-MB CPU allocation comes from the kernel and costs a page fault per 4 KiB page at first touch
    (measured: copying the gradients into fresh buffers took 30 ms per step on the small GPT at 4 ranks, 20 ms
    with reuse); a buffer given back after its collective finished is handed to the next reduction instead. The
    buffers have the sizes of the buckets (``reduce_bucketed``: the units' buffers in all; the same buckets step
    after step, as the units' gradients get ready in the same order), and the pool keeps at most as many of each
    size as were in flight at once (one without ``overlap_comm``; with it, what ``reduce_bucket_size`` lets
    through). CPU buffers only: CUDA's caching allocator already reuses freed blocks, for any purpose, so holding
    them here would only take memory from the activations.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}

    def take(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer of ``numel`` elements of ``dtype`` on ``device``, contents undefined."""
        free = self._free.get((numel, torch.device(device), dtype))
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` (from ``take``, no longer used by any collective) for reuse (CPU buffers; others are
        left to their allocator)."""
        if buffer.device.type == "cpu":
            self._free.setdefault((buffer.numel(), buffer.device, buffer.dtype), []).append(buffer)


class GradientReduction:
    """A gradient reduce-scatter in flight (``Unit.reduce_gradients``, ``reduce_bucketed``): one collective for one
    or more units.

    Attributes:
        numel: elements of the flat buffer it sends (held until ``wait``).
    """

    def __init__(
        self,
        work: _comm.CollectiveWork | None,
        received: torch.Tensor | None = None,
        grad_shards: list[torch.Tensor] | None = None,
        flat: torch.Tensor | None = None,
        buffers: ReduceBuffers | None = None,
        rows: int = 1,
    ):
        """``work`` ``None``: a reduction already complete (one rank: nothing to wait for or add). ``received``:
        this rank's slice, the ``grad_shards`` of the units end to end; with a ``gradient_split``, ``rows`` rows, each
        the units' row end to end, added into the units' ``(rows, S)`` ``grad_accumulator`` views given as
        ``grad_shards``."""
        self._work: _comm.CollectiveWork | None = work
        self._received = received
        self._grad_shards = grad_shards or []
        self._flat = flat
        self._buffers = buffers
        self._rows = rows
        self.numel = 0 if flat is None else flat.numel()

    def start_next_hop(self) -> None:
        """Issue the collective's next communication (qgZ's hop 2) if its first is one that another follows
        (``CollectiveWork.start_next_hop``: waits for hop 1, which is inside the node)."""
        if self._work is not None:
            self._work.start_next_hop()

    def wait(self) -> None:
        """Finish the collective, add each unit's part of the received slice to its ``grad_shard`` (once) and give
        the flat buffer back for reuse."""
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        received = self._received.view(self._rows, -1)
        at = 0
        for grad_shard in self._grad_shards:  # an offloaded grad_shard: the slice copied to the host first
            n = grad_shard.shape[-1]
            grad_shard.add_(moved(received[:, at : at + n].reshape(grad_shard.shape), grad_shard.device))
            at += n
        if self._flat is not None and self._buffers is not None:
            self._buffers.give(self._flat)
            self._flat = None
