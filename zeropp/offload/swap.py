"""A per-rank swap space on a local disk (ZeRO-Infinity's NVMe tier): fixed-size named regions that tensors are
written to (write-behind) and read back from (read-ahead), checksummed.

Layout. ``SwapSpace(nvme_path, regions, rank=r)`` makes the directory ``<nvme_path>/zeropp-swap/<run_id>-rank<r>/``
(``run_id``: a fresh ``<UTC time>-<pid>-<random>`` unless given; the directory must not exist yet, so two swap
spaces never share files) holding one file per region, ``<index>-<key>.swap`` (index: the region's position in
``regions``, 5 digits; key: its characters outside ``[A-Za-z0-9._-]`` replaced by ``_``, cut at 80). A region of
``n`` bytes occupies bytes ``[0, round_up(n, 4096))`` of its file; the padding is zeros. The files are scratch:
``close()`` deletes them and the directory (and ``zeropp-swap`` if that is then empty); checkpoints are separate.

Transfers. A region is moved in chunks of at most ``buffer_size`` bytes, each through one host buffer of a pool of
``buffer_count`` (``ALIGNMENT``-aligned; page-locked if ``pin_memory`` and CUDA is there), so the host memory of
the transfers in flight is bounded by ``buffer_count * buffer_size`` however many are queued (a region smaller than
a buffer still holds a whole one); each chunk is split into pieces of ``aio.block_size`` bytes, the unit of I/O and
of checksumming. ``write`` and ``read`` return at once; one
dispatcher thread, in call order, waits for a free buffer, copies the chunk in (write) and hands its pieces to the
I/O threads (``AsyncFileIO``); the read's last piece of a chunk copies it out and frees the buffer. Operations on
one key run in call order (a read sees every write called before it); operations on different keys overlap.

Ownership. After ``write(key, tensor)`` the caller must not modify ``tensor`` until the handle's ``wait()``
returns; after ``read(key, out)`` it must not use ``out`` until then. CUDA tensors are fine: the copy waits for the
work queued on the caller's current stream when ``write``/``read`` was called, and is complete when ``wait()``
returns.

Integrity. Each piece's CRC-32C (the ``crc32c`` package: SSE4.2 or ARMv8 CRC instructions, 6-15 GB/s on one core
of the development machine, 3-4x zlib.crc32; ``bench/swap.py`` measures it against the disk) is recorded in memory
when it is written and checked when it is read. Every failure is a ``SwapError`` naming the file, the byte offset,
what happened and what to do: the preflight at creation (``nvme_path`` missing, not a directory, not writable, too
little free space; the message names the caller's ``config_key``), no space or a file-size limit while writing, a
device error, a file deleted or truncated behind zeropp's back, a checksum mismatch. A failed write leaves its
region unreadable (reads raise) until it is written again.
"""

from __future__ import annotations

import os
import queue
import re
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import crc32c
import torch

from .aio import (ALIGNMENT, AioSettings, AsyncFileIO, SwapError, aligned_buffer, direct_io_supported, open_file,
                  pread_full, pwrite_full, round_up, warn_buffered)


BUFFER_SIZE = 64 << 20
"""Bytes: ``SwapSpace``'s default host buffer size (each buffer is cut to the largest region)."""


@dataclass(frozen=True)
class _Piece:
    index: int  # position in the region's checksum list
    offset: int  # bytes from the start of the region (and of its file)
    length: int  # payload bytes
    io_length: int  # bytes transferred: ``length`` rounded up to ALIGNMENT (differs for the region's last piece only)


class _Region:
    def __init__(self, key: str, nbytes: int, path: str, buffer_bytes: int, block_size: int) -> None:
        self.key, self.nbytes, self.path = key, nbytes, path
        self.chunks: list[tuple[int, int, list[_Piece]]] = []  # (start, end, pieces), end - start <= buffer_bytes
        index = 0
        for start in range(0, nbytes, buffer_bytes):
            end = min(start + buffer_bytes, nbytes)
            pieces = []
            for offset in range(start, end, block_size):
                length = min(block_size, end - offset)
                pieces.append(_Piece(index, offset, length, round_up(length)))
                index += 1
            self.chunks.append((start, end, pieces))
        self.pieces = index
        self.dtype: torch.dtype | None = None  # of the last write called
        self.checksums: list[int] | None = None  # of the last write completed, None if it failed or none ran
        self.failure = "it was never written"
        self.last: SwapHandle | None = None  # the last operation called on it


