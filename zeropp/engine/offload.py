"""Where the optimizer side of each unit lives: DeepSpeed's ``zero_optimization.offload_optimizer`` (ZeRO-Offload and
ZeRO-Infinity's optimizer tier). The parameter tier, ``offload_param``, is ``zeropp.engine.param_offload``.

A unit's fp32 master, fp32 gradient shard and optimizer state stay on the device (``"none"``), in host memory,
stepped on the CPU (``"cpu"``), or in NVMe swap files streamed through the step with at most ``buffer_count`` units
in memory, from construction on (``"nvme"``); each unit may have its own tier (``memory_budget``). Why: optimizer
states larger than the device, or than host memory, still train, with the same values as without offload. A
swapped-out tensor has no storage, so a read that skips ``resident`` fails at once instead of reading stale values.

docs/offload.md ("The optimizer tier") has each tier, the streaming, the memory bound and per-unit tiers.
"""

from __future__ import annotations

import collections
import contextlib
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch

from ..config import AioConfig, OffloadOptimizerConfig
from ..offload import AioSettings, SwapError, SwapSpace
from .unit import Unit


class OffloadError(RuntimeError):
    """An offload tier failed (a swap read or write on some rank): raised on every rank by the step, and by every
    later use of the engine; its message names the ranks and the cause, and says to resume from the last
    checkpoint in a new engine."""


