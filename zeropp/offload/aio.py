"""Asynchronous file I/O for the NVMe tier: aligned host buffers, O_DIRECT files, a pool of I/O threads.

Backend. A ``concurrent.futures.ThreadPoolExecutor`` of ``intra_op_parallelism * queue_depth`` threads, each issuing
blocking ``os.pwrite`` / ``os.preadv`` calls (they release the GIL), so at most ``queue_depth`` requests per
thread of the ``aio`` config are in flight at the device. Callers split their transfers into ``block_size``
pieces (``AioSettings``) and submit one piece per task (``AsyncFileIO.submit``).

Alignment. Files are opened with ``O_DIRECT`` (no page cache: the host memory stays bounded by the caller's
buffers and the measured rates are the device's). ``O_DIRECT`` needs the buffer address, the file offset and the
length to be multiples of the device's logical block size (512 or 4096); everything here uses ``ALIGNMENT`` =
4096, which satisfies both. torch's CPU allocator aligns to 64 bytes only, so ``aligned_buffer`` over-allocates
by ``ALIGNMENT`` and slices. Where a filesystem refuses ``O_DIRECT`` (some overlay and network filesystems),
``direct_io_supported`` says why and the caller falls back to buffered I/O (``warn_buffered`` warns once per
filesystem).

Errors. Every failure is a ``SwapError`` whose message names the file, the byte offset, what happened and what to
do (``io_error``): no space (ENOSPC, EDQUOT, EFBIG), device errors (EIO), a file deleted (ENOENT) or truncated
(a short read) behind zeropp's back.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

ALIGNMENT = 4096
"""Bytes: the address, file offset and length alignment of every ``O_DIRECT`` transfer (a multiple of both
common logical block sizes, 512 and 4096)."""


class SwapError(RuntimeError):
    """A failure of the offload storage: the message names the path, the byte offset where it applies, what
    happened and what to do."""


def round_up(nbytes: int, multiple: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``multiple``."""
    return -(-nbytes // multiple) * multiple


@dataclass(frozen=True)
class AioSettings:
    """DeepSpeed's ``aio`` block (parsed by ``zeropp.config``'s ``AioConfig``), as far as this backend has a use for
    it.

    * ``block_size``: bytes per I/O request (a transfer is split into pieces of this size); a multiple of
      ``ALIGNMENT``. DeepSpeed's default, 1 MiB.
    * ``queue_depth``: requests in flight per thread (8).
    * ``intra_op_parallelism``: threads (DeepSpeed's older name: ``thread_count``; 1); this backend runs
      ``intra_op_parallelism * queue_depth`` blocking I/O threads in all.

    DeepSpeed's ``single_submit`` and ``overlap_events`` choose how libaio batches submissions and waits for
    completions; a pool of blocking threads submits every request on its own as soon as a thread is free, which is
    ``single_submit=false, overlap_events=true``'s behaviour, so they have no counterpart here.
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % ALIGNMENT:
            raise ValueError(f"aio.block_size={self.block_size}: must be a positive multiple of {ALIGNMENT} bytes "
                             f"(O_DIRECT alignment), e.g. {1 << 20}")
        for name in ("queue_depth", "intra_op_parallelism"):
            if getattr(self, name) < 1:
                raise ValueError(f"aio.{name}={getattr(self, name)}: must be at least 1")

    @property
    def workers(self) -> int:
        """The number of I/O threads: ``intra_op_parallelism * queue_depth``."""
        return self.intra_op_parallelism * self.queue_depth


def aligned_buffer(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``round_up(nbytes)`` bytes whose address is a multiple of ``ALIGNMENT``, in page-
    locked memory if ``pin_memory`` (needs CUDA). It is a slice of a larger allocation, which it keeps alive."""
    size = round_up(nbytes)
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA (page-locked memory is for copies to and from a GPU); "
                         "pass pin_memory=False on a CPU-only machine")
    raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip:skip + size]