class _BufferPool:
    """``count`` aligned host buffers of ``size`` bytes; ``acquire`` blocks while all are in use."""

    def __init__(self, count: int, size: int, pin_memory: bool) -> None:
        self.buffers = [aligned_buffer(size, pin_memory=pin_memory) for _ in range(count)]
        self.views = [memoryview(buffer.numpy()) for buffer in self.buffers]
        self._free = list(range(count))
        self._cond = threading.Condition()
        self.peak_in_use = 0

    def acquire(self) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            self.peak_in_use = max(self.peak_in_use, len(self.buffers) - len(self._free) + 1)
            return self._free.pop()

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify()


class SwapHandle:
    """One ``write`` or ``read`` of a ``SwapSpace``, in flight until ``wait()`` returns."""

    def __init__(self, kind: str, region: _Region, tensor: torch.Tensor, previous: SwapHandle | None) -> None:
        self._kind, self._region, self._previous = kind, region, previous
        self._bytes: torch.Tensor | None = tensor.reshape(-1).view(torch.uint8)
        self._ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensor.device))
        self._checksums: list[int] = [0] * region.pieces
        self._fd: int | None = None
        self._error: BaseException | None = None
        self._outstanding = 1  # the dispatcher's own share, plus one per chunk in flight
        self._lock = threading.Lock()
        self._done = threading.Event()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer is complete; raise its ``SwapError`` if it failed. ``timeout`` (seconds):
        raise ``TimeoutError`` if it is still running then (it keeps running)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self._kind} of swap region {self._region.key!r} still running after {timeout} s")
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not); ``wait()`` then returns or raises at once."""
        return self._done.is_set()

    def _fail(self, error: BaseException) -> None:
        if not isinstance(error, SwapError):
            cause = error
            error = SwapError(f"{self._kind} of swap region {self._region.key!r} ({self._region.path!r}) failed: "
                              f"{type(cause).__name__}: {cause}")
            error.__cause__ = cause
        with self._lock:
            if self._error is None:
                self._error = error

    def _add(self) -> None:
        with self._lock:
            self._outstanding += 1

    def _release(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding:
                return
        if self._fd is not None:
            os.close(self._fd)
        region = self._region
        if self._kind == "write":
            region.checksums = self._checksums if self._error is None else None
            region.failure = f"its last write failed: {self._error}" if self._error is not None else ""
        self._bytes = self._ready = self._previous = None
        self._done.set()


def _file_name(index: int, key: str) -> str:
    return f"{index:05d}-{re.sub(r'[^A-Za-z0-9._-]', '_', key)[:80]}.swap"


def _preflight(nvme_path: str, config_key: str, needed: int) -> None:
    """Raise ``SwapError`` unless ``nvme_path`` is an existing, writable directory with ``needed`` bytes free."""
    fix = f"set {config_key} to a writable directory on a local disk (NVMe) with room for the swapped tensors"
    if not os.path.exists(nvme_path):
        raise SwapError(f"{config_key}={nvme_path!r} does not exist. Fix: create it (mkdir -p {nvme_path}) or {fix}")
    if not os.path.isdir(nvme_path):
        raise SwapError(f"{config_key}={nvme_path!r} is not a directory. Fix: {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zeropp-write-probe-", dir=nvme_path)
    except OSError as error:
        raise SwapError(f"{config_key}={nvme_path!r} is not writable: creating a file there failed "
                        f"({error.strerror}). Fix: remount it read-write or give this user write permission, or "
                        f"{fix}") from error
    os.close(fd)
    os.unlink(probe)
    stat = os.statvfs(nvme_path)
    free = stat.f_bavail * stat.f_frsize
    if free < needed:
        raise SwapError(f"{config_key}={nvme_path!r} has {free} bytes ({free / 2**30:.2f} GiB) free but this rank's "
                        f"swap regions need {needed} bytes ({needed / 2**30:.2f} GiB). Fix: free space there, {fix}, "
                        f"or offload less to NVMe (device 'cpu' for some of it)")


_STALE = re.compile(r"^\d{8}T\d{6}Z-(\d+)-[0-9a-f]{8}-rank\d+$")


def _warn_stale(root: str) -> None:
    """Warn about swap directories under ``root`` left by processes of this machine that no longer run (a killed
    rank cannot delete its files): their names hold the maker's pid (the default ``run_id``)."""
    stale, nbytes = [], 0
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return
    for name in names:
        match = _STALE.match(name)
        if match is None or _running(int(match.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            with os.scandir(path) as entries:
                nbytes += sum(entry.stat().st_size for entry in entries if entry.is_file())
        except FileNotFoundError:  # removed meanwhile
            continue
        stale.append(path)
    if stale:
        warnings.warn(f"zeropp offload: {len(stale)} swap director{'y' if len(stale) == 1 else 'ies'} of processes "
                      f"that no longer run ({nbytes / 2**30:.2f} GiB): {stale[:4]}{' ...' if len(stale) > 4 else ''};"
                      f" a killed run leaves its swap files behind: delete them if no run on another machine shares "
                      f"this directory", RuntimeWarning, stacklevel=3)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class SwapSpace:
    """Fixed-size named regions on a local disk, one file each, written and read asynchronously (module docstring:
    layout, transfers, ownership, integrity).

    * ``nvme_path``: the directory to swap under (it must exist); ``config_key`` names it in errors, e.g.
      ``"zero_optimization.offload_optimizer.nvme_path"``.
    * ``regions``: ``{key: bytes}``, each region's fixed size (a positive number of bytes); ``write`` and ``read``
      move exactly that many bytes.
    * ``rank``, ``run_id``: name the directory ``<nvme_path>/zeropp-swap/<run_id>-rank<rank>``.
    * ``aio``: block size, queue depth and threads (``AioSettings``).
    * ``buffer_count``, ``buffer_size``: the host buffer pool (bytes; ``buffer_size`` is cut to the largest region
      rounded up to ``ALIGNMENT``, and must be a multiple of ``ALIGNMENT``).
    * ``pin_memory``: page-locked buffers where CUDA is available (faster copies to and from a GPU; without CUDA
      there is nothing to gain and ``pinned`` is False).
    * ``direct``: ``None`` uses ``O_DIRECT`` where the filesystem accepts it, else buffered I/O with a warning
      (once per filesystem); ``True`` requires ``O_DIRECT``; ``False`` uses buffered I/O.

    Raises ``SwapError`` when the preflight fails (missing, not a directory, not writable, fewer free bytes than
    the regions' rounded-up sizes; other ranks and runs on the same disk are not counted) and ``ValueError`` for bad
    arguments. Use as a context manager or call ``close()``.
    """

    def __init__(self, nvme_path: str | os.PathLike, regions: Mapping[str, int], *, rank: int = 0,
                 run_id: str | None = None, config_key: str = "nvme_path", aio: AioSettings = AioSettings(),
                 buffer_count: int = 4, buffer_size: int = BUFFER_SIZE, pin_memory: bool = False,
                 direct: bool | None = None) -> None:
        if not regions:
            raise ValueError("regions is empty: give {key: bytes} for every tensor to swap")
        for key, nbytes in regions.items():
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise ValueError(f"regions[{key!r}]={nbytes!r}: must be a positive number of bytes")
        if buffer_count < 1:
            raise ValueError(f"buffer_count={buffer_count}: must be at least 1")
        if buffer_size <= 0 or buffer_size % ALIGNMENT:
            raise ValueError(f"buffer_size={buffer_size}: must be a positive multiple of {ALIGNMENT} bytes, e.g. "
                             f"{round_up(max(buffer_size, 1))}")
        nvme_path = os.fspath(nvme_path)
        _preflight(nvme_path, config_key, sum(round_up(n) for n in regions.values()))
        self.aio = aio
        self.buffer_size = min(buffer_size, round_up(max(regions.values())))
        run_id = run_id or f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._root = os.path.join(nvme_path, "zeropp-swap")
        self.directory = os.path.join(self._root, f"{run_id}-rank{rank}")
        _warn_stale(self._root)
        for attempt in range(3):  # another swap space's close() removes an empty zeropp-swap: make it again
            os.makedirs(self._root, exist_ok=True)
            try:
                os.mkdir(self.directory, 0o700)
                break
            except FileExistsError:
                raise ValueError(f"swap directory {self.directory!r} exists: another swap space (or a crashed run) "
                                 f"uses run_id={run_id!r}, rank={rank}; pass another run_id, or delete it if no run "
                                 "uses it")
            except FileNotFoundError:
                if attempt == 2:
                    raise
        self._regions: dict[str, _Region] = {}
        try:
            if direct is False:
                self.direct = False
            else:
                self.direct, reason = direct_io_supported(self.directory)
                if not self.direct and direct:
                    raise SwapError(f"{config_key}={nvme_path!r}: direct=True but {reason}; pass direct=None to "
                                    f"fall back to buffered I/O")
                if not self.direct:
                    warn_buffered(self.directory, reason)
            for index, (key, nbytes) in enumerate(regions.items()):
                path = os.path.join(self.directory, _file_name(index, key))
                os.close(open_file(path, write=True, direct=False, create=True))
                self._regions[key] = _Region(key, nbytes, path, self.buffer_size, aio.block_size)
            self.pinned = pin_memory and torch.cuda.is_available()
            self._pool = _BufferPool(buffer_count, self.buffer_size, self.pinned)
        except BaseException:
            self._remove_files()
            raise
        self._io = AsyncFileIO(aio)
        self._queue: queue.SimpleQueue[SwapHandle | None] = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="zeropp-swap-dispatch", daemon=True)
        self._dispatcher.start()
        self._closed = False

    @property
    def regions(self) -> dict[str, int]:
        """``{key: bytes}`` of every region."""
        return {key: region.nbytes for key, region in self._regions.items()}

    def path(self, key: str) -> str:
        """The file holding region ``key``."""
        return self._region(key).path

    @property
    def peak_buffers_in_use(self) -> int:
        """The most host buffers ever held at once by transfers (at most ``buffer_count``)."""
        return self._pool.peak_in_use

    def write(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing ``tensor`` (contiguous, any device and dtype, exactly the region's bytes) to region ``key``;
        do not modify ``tensor`` until the handle's ``wait()`` returns, which raises ``SwapError`` on failure."""
        return self._submit("write", self._check(key, tensor, "write"), tensor)

    def read(self, key: str, out: torch.Tensor) -> SwapHandle:
        """Start reading region ``key`` into ``out`` (contiguous, any device, the dtype and byte size last written);
        do not use ``out`` until the handle's ``wait()`` returns, which raises ``SwapError`` when the data cannot
        be read back intact (the region's last write failed, the file was deleted, truncated or changed)."""
        region = self._check(key, out, "read")
        if region.dtype is None:
            raise ValueError(f"read of swap region {key!r}: it was never written; write it first")
        if out.dtype != region.dtype:
            raise ValueError(f"read of swap region {key!r} into a {out.dtype} tensor: it holds {region.dtype} data; "
                             f"pass an out tensor of dtype {region.dtype}")
        return self._submit("read", region, out)

    def read_range(self, key: str, start: int, out: torch.Tensor) -> None:
        """Read bytes ``[start, start + out's bytes)`` of region ``key`` into ``out`` (a contiguous CPU tensor of the
        dtype last written) now, on the calling thread, after every operation called on ``key`` before it; every
        ``aio.block_size`` piece it touches is read whole and its CRC-32C checked. For a part of a region without
        the region's whole size in memory (a checkpoint's piece of one parameter); raises ``SwapError`` as ``read``
        does."""
        region = self._check_range(key, start, out)
        if region.last is not None:
            region.last._done.wait()
        if region.checksums is None:
            raise SwapError(f"read of swap region {region.key!r} from {region.path!r}: {region.failure}; its data "
                            f"is lost: write it again (or restart from the last checkpoint)")
        end = start + out.numel() * out.element_size()
        wanted = out.view(-1).view(torch.uint8)
        staging = aligned_buffer(round_up(self.aio.block_size))
        view = memoryview(staging.numpy())
        fd = open_file(region.path, write=False, direct=self.direct)
        try:
            for _, _, pieces in region.chunks:
                for piece in pieces:
                    a, b = max(start, piece.offset), min(end, piece.offset + piece.length)
                    if a >= b:
                        continue
                    pread_full(fd, view[:piece.io_length], piece.offset, region.path)
                    _verify(region, piece, crc32c.crc32c(view[:piece.length]), region.checksums[piece.index])
                    wanted[a - start:b - start].copy_(staging[a - piece.offset:b - piece.offset])
        finally:
            os.close(fd)

    def remove(self, key: str) -> None:
        """Delete region ``key`` and its file, after its last transfer has ended (a failure of that transfer is not
        raised here); later reads and writes of ``key`` raise ``KeyError``."""
        region = self._region(key)
        if region.last is not None:
            try:
                region.last.wait()
            except SwapError:
                pass
        del self._regions[key]
        if os.path.exists(region.path):
            os.unlink(region.path)

    def close(self) -> None:
        """Wait for every transfer, stop the threads, and delete the region files and the directory. Idempotent;
        failures of transfers nobody waited for are not raised here."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._dispatcher.join()
        self._io.close()
        self._remove_files()

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _region(self, key: str) -> _Region:
        try:
            return self._regions[key]
        except KeyError:
            raise KeyError(f"no swap region {key!r}; the regions are {list(self._regions)[:8]}"
                           f"{' ...' if len(self._regions) > 8 else ''}") from None

    def _check(self, key: str, tensor: torch.Tensor, kind: str) -> _Region:
        if self._closed:
            raise ValueError(f"{kind} of swap region {key!r}: the swap space {self.directory!r} is closed")
        region = self._region(key)
        if not tensor.is_contiguous():
            raise ValueError(f"{kind} of swap region {key!r}: the tensor is not contiguous; pass tensor.contiguous()")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != region.nbytes:
            raise ValueError(f"{kind} of swap region {key!r}: the tensor has {nbytes} bytes, the region "
                             f"{region.nbytes}; pass a tensor of exactly the region's size")
        return region

    def _check_range(self, key: str, start: int, out: torch.Tensor) -> _Region:
        if self._closed:
            raise ValueError(f"read of swap region {key!r}: the swap space {self.directory!r} is closed")
        region = self._region(key)
        if out.is_cuda or not out.is_contiguous():
            raise ValueError(f"read_range of swap region {key!r}: out must be a contiguous CPU tensor")
        if region.dtype is not None and out.dtype != region.dtype:
            raise ValueError(f"read_range of swap region {key!r} into a {out.dtype} tensor: it holds "
                             f"{region.dtype} data; pass an out tensor of dtype {region.dtype}")
        nbytes = out.numel() * out.element_size()
        if start < 0 or start + nbytes > region.nbytes:
            raise ValueError(f"read_range of swap region {key!r}: bytes [{start}, {start + nbytes}) are outside the "
                             f"region's [0, {region.nbytes})")
        return region

    def _submit(self, kind: str, region: _Region, tensor: torch.Tensor) -> SwapHandle:
        with self._submit_lock:  # callers on several threads: each key's operations still form one chain
            handle = SwapHandle(kind, region, tensor, region.last)
            region.last = handle
            if kind == "write":
                region.dtype = tensor.dtype
            self._queue.put(handle)
        return handle

    def _dispatch_loop(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            try:
                self._dispatch(handle)
            except BaseException as error:  # the dispatcher must outlive any one transfer
                handle._fail(error)
            finally:
                handle._release()

    def _dispatch(self, handle: SwapHandle) -> None:
        region, write = handle._region, handle._kind == "write"
        if handle._previous is not None:
            handle._previous._done.wait()
        if not write and region.checksums is None:
            raise SwapError(f"read of swap region {region.key!r} from {region.path!r}: {region.failure}; its data "
                            f"is lost: write it again (or restart from the last checkpoint)")
        if handle._ready is not None:
            handle._ready.synchronize()
        handle._fd = open_file(region.path, write=write, direct=self.direct)
        expected = region.checksums
        for start, end, pieces in region.chunks:
            if handle._error is not None:
                return
            buffer = self._pool.acquire()
            handle._add()
            if write:
                staged = self._pool.buffers[buffer]
                staged[:end - start].copy_(handle._bytes[start:end])
                staged[end - start:round_up(end - start)].zero_()
            chunk = _Chunk(self, handle, buffer, start, end, len(pieces))
            for piece in pieces:
                self._io.submit(lambda chunk=chunk, piece=piece: chunk.run(piece, expected))

    def _remove_files(self) -> None:
        for region in self._regions.values():
            if os.path.exists(region.path):
                os.unlink(region.path)
        if os.path.isdir(self.directory):
            try:
                os.rmdir(self.directory)
            except OSError as error:
                raise SwapError(f"removing swap directory {self.directory!r} failed ({error.strerror}): it holds "
                                f"files zeropp did not make: {sorted(os.listdir(self.directory))[:8]}; delete them "
                                f"and the directory by hand") from error
        try:
            os.rmdir(self._root)
        except OSError:  # other runs' or ranks' swap directories are still there
            pass


def _verify(region: _Region, piece: _Piece, got: int, expected: int) -> None:
    """Raise ``SwapError`` unless a piece read back has the CRC-32C recorded when it was written."""
    if got != expected:
        raise SwapError(
            f"read of swap region {region.key!r}: bytes [{piece.offset}, {piece.offset + piece.length}) of "
            f"{region.path!r} do not match the CRC-32C recorded when they were written (expected {expected:#010x}, "
            f"read {got:#010x}): the file was changed by something outside zeropp or the disk returned corrupted "
            f"data. Fix: check the disk (dmesg, smartctl) and keep other programs out of the swap directory; the "
            f"swapped data is lost: restart from the last checkpoint")


class _Chunk:
    """The pieces of one chunk of a transfer, in one pool buffer; the last piece to finish copies the chunk out (a
    read) and frees the buffer."""

    def __init__(self, space: SwapSpace, handle: SwapHandle, buffer: int, start: int, end: int, pieces: int) -> None:
        self.space, self.handle, self.buffer, self.start, self.end = space, handle, buffer, start, end
        self._left = pieces
        self._lock = threading.Lock()

    def run(self, piece: _Piece, expected: list[int] | None) -> None:
        handle, region = self.handle, self.handle._region
        try:
            if handle._error is None:
                at = piece.offset - self.start
                view = self.space._pool.views[self.buffer][at:at + piece.io_length]
                if handle._kind == "write":
                    handle._checksums[piece.index] = crc32c.crc32c(view[:piece.length])
                    pwrite_full(handle._fd, view, piece.offset, region.path)
                else:
                    pread_full(handle._fd, view, piece.offset, region.path)
                    _verify(region, piece, crc32c.crc32c(view[:piece.length]), expected[piece.index])
        except BaseException as error:
            handle._fail(error)
        finally:
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self._finish()

    def _finish(self) -> None:
        handle = self.handle
        try:
            if handle._kind == "read" and handle._error is None:
                handle._bytes[self.start:self.end].copy_(self.space._pool.buffers[self.buffer][:self.end - self.start])
        except BaseException as error:
            handle._fail(error)
        finally:
            self.space._pool.release(self.buffer)
            handle._release()
