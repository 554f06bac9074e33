"""Give the C heap's free pages back to the OS after each optimizer step (CPU training on glibc).

Why. glibc serves allocations below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) to
the size of every mmapped block freed, so after the first steps every flat buffer, quantized pack and gathered unit
of a small model comes from the heap. Buffers that outlive the temporaries allocated after them — the hpZ secondary
shards (forward to step), the qgZ packs and receive buffers of reductions in flight under ``overlap_comm`` — leave
free holes the next step's differently sized temporaries do not fit, and glibc returns heap memory to the OS only
from its top. Measured on the small GPT, 2 emulated nodes x 2 ranks, fp32, units freed after every use: exact
ZeRO-3 levels off at 0.65-0.69 GB of peak RSS per rank, while hpZ alone or qgZ alone grows by ~25 MB per step
(0.9-1.0 GB after 21 steps; full ZeRO++ 1.04-1.22 GB after 30), all of it free heap memory: with
``MALLOC_MMAP_THRESHOLD_`` pinned, or with ``malloc_trim(0)`` after each step, hpZ stays at 0.51-0.64 GB and qgZ at
0.59-0.60 GB. ``malloc_trim`` returns the free pages in the middle of the heap too (``madvise``), without changing
how later allocations are served, so the engine calls it once per optimizer step: a few milliseconds, and pages the
next step touches again are faulted back in.

No-op where the C library has no ``malloc_trim`` (macOS, musl) and for CUDA training (its tensors are not on the C
heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (``malloc_trim(0)``); whether the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
