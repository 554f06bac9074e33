"""Give the C heap's free pages back to the OS after optimizer steps, when they pile up (CPU training on glibc).

Why. glibc serves allocations below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) to
the size of every mmapped block freed, so after the first steps every flat buffer, quantized pack and gathered unit
of a small model comes from the heap. Buffers that outlive the temporaries allocated after them (the hpZ secondary
shards, forward to step; the qgZ packs and receive buffers of reductions in flight under ``overlap_comm``) leave
free holes the next step's differently sized temporaries do not fit, and glibc returns heap memory to the OS only
from its top. Measured on the small GPT, 2 emulated nodes x 2 ranks, fp32, units freed after every use: exact
ZeRO-3 levels off at 0.65-0.69 GB of peak RSS per rank, while hpZ alone or qgZ alone grows by ~25 MB per step
(0.9-1.0 GB after 21 steps; full ZeRO++ 1.04-1.22 GB after 30), all of it free heap memory: with
``MALLOC_MMAP_THRESHOLD_`` pinned, or with ``malloc_trim(0)`` after each step, hpZ stays at 0.51-0.64 GB and qgZ at
0.59-0.60 GB. ``malloc_trim(0)`` returns the free pages in the middle of the heap too (``madvise``), without
changing how later allocations are served.

But a trim after every step costs more than its few milliseconds: the next step's gathered units, gradients and
packs fault every page back in (about 20 ms of CPU per 43 MB on the 2-core box; with ZeRO++ and weight deltas the
step took 1.033 s trimmed every step, 0.892 s never trimmed).

Policy (``HeapTrim``). After each optimizer step, read the heap's free bytes (``mallinfo2().fordblks``, over all
arenas) and trim only when they have grown more than the bound above their least value since the last trim (and
on the first step, to drop what building the engine freed). malloc still counts a trimmed hole as free (its pages
are gone, not the chunk), so that least value is the reference: what grows past it are holes freed since, whose
pages are resident. Holes a step reuses every step are not growth: in the steady state nothing is trimmed and
nothing faults back in, while fragmentation that grows the heap step after step is trimmed every
bound / growth steps, which keeps resident memory within the bound of its steady level. The bound is
``max(64 MiB, in-use bytes / 4)`` (in use: ``uordblks + hblkhd``): a quarter of what the process holds (RSS rises
at most ~25% over its steady level, and the measured growth of ~25 MB per step at ~0.5 GB in use is trimmed every
~5 steps), at least 64 MiB, above one step's temporaries of a small model (so that a step's own buffers never
count as growth).

Trims every step where the C library has no ``mallinfo2`` (glibc before 2.33), never where it has no
``malloc_trim`` (macOS, musl); the engine does not call it for CUDA training (its tensors are not on the C heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import NamedTuple

# The bound on the free heap a trim waits for: the free bytes may grow this much above their least value since
# the last trim (the module docstring says why these numbers).
TRIM_FLOOR_BYTES = 64 << 20
TRIM_FRACTION_OF_IN_USE = 0.25


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapUsage(NamedTuple):
    """glibc's heap, summed over its arenas (``mallinfo2``), in bytes."""

    in_use: int  # allocated and not freed: from the arenas (uordblks) and mmapped (hblkhd)
    free: int  # freed, held by malloc for reuse (fordblks): resident unless trimmed since


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def heap_usage() -> HeapUsage | None:
    """The C heap's bytes in use and free (``mallinfo2``); None where the C library has no ``mallinfo2`` (glibc
    before 2.33, musl, macOS)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return HeapUsage(in_use=info.uordblks + info.hblkhd, free=info.fordblks)


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (``malloc_trim(0)``); whether the C library could."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


class HeapTrim:
    """When to call ``malloc_trim(0)`` after an optimizer step: when the heap's free bytes have grown more than
    ``max(floor_bytes, fraction * in-use bytes)`` above their least value since the last trim (and on the first
    step, which frees what building the engine left). Without ``mallinfo2`` it trims after every step.

    Attributes: ``steps`` and ``trims``, the calls of ``after_step`` and the trims they made.
    """

    def __init__(self, floor_bytes: int = TRIM_FLOOR_BYTES, fraction: float = TRIM_FRACTION_OF_IN_USE) -> None:
        if floor_bytes < 0 or fraction < 0:
            raise ValueError(f"HeapTrim: floor_bytes={floor_bytes} and fraction={fraction} must be >= 0")
        self.floor_bytes = floor_bytes
        self.fraction = fraction
        self.steps = 0
        self.trims = 0
        self._least_free: int | None = None  # None: trim at the next step

    def bound(self, usage: HeapUsage) -> int:
        """Bytes the free heap may grow above its least value since the last trim before the next trim."""
        return max(self.floor_bytes, int(self.fraction * usage.in_use))

    def after_step(self) -> bool:
        """Trim if the policy says so; whether it did."""
        self.steps += 1
        usage = heap_usage()
        if usage is not None and self._least_free is not None:
            self._least_free = min(self._least_free, usage.free)
            if usage.free - self._least_free <= self.bound(usage):
                return False
        if not release_free_heap():
            return False
        self.trims += 1
        after = heap_usage()
        self._least_free = after.free if after is not None else None
        return True
