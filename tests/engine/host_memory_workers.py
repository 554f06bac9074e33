"""Workers for test_host_memory.py: the small GPT trained on one gloo rank, every unit gathered afresh at each use,
with the engine's heap-trim policy, and with ``malloc_trim(0)`` after every step as well (the policy before it)."""

from __future__ import annotations

import ctypes
import resource

from engine_workers import text_batches

import zeropp
from zeropp.engine import host_memory
from zeropp.models import GPT, GPTConfig


def rss_anon() -> int:
    """Bytes of anonymous memory resident in this process (``RssAnon`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def steady_state(rank: int, world: int, steps: int, trim_every_step: bool) -> dict:
    """Train ``steps`` steps; per step the resident anonymous bytes after it, the minor page faults during it and
    the policy's bound (bytes), and the engine's trims in all."""
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = GPT(GPTConfig.preset("small", block_size=64), seed=0)
    engine, _, _, _ = zeropp.initialize(model=model, config=config)
    rss, faults, bounds = [], [], []
    for inputs, targets in text_batches(steps, 2, seed=7):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _, loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        if trim_every_step:
            host_memory.release_free_heap()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        rss.append(rss_anon())
        bounds.append(engine.heap_trim.bound(host_memory.heap_usage()))
    return {"rss": rss, "faults": faults, "bounds": bounds, "trims": engine.heap_trim.trims}


MiB = 1 << 20


def _libc() -> ctypes.CDLL:
    """The C library with ``malloc`` and ``free`` typed for pointers."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _holes(nbytes: int) -> list[int]:
    """Allocate twice ``nbytes`` in 64 KiB blocks (under glibc's smallest mmap threshold: from the heap), write every
    page, then free every other block: ``nbytes`` of holes between blocks still held, which are returned."""
    libc = _libc()
    blocks = []
    for _ in range(2 * nbytes // (64 << 10)):
        block = libc.malloc(64 << 10)
        assert block, "malloc failed"
        ctypes.memset(block, 1, 64 << 10)
        blocks.append(block)
    for block in blocks[::2]:
        libc.free(block)
    return blocks[1::2]


def holes_trim(rank: int, world: int) -> dict:
    """A ``HeapTrim`` with a 32 MiB bound over holes punched in this process's heap: what each ``after_step`` did
    and the resident anonymous bytes around the second and third (test_host_memory asserts)."""
    trim = host_memory.HeapTrim(floor_bytes=32 * MiB, fraction=0.0)
    got = {"first": trim.after_step(), "bound": trim.bound(host_memory.heap_usage())}
    kept = _holes(8 * MiB)
    before = rss_anon()
    got["small"] = trim.after_step()
    got["rss_small"] = (before, rss_anon())
    kept += _holes(64 * MiB)
    before = rss_anon()
    got["big"] = trim.after_step()
    got["rss_big"] = (before, rss_anon())
    got["steps"], got["trims"] = trim.steps, trim.trims
    got["again"] = trim.after_step()
    libc = _libc()
    for block in kept:
        libc.free(block)
    return got
