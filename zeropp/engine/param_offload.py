"""Where stage 3's compute-dtype parameter shards live between uses: DeepSpeed's ``zero_optimization.offload_param``
(ZeRO-Offload's and ZeRO-Infinity's parameter tier). ``ParamOffload`` is the tier, ``SwappedShard`` one shard in an
NVMe swap region.

``"cpu"`` keeps the shards in host memory and copies each to the device just before its all-gather; ``"nvme"`` keeps
those past ``max_in_cpu`` elements in swap files, read ahead by the stage-3 prefetcher, released after each gather
and written behind by the step, never more than ``buffer_count`` in memory. Why: parameters too large for the
device, or for host memory, still train, with the same values as without offload. A failed swap read or write is
not raised where it happens (the other ranks would hang in the all-gather): the ranks agree on it at the next
exchange and raise together.

docs/offload.md ("The parameter tier") has the tiers, the gather, the memory bound, the step and where failures are
agreed.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from ..config import AioConfig, OffloadParamConfig
from ..offload import ALIGNMENT, AioSettings, SwapError, SwapHandle, SwapSpace
from .offload import OffloadError

if TYPE_CHECKING:
    from .collectives import Collectives
    from .unit import FrozenFlat, Unit


class ParamOffload:
    """The tier of the stage-3 compute shards (module docstring).

    Args:
        config: the ``offload_param`` block.
        aio: the ``aio`` block (NVMe reads and writes).
        device: the compute device.
        rank: the global rank (names the swap directory).
    """

    def __init__(self, config: OffloadParamConfig, aio: AioConfig, *, device: torch.device, rank: int) -> None:
        self.config = config
        self.aio = aio
        self.device = torch.device(device)
        self.rank = rank
        self.pin = config.enabled and config.pin_memory and self.device.type == "cuda"
        self.swap: SwapSpace | None = None
        self.shards: list[SwappedShard] = []
        self.failure: SwapError | None = None
        """NVMe: the first swap read or write that failed on this rank (recorded, not raised: module docstring)."""
        self.agreed: str | None = None
        """Once the ranks agreed that some rank failed: why the engine cannot go on (``raise_failed``)."""
        self._held: set[SwappedShard] = set()  # swapped shards holding storage
        self._writes: collections.deque[SwappedShard] = collections.deque()  # writes in flight, oldest first
        self.peak_held = 0
        """NVMe: the most swapped shards that held storage at once since ``attach``."""
        self.counters = {"bytes_read": 0, "bytes_written": 0, "reads_ahead": 0}
        """NVMe: bytes read from and written to the swap files since ``attach``, and the reads a prefetch started."""

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def nvme(self) -> bool:
        return self.config.nvme

    @property
    def limit(self) -> int:
        """The most swapped shards holding storage at once (``buffer_count``)."""
        return self.config.buffer_count

    def home(self, local: torch.Tensor) -> torch.Tensor:
        """A host copy of the shard ``local`` (page-locked if asked)."""
        out = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin)
        return out.copy_(local)

    def attach(self, units: Sequence[Unit]) -> None:
        """NVMe: choose the shards to swap (``max_in_cpu``; not those of ``persistent`` units nor of one rank), make
        their swap space, write them and release their storage; each gets its ``SwappedShard`` as
        ``shard_swap``. Other tiers: nothing."""
        if not self.nvme:
            return
        chosen: list[tuple[str, Unit | FrozenFlat]] = []
        kept, spilled = 0, False
        for u, unit in enumerate(units):
            for kind, flat in (("shard", unit), ("frozen", unit.frozen)):
                if flat is None or not flat.sharded or not flat.shard_numel:
                    continue
                n = flat.shard_numel
                if not unit.persistent and (spilled or kept + n > self.config.max_in_cpu):
                    spilled = True
                    chosen.append((f"unit{u}.{kind}", flat))
                else:
                    kept += n
        if not chosen:
            return
        itemsize = max(flat.shard.element_size() for _, flat in chosen)
        buffer_bytes = -(-self.config.buffer_size * itemsize // ALIGNMENT) * ALIGNMENT
        self.swap = SwapSpace(
            self.config.nvme_path, {key: flat.shard.numel() * flat.shard.element_size() for key, flat in chosen},
            rank=self.rank, config_key="zero_optimization.offload_param.nvme_path",
            aio=AioSettings(block_size=self.aio.block_size, queue_depth=self.aio.queue_depth,
                            intra_op_parallelism=self.aio.intra_op_parallelism),
            buffer_count=self.config.buffer_count, buffer_size=buffer_bytes, pin_memory=self.pin)
        weakref.finalize(self, self.swap.close)  # the files go when the engine does, or at exit, without destroy()
        for key, flat in chosen:
            if flat.shard.is_pinned():  # page-locked storage cannot be released and re-made
                flat.shard = flat.shard.clone()
            slot = SwappedShard(self, key, flat.shard)
            self._held.add(slot)
            flat.shard_swap = slot
            self.shards.append(slot)
            slot.store()
        self.drain()
        self.peak_held = 0
        self.counters = dict.fromkeys(self.counters, 0)

    def close(self) -> None:
        """Delete the swap files (NVMe)."""
        if self.swap is not None:
            self.drain()
            self.swap.close()
            self.swap = None

    def drain(self) -> None:
        """Wait for every write in flight and release what it held."""
        while self._writes:
            self._writes.popleft()._finish_write()

    def read_ahead(self, slots: Sequence[SwappedShard]) -> bool:
        """A prefetch of the gather that needs ``slots`` (a unit's swapped shards): whether every one held storage
        (was read or being read) before this call, when only then may the gather start; else start the reads of
        those that do not, when they fit beside the held shards with two places left for an on-demand gather."""
        missing = [slot for slot in slots if not slot.held]
        if missing and len(self._held) + len(missing) <= self.limit - 2:
            for slot in missing:
                slot.start_read()
            self.counters["reads_ahead"] += len(missing)
        return not missing

    @contextlib.contextmanager
    def resident(self, flats: Iterable[Unit | FrozenFlat], *, read: bool = True, write: bool = False
                 ) -> Iterator[None]:
        """Hold the swapped shards of ``flats`` in memory for the block: read (``read``) or, without it, in zeroed
        storage for the block to fill (every element it does not write stays zero, as padding must); with ``write``,
        written back at the end (waited for). Shards in host memory: nothing. A read failure is recorded
        (``failure``) and leaves zeros."""
        slots = [flat.shard_swap for flat in flats if flat.shard_swap is not None]
        try:
            for slot in slots:
                slot.fetch() if read else slot.overwrite(zero=True)
            yield
            if write:
                for slot in slots:
                    slot.store()
                self.drain()
        finally:
            for slot in slots:
                slot.release()

    def flags(self, comm: Collectives) -> torch.Tensor:
        """A float64 vector of one element per rank of ``comm``'s group on the compute device, 1 at this rank's
        place when it recorded a failure: summed over the ranks (alone, ``check``, or in the step's statistics
        all-reduce), it names the failing ranks."""
        flags = torch.zeros(comm.world_size, dtype=torch.float64, device=self.device)
        flags[comm.rank] = self.failure is not None
        return flags

    def check(self, comm: Collectives, where: str) -> None:
        """NVMe, with shards swapped: one all-reduce of ``flags``; ``raise_failed`` (every rank the same way)."""
        if self.shards:
            self.raise_failed(comm, comm.all_reduce_sum(self.flags(comm)).tolist(), where)

    def raise_failed(self, comm: Collectives, summed: Sequence[float], where: str) -> None:
        """Given ``flags`` summed over the ranks, raise ``OffloadError`` naming the failing ranks (and, on a failing
        rank, its swap error) when any failed; from then on ``agreed`` holds the message."""
        failed = [comm.topology.ranks[r] for r, bad in enumerate(summed) if bad]
        if not failed:
            return
        self.agreed = (
            f"{where}: reading or writing the NVMe parameter offload's swap files failed on rank(s) {failed} "
            f"({self.failure if self.failure is not None else 'that rank holds the cause'}); the weights computed "
            "with since are not the model's: build a new engine and load the last checkpoint (engine.load_checkpoint)")
        raise OffloadError(self.agreed) from self.failure

    def _record(self, error: SwapError) -> None:
        if self.failure is None:
            self.failure = error

    def _hold(self, slot: SwappedShard) -> None:
        self._held.add(slot)
        self.peak_held = max(self.peak_held, len(self._held))


class SwappedShard:
    """One compute shard in a swap region (``ParamOffload``, NVMe): ``tensor`` keeps its shape and dtype, with
    storage only while held (a read in flight or done, a write in flight, or taken by ``fetch``/``overwrite``)."""

    def __init__(self, owner: ParamOffload, key: str, tensor: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self._read: SwapHandle | None = None
        self._write: SwapHandle | None = None
        self._used = False  # taken by fetch/overwrite and not yet released

    @property
    def held(self) -> bool:
        return self in self.owner._held

    @property
    def reading(self) -> bool:
        """Read ahead (``ParamOffload.read_ahead``) and not yet taken by ``fetch``."""
        return self._read is not None and not self._used

    def fetch(self) -> None:
        """Make the shard resident: wait for its read in flight, or read it now (on the first forward, or when
        prefetch did not start it). A failed read is recorded and leaves zeros."""
        self._used = True
        if self.held and self._read is None:
            return
        if self._read is None:
            self.start_read()
        handle, self._read = self._read, None
        try:
            handle.wait()
        except SwapError as e:
            self.owner._record(e)
            self.tensor.zero_()

    def overwrite(self, zero: bool = False) -> None:
        """Give the shard storage for the caller to overwrite (no read; zeroed with ``zero``, else undefined);
        waits for the shard's own read or write in flight first."""
        self._used = True
        self._quiesce()
        if not self.held:
            self.tensor.untyped_storage().resize_(self.nbytes)
            self.owner._hold(self)
        if zero:
            self.tensor.zero_()

    def store(self) -> None:
        """Start writing the shard's current values to its region (write-behind); its storage goes once the write
        has finished and the shard is released. At most ``buffer_count`` writes in flight: the oldest is waited for
        first."""
        owner = self.owner
        self._quiesce()
        while len(owner._writes) >= owner.limit:
            owner._writes.popleft()._finish_write()
        assert owner.swap is not None
        self._write = owner.swap.write(self.key, self.tensor)
        owner.counters["bytes_written"] += self.nbytes
        owner._writes.append(self)

    def release(self) -> None:
        """The caller is done with the shard: drop its storage (at once, or when its write has finished)."""
        self._used = False
        if self._read is not None:  # read ahead but never used (a prefetch guess, or freed first)
            self._wait_quietly(self._read)
            self._read = None
        if self._write is None:
            self._drop()

    def start_read(self) -> None:
        """Give the shard storage and start reading its region into it (``fetch`` waits for it)."""
        owner = self.owner
        assert owner.swap is not None
        self.tensor.untyped_storage().resize_(self.nbytes)
        owner._hold(self)
        self._read = owner.swap.read(self.key, self.tensor)
        owner.counters["bytes_read"] += self.nbytes

    def _quiesce(self) -> None:
        """Wait for the read or write in flight (the tensor's bytes are being filled or copied)."""
        if self._read is not None:
            self._wait_quietly(self._read)
            self._read = None
        if self._write is not None:
            self.owner._writes.remove(self)
            self._finish_write()

    def _finish_write(self) -> None:
        handle, self._write = self._write, None
        if handle is not None:
            try:
                handle.wait()
            except SwapError as e:
                self.owner._record(e)
        if not self._used:
            self._drop()

    def _drop(self) -> None:
        self.tensor.untyped_storage().resize_(0)
        self.owner._held.discard(self)

    def _wait_quietly(self, handle: SwapHandle) -> None:
        """Wait for a transfer whose data will not be used; a failure is still recorded."""
        try:
            handle.wait()
        except SwapError as e:
            self.owner._record(e)