class OptimizerOffload:
    """The tier of every unit's optimizer side (module docstring).

    Args:
        config: the ``offload_optimizer`` block.
        aio: the ``aio`` block (NVMe reads and writes).
        device: the compute device (the parameters').
        numels: the trainable elements of each unit, in unit order (for ``ratio``).
        rank: the global rank (names the swap directory).
    """

    def __init__(self, config: OffloadOptimizerConfig, aio: AioConfig, *, device: torch.device,
                 numels: Sequence[int], rank: int) -> None:
        self.config = config
        self.aio = aio
        self.device = torch.device(device)
        self.rank = rank
        self.tier = config.device
        self.tiers: list[str]
        """Each unit's tier, ``"device"``, ``"cpu"`` or ``"nvme"`` (``migrate`` changes them)."""
        if not config.enabled:
            self.tiers = ["device" for _ in numels]
        elif config.partial:  # the first units up to ratio of the elements on the host
            total, at, self.tiers = sum(numels), 0, []
            for n in numels:
                self.tiers.append("cpu" if at + n <= config.ratio * total else "device")
                at += n
        else:
            self.tiers = [config.device for _ in numels]
        self.pin = config.enabled and config.pin_memory and self.device.type == "cuda"
        self.swap: SwapSpace | None = None
        self._tensors: list[dict[str, torch.Tensor]] = []  # nvme: per unit, the swapped tensors by kind
        self._resident: set[int] = set()
        self._unwritten: set[tuple[int, str]] = set()  # (unit, kind) of zero state not yet written (``zeros``)
        self._writes: collections.deque[tuple[int, _Transfers]] = collections.deque()  # ``admit``'s in flight
        self._admit_failure: SwapError | None = None  # the first failed write of ``admit``, raised by ``attach``
        self.peak_resident = 0
        """NVMe: the most units whose optimizer side was in memory at once (at most ``buffer_count``)."""
        self.counters = {"bytes_read": 0, "bytes_written": 0, "read_wait_s": 0.0, "write_wait_s": 0.0}
        """NVMe: bytes read from and written to the swap files since ``attach``, and the seconds the engine waited
        for reads and for writes (time a pipelined transfer ran under the step is not counted)."""

    @property
    def nvme(self) -> bool:
        """Whether some unit's optimizer side is on NVMe."""
        return "nvme" in self.tiers

    @property
    def homes(self) -> list[torch.device]:
        """Each unit's memory: the compute device (tier ``"device"``) or the host (``"cpu"``; ``"nvme"``: the
        gradient shard, and the master and states while in memory)."""
        return [self.device if t == "device" else torch.device("cpu") for t in self.tiers]

    def empty(self, unit: int, numel: int, kind: str) -> torch.Tensor:
        """An fp32 tensor of ``numel`` elements for unit ``unit``'s ``kind`` (``"master"`` or ``"grad_shard"``), on
        the unit's home; page-locked when asked, except an NVMe master (its storage is released and re-made at every
        swap, which page-locked storage does not allow; the swap copies through its own page-locked buffers)."""
        home = self.homes[unit]
        if home.type == "cpu" and self.pin and not (self.tiers[unit] == "nvme" and kind == "master"):
            return torch.empty(numel, dtype=torch.float32, pin_memory=True)
        return torch.empty(numel, dtype=torch.float32, device=home)

    def open(self, shard_numels: Sequence[int], kinds: Sequence[str]) -> None:
        """NVMe: make the swap space, one region per unit (``shard_numels[u]`` fp32 elements, none for an empty
        shard, none for a unit whose tier is not ``"nvme"``) and kind (``"master"`` and the optimizer's state
        ``kinds``), before any unit is built, so that each
        unit's side can be swapped out as soon as it exists (``admit``, ``zeros``). Other tiers: nothing."""
        if not self.nvme:
            return
        self._tensors = [{} for _ in shard_numels]
        regions = {_key(u, kind): n * 4 for u, n in enumerate(shard_numels) for kind in ("master", *kinds)
                   if n and self.tiers[u] == "nvme"}
        if not regions:
            return
        self.swap = SwapSpace(
            self.config.nvme_path, regions, rank=self.rank,
            config_key="zero_optimization.offload_optimizer.nvme_path",
            aio=AioSettings(block_size=self.aio.block_size, queue_depth=self.aio.queue_depth,
                            intra_op_parallelism=self.aio.intra_op_parallelism),
            buffer_count=self.config.buffer_count, pin_memory=self.pin)
        weakref.finalize(self, self.swap.close)  # the files go when the engine does, or at exit, without destroy()

    def admit(self, u: int, master: torch.Tensor) -> None:
        """NVMe: unit ``u``'s ``master`` (just built, holding its initial values) is written to its swap region and
        its storage released, the write left in flight until ``buffer_count`` units' are (so that building the
        next units overlaps it and at most ``buffer_count`` masters are in memory at once). Other tiers: nothing."""
        if self.swap is None or self.tiers[u] != "nvme" or not master.numel():
            return
        self._tensors[u]["master"] = master
        self._hold(u)
        self._writes.append((u, self._write(u)))
        while len(self._resident) >= max(1, self.config.buffer_count) and self._writes:
            self._settle(*self._writes.popleft())

    def _settle(self, u: int, transfers: _Transfers) -> None:
        """``admit``'s writes end without raising (the units are still being built, with collectives between them):
        a failure is kept for ``attach`` to raise."""
        try:
            self._finish_write(u, transfers)
        except SwapError as error:
            self._release(u)
            self._admit_failure = self._admit_failure or error

    def zeros(self, u: int, master: torch.Tensor, kind: str) -> torch.Tensor:
        """Unit ``u``'s optimizer state ``kind``, zero-filled, shaped as its ``master`` and where it lives. NVMe: a
        tensor without storage whose region is not written until the unit is first stepped (its first read fills
        it with zeros instead of reading), so that the zero state of the whole model never exists in memory (call
        ``admit`` for the master first). Other tiers: ``torch.zeros_like(master)``."""
        if self.swap is None or self.tiers[u] != "nvme" or not master.numel():
            return torch.zeros_like(master)
        if self._tensors[u].get("master") is not master:
            raise ValueError(f"zeros: unit {u}'s master was not given to admit; admit it first")
        t = torch.empty(master.shape, dtype=torch.float32)
        t.untyped_storage().resize_(0)
        self._tensors[u][kind] = t
        self._unwritten.add((u, kind))
        return t

    def attach(self, units: Sequence[Unit], state: dict[str, list[torch.Tensor]]) -> None:
        """NVMe: take charge of every NVMe unit's ``master`` and ``state`` tensors (by kind, one per unit): those still
        holding memory (not passed to ``admit`` or made by ``zeros``) are written to their swap regions and
        released one unit at a time, at most ``buffer_count`` units in memory; every write has finished on return.
        Other tiers: nothing."""
        if self.swap is None:
            return
        while self._writes:
            self._settle(*self._writes.popleft())
        if self._admit_failure is not None:
            raise self._admit_failure
        limit = max(1, self.config.buffer_count)
        for u, unit in enumerate(units):
            if self.tiers[u] != "nvme":
                continue
            tensors = {"master": unit.master, **{k: v[u] for k, v in state.items()}}
            tensors = {kind: t for kind, t in tensors.items() if t.numel()}
            known = self._tensors[u]
            if any(known.get(kind, t) is not t for kind, t in tensors.items()):
                raise ValueError(f"attach: unit {u}'s tensors are not those given to admit/zeros")
            self._tensors[u] = tensors
            held = [kind for kind, t in tensors.items() if t.untyped_storage().nbytes()]
            if held:
                self._hold(u)
                self._writes.append((u, self._write(u, held)))
                while len(self._resident) >= limit and self._writes:
                    self._finish_write(*self._writes.popleft())
        while self._writes:
            self._finish_write(*self._writes.popleft())
        self.counters = dict.fromkeys(self.counters, 0)

    def close(self) -> None:
        """Delete the swap files (NVMe)."""
        if self.swap is not None:
            self.swap.close()
            self.swap = None

    # ---- residency ------------------------------------------------------------------------------------------

    def stream(self, units: Sequence[Unit], *, write: bool) -> Iterator[int]:
        """Yield the index of each of ``units`` in order, its optimizer side in memory while the caller holds it;
        with ``write`` each is written back after the caller moves on (NVMe; other tiers yield at once). Reads
        ahead with ``pipeline_read``, leaves writes in flight with ``pipeline_write``, never more than
        ``buffer_count`` units in memory (units on other tiers come at once, uncounted). Every transfer has finished
        when the generator is exhausted or closed; closed early (the caller raised), the unit it held is released
        without being written."""
        if not self.nvme or self.swap is None:
            yield from range(len(units))
            return
        limit = max(1, self.config.buffer_count)
        ahead = limit - 1 if self.config.pipeline_read else 0
        reads: dict[int, _Transfers] = {}
        writes: collections.deque[tuple[int, _Transfers]] = collections.deque()
        held: int | None = None  # the unit the caller holds
        try:
            for u in range(len(units)):
                for v in range(u, min(len(units), u + ahead + 1)):
                    if self.tiers[v] != "nvme" or v in reads or v in self._resident:
                        continue
                    while len(self._resident) >= limit and writes:
                        self._finish_write(*writes.popleft())
                    if v != u and len(self._resident) >= limit:
                        break
                    reads[v] = self._read(v)
                if u in reads:
                    self._wait(reads.pop(u), "read_wait_s")
                held = u
                yield u
                held = None
                if self.tiers[u] != "nvme":
                    continue
                if write:
                    writes.append((u, self._write(u)))
                    if not self.config.pipeline_write:
                        self._finish_write(*writes.popleft())
                else:
                    self._release(u)
            while writes:
                self._finish_write(*writes.popleft())
        finally:  # an error or an early close: every transfer ends before the tensors are released; the unit the
            # caller held is dropped unwritten (its swap files keep the values last written)
            for u, transfers in list(reads.items()) + list(writes):
                transfers.wait_quietly()
                self._release(u)
            if held is not None and self.tiers[held] == "nvme":
                self._release(held)

    @contextlib.contextmanager
    def resident(self, units: Sequence[Unit], indices: Iterable[int] | None = None, *,
                 write: bool) -> Iterator[None]:
        """Hold the optimizer side of ``units[i]`` for ``i`` in ``indices`` (all by default) in memory for the
        block (checkpoints, ``load_state_dict``, ``gathered_parameters`` write-back); with ``write``, write them
        back at the end (NVMe; other tiers: nothing)."""
        if not self.nvme or self.swap is None:
            yield
            return
        chosen = [u for u in (range(len(units)) if indices is None else indices)
                  if self.tiers[u] == "nvme" and u not in self._resident]
        try:
            for u in chosen:
                self._wait(self._read(u), "read_wait_s")
            yield
            if write:
                for u in chosen:
                    self._wait(self._write(u), "write_wait_s")
        finally:
            for u in chosen:
                if u in self._resident:
                    self._release(u)

    def swapped(self, unit: int) -> bool:
        """Whether unit ``unit``'s master and state are out of memory now (NVMe, not held by ``stream`` or
        ``resident``): their tensors have no storage, read them with ``read_range``."""
        master = self._tensors[unit].get("master") if self._tensors else None
        return self.swap is not None and unit not in self._resident and master is not None and bool(master.numel())

    def read_range(self, unit: int, kind: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of unit ``unit``'s ``kind`` (``"master"`` or a state kind) as a new
        fp32 CPU tensor, of a ``swapped`` unit: only the swap pieces holding them are read (``SwapSpace.read_range``;
        a checkpoint save writes a unit's parameters one piece at a time, in any order)."""
        if not self.swapped(unit):
            raise ValueError(f"read_range: unit {unit}'s optimizer side is in memory; read its tensors directly")
        assert self.swap is not None
        if (unit, kind) in self._unwritten:  # zero state not written yet (``zeros``)
            return torch.zeros(numel, dtype=torch.float32)
        out = torch.empty(numel, dtype=torch.float32)
        self.swap.read_range(_key(unit, kind), start * out.element_size(), out)
        self.counters["bytes_read"] += numel * out.element_size()
        return out

    def batches(self, count: int) -> list[list[int]]:
        """The indices of ``count`` units in groups of at most ``buffer_count`` (NVMe), to hold in memory one group
        at a time (a checkpoint load); other tiers: one group of all."""
        if self.swap is None:
            return [list(range(count))]
        size = max(1, self.config.buffer_count)
        return [list(range(at, min(at + size, count))) for at in range(0, count, size)]

    def migrate(self, units: Sequence[Unit], state: dict[str, list[torch.Tensor]], tiers: Sequence[str]) -> None:
        """Move unit ``u``'s optimizer side (``master``, ``grad_shard``, its ``state`` kinds) to ``tiers[u]`` for
        every unit whose tier changes, each value copied exactly; the tensors in ``units`` and ``state`` are replaced
        where their memory changes. Only towards the device (``zeropp.engine.placement`` starts every unit in its
        farthest tier): a unit leaving NVMe is read back and its swap regions deleted. Raises ``SwapError`` when a
        read fails (the unit stays on NVMe)."""
        for u, (old, new) in enumerate(zip(self.tiers, tiers, strict=True)):
            if new == old:
                continue
            if _TIERS.index(new) > _TIERS.index(old):
                raise ValueError(f"unit {u}: a move from {old!r} to {new!r} is away from the device; the states only "
                                 "move towards it")
            if old == "nvme" and self.swap is not None and self._tensors[u]:
                if u not in self._resident:
                    self._wait(self._read(u), "read_wait_s")
                for kind, t in self._tensors[u].items():
                    if t.numel():
                        self.swap.remove(_key(u, kind))
                    self._unwritten.discard((u, kind))
                self._tensors[u] = {}
                self._resident.discard(u)
            self.tiers[u] = new
            unit = units[u]
            unit.master = self._rehome(u, unit.master, "master")
            unit.grad_shard = self._rehome(u, unit.grad_shard, "grad_shard")
            for kind, tensors in state.items():
                tensors[u] = self._rehome(u, tensors[u], kind)

    def _rehome(self, u: int, t: torch.Tensor, kind: str) -> torch.Tensor:
        """``t`` itself when it is where unit ``u``'s ``kind`` belongs now, else an exact copy there."""
        want = self.empty(u, 0, kind)
        if t.device == want.device and t.is_pinned() == want.is_pinned():
            return t
        return self.empty(u, t.numel(), kind).copy_(t)

    def _hold(self, u: int) -> None:
        self._resident.add(u)
        self.peak_resident = max(self.peak_resident, len(self._resident))

    def _read(self, u: int) -> _Transfers:
        assert self.swap is not None
        handles = []
        for kind, t in self._tensors[u].items():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            if (u, kind) in self._unwritten:
                t.zero_()
            else:
                handles.append(self.swap.read(_key(u, kind), t))
                self.counters["bytes_read"] += t.numel() * t.element_size()
        self._hold(u)
        return _Transfers(handles)

    def _write(self, u: int, kinds: Iterable[str] | None = None) -> _Transfers:
        """Write unit ``u``'s tensors of ``kinds`` (all by default)."""
        assert self.swap is not None
        tensors = [(kind, self._tensors[u][kind]) for kind in (self._tensors[u] if kinds is None else kinds)]
        self.counters["bytes_written"] += sum(t.numel() * t.element_size() for _, t in tensors)
        self._unwritten.difference_update((u, kind) for kind, _ in tensors)
        return _Transfers([self.swap.write(_key(u, kind), t) for kind, t in tensors])

    def _finish_write(self, u: int, transfers: _Transfers) -> None:
        self._wait(transfers, "write_wait_s")
        self._release(u)

    def _wait(self, transfers: _Transfers, counter: str) -> None:
        start = time.perf_counter()
        try:
            transfers.wait_all()
        finally:
            self.counters[counter] += time.perf_counter() - start

    def _release(self, u: int) -> None:
        for t in self._tensors[u].values():
            t.untyped_storage().resize_(0)
        self._resident.discard(u)


class _Transfers:
    """The swap reads or writes of one unit's tensors."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait_all(self) -> None:
        """Wait for every transfer; raise the first failure (``SwapError``) after all have ended."""
        error: BaseException | None = None
        for handle in self.handles:
            try:
                handle.wait()
            except BaseException as e:  # noqa: BLE001 - the others must end before the buffers go
                error = error or e
        if error is not None:
            raise error

    def wait_quietly(self) -> None:
        for handle in self.handles:
            with contextlib.suppress(BaseException):
                handle.wait()


_TIERS = ("device", "cpu", "nvme")


def _key(unit: int, kind: str) -> str:
    return f"unit{unit}.{kind}"