def io_error(operation: str, path: str, offset: int, nbytes: int, error: OSError) -> SwapError:
    """A ``SwapError`` for ``error`` raised by ``operation`` (``"read"``, ``"write"``, or ``"open ..."``, which
    ignores ``offset`` and ``nbytes``) of ``nbytes`` bytes at byte ``offset`` of ``path``, saying what to do."""
    code = error.errno
    where = (f"{operation} of {path!r}" if operation.startswith("open") else
             f"{operation} of {nbytes} bytes at offset {offset} of {path!r}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        what = "the filesystem is full (or the user's quota is spent)"
        fix = f"free space on the filesystem holding {os.path.dirname(path)!r} or point nvme_path at a larger disk"
    elif code == errno.EFBIG:
        what = "the file would exceed the largest file size allowed (a file-size limit, ulimit -f, or the filesystem)"
        fix = "raise the limit (ulimit -f unlimited) or point nvme_path at a filesystem that allows larger files"
    elif code == errno.EIO:
        what = "the device reported an I/O error"
        fix = ("check the disk (dmesg, smartctl); the swapped data is lost: restart from the last checkpoint, "
               "on another disk if the error repeats")
    elif code == errno.ENOENT:
        what = "the file was deleted by something outside zeropp (a tmp cleaner, another job, a user)"
        fix = ("keep other programs out of nvme_path's zeropp-swap directory while training runs; the swapped data "
               "is lost: restart from the last checkpoint")
    else:
        what = f"{errno.errorcode.get(code, code)}: {error.strerror}"
        fix = "check the filesystem holding nvme_path and the process's permissions and limits on it"
    return SwapError(f"{where} failed: {what}. Fix: {fix}")


def pwrite_full(fd: int, data: memoryview, offset: int, path: str) -> None:
    """Write all of ``data`` at byte ``offset`` of the open file ``fd`` (``path`` names it in errors), repeating
    after short writes; raises ``SwapError``."""
    done = 0
    while done < len(data):
        try:
            written = os.pwrite(fd, data[done:], offset + done)
        except OSError as error:
            raise io_error("write", path, offset + done, len(data) - done, error) from error
        if written == 0:
            raise io_error("write", path, offset + done, len(data) - done, OSError(errno.ENOSPC, "wrote 0 bytes"))
        done += written


def pread_full(fd: int, out: memoryview, offset: int, path: str) -> None:
    """Fill ``out`` from byte ``offset`` of the open file ``fd`` (``path`` names it in errors); a file that ends
    before ``offset + len(out)`` (truncated since it was written) raises ``SwapError``."""
    done = 0
    while done < len(out):
        try:
            got = os.preadv(fd, [out[done:]], offset + done)
        except OSError as error:
            raise io_error("read", path, offset + done, len(out) - done, error) from error
        if got < len(out) - done:
            size = os.fstat(fd).st_size
            if size < offset + len(out):
                raise SwapError(
                    f"read of {len(out)} bytes at offset {offset} of {path!r} failed: short read, the file ends at "
                    f"byte {size} but this region needs bytes up to {offset + len(out)}: it was truncated by "
                    f"something outside zeropp since it was written. Fix: keep other programs out of nvme_path's "
                    f"zeropp-swap directory while training runs; the swapped data is lost: restart from the last "
                    f"checkpoint")
        done += got


def open_file(path: str, *, write: bool, direct: bool, create: bool = False) -> int:
    """Open ``path`` for reading or for writing (``create``: also create or truncate it), with ``O_DIRECT`` if
    ``direct``; raises ``SwapError``."""
    flags = (os.O_WRONLY if write else os.O_RDONLY) | (os.O_CREAT | os.O_TRUNC if create else 0)
    flags |= os.O_DIRECT if direct else 0
    try:
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as error:
        raise io_error("open for " + ("writing" if write else "reading"), path, 0, 0, error) from error


def direct_io_supported(directory: str) -> tuple[bool, str]:
    """Whether the filesystem holding ``directory`` accepts an ``O_DIRECT`` write and read of one aligned block,
    and if not, why (the error). Creates and removes a probe file there."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this operating system has no O_DIRECT"
    path = os.path.join(directory, f".zeropp-direct-probe-{os.getpid()}-{threading.get_ident()}")
    block = aligned_buffer(ALIGNMENT)
    view = memoryview(block.numpy())
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, view, 0)
            os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise io_error("O_DIRECT probe", path, 0, ALIGNMENT, error) from error
        return False, f"the filesystem refused O_DIRECT ({error.strerror})"
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return True, ""


_warned_devices: set[int] = set()


def warn_buffered(directory: str, reason: str) -> None:
    """Warn, once per filesystem, that files under ``directory`` use buffered I/O because of ``reason``."""
    device = os.stat(directory).st_dev
    if device not in _warned_devices:
        _warned_devices.add(device)
        warnings.warn(f"zeropp offload: buffered I/O under {directory!r}: {reason}; the page cache then holds a "
                      f"copy of the swapped data (host memory beyond the swap buffers) and rates are not the disk's",
                      RuntimeWarning, stacklevel=3)


class AsyncFileIO:
    """A pool of ``config.workers`` I/O threads; ``submit`` runs a function (one piece's transfer) on it.

    The caller owns buffers and file descriptors: it must keep both alive until the returned future is done."""

    def __init__(self, config: AioSettings) -> None:
        self.config = config
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="zeropp-aio")

    def submit(self, fn: Callable[[], None]) -> Future:
        """Run ``fn`` on an I/O thread."""
        return self._pool.submit(fn)

    def close(self) -> None:
        """Wait for the submitted work and stop the threads."""
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class DiskRates:
    """Sequential rates of one file on a disk, in bytes per second; ``direct``: measured with ``O_DIRECT`` (else
    through the page cache, which the read rate then reflects)."""

    write_bytes_per_s: float
    read_bytes_per_s: float
    direct: bool


def measure_disk(path: str, nbytes: int, *, request_bytes: int = 8 << 20, in_flight: int = 8) -> DiskRates:
    """The raw sequential write and read rates of the filesystem holding the directory ``path``: one file of
    ``nbytes`` (rounded up to ``request_bytes``) written then read in ``request_bytes`` requests, ``in_flight`` at a
    time, with ``O_DIRECT`` where the filesystem allows it (no fsync: like SwapSpace's, the writes are
    complete when the device accepts them). The file is removed after."""
    if request_bytes % ALIGNMENT or request_bytes <= 0:
        raise ValueError(f"request_bytes={request_bytes}: must be a positive multiple of {ALIGNMENT}")
    direct, _ = direct_io_supported(path)
    total = round_up(max(nbytes, 1), request_bytes)
    offsets = range(0, total, request_bytes)
    buffers = [aligned_buffer(request_bytes) for _ in range(in_flight)]
    buffers[0].copy_(torch.randint(0, 256, (request_bytes,), dtype=torch.uint8))
    for i, buffer in enumerate(buffers[1:], 1):  # distinct contents, cheaply
        torch.bitwise_xor(buffers[0], i, out=buffer)
    # Requests i and i + in_flight may share a buffer at once: harmless, the data read back is not looked at.
    views = [memoryview(buffer.numpy()) for buffer in buffers]
    file = os.path.join(path, f".zeropp-measure-disk-{os.getpid()}-{threading.get_ident()}")
    pool = ThreadPoolExecutor(max_workers=in_flight)
    try:
        fd = open_file(file, write=True, direct=direct, create=True)
        try:
            start = time.perf_counter()
            list(pool.map(lambda i: pwrite_full(fd, views[i % in_flight], offsets[i], file), range(len(offsets))))
            write_s = time.perf_counter() - start
        finally:
            os.close(fd)
        fd = open_file(file, write=False, direct=direct)
        try:
            start = time.perf_counter()
            list(pool.map(lambda i: pread_full(fd, views[i % in_flight], offsets[i], file), range(len(offsets))))
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        pool.shutdown()
        if os.path.exists(file):
            os.unlink(file)
    return DiskRates(total / write_s, total / read_s, direct)
