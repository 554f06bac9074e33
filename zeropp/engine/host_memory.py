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

But a trim after every step costs more than its few milliseconds: the next step faults every page of its gathered
units, gradients and packs back in. Measured on the small GPT, 2 emulated nodes x 2 ranks at 1 Gbit/s, fp32 (the
shared 2-core box at load 17-20), ZeRO++ with or without weight deltas: 28,800-35,500 minor page faults per rank
and step (115-145 MB) with a trim after every step, 0-50 with the policy below; CPU time per rank and step 0.30-0.38
s against 0.27-0.34 s (docs/results/engine.md).

Policy (``HeapTrim``). After each optimizer step, read the heap's free bytes (``mallinfo2().fordblks``, over all
arenas; 0.03-0.15 ms) and trim only when they exceed their least value since the last trim by more than the bound
(and on the first step, for what building the engine freed). malloc still counts a trimmed hole as free (its pages
are gone, not the chunk), hence the least value as the reference. In the steady state a step reuses the holes the
step before it freed: the free bytes stay flat, nothing is trimmed and nothing faults back in. The heap holds its
in-use plus free bytes (resident at worst), and the free bytes cannot grow by more than the bound without a trim:
resident heap memory stays under the in-use bytes plus the free bytes left at the last trim plus the bound. That
is a bound on the heap's growth between trims, not on RSS over a heap trimmed every step: where fragmentation grows
the heap step after step, the steps between two trims touch again holes an earlier trim released (hpZ alone, every
unit gathered at each use: trims every 5-7 steps, RSS after a step swinging between ~0.44 and ~0.73 GB, peak RSS
0.80-0.82 GB after 30 steps and still creeping 0.3-3.2 MB per step, against 0.67-0.70 GB trimmed every step and
0.98-1.16 GB never trimmed, growing 7.7-12.6 MB per step; docs/results/engine.md). The bound is
``max(64 MiB, in-use bytes / 4)`` (in use: ``uordblks + hblkhd``): a quarter of what the heap holds for the
process, so that the 1-3 MB per step the weight-delta tier's heap drifts by is trimmed every few dozen steps and
the ~14 MB per step of hpZ alone every few; at least 64 MiB, more than one step's own temporaries of a small model,
which must not count as growth.

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
