"""Where ZeRO's states may live besides the accelerator: DeepSpeed's ``zero_optimization.offload_optimizer`` and
``zero_optimization.offload_param`` blocks, its top-level ``aio`` block (the NVMe reads and writes), and zeropp's own
``zero_optimization.zeropp.memory_budget`` (what each key means: the ``zeropp.config`` docstring).

Keys, defaults and meanings are DeepSpeed's (``deepspeed/runtime/zero/offload_config.py`` and
``deepspeed/runtime/swap_tensor/aio_config.py``), with these differences, each an error where DeepSpeed goes on:
``device: "nvme"`` needs ``nvme_path`` (DeepSpeed fails later, joining a null path); ``offload_param`` at stage 1 or 2
(DeepSpeed ignores it: there are no parameter shards to move); the buffer sizes and counts must be positive
(DeepSpeed allows 0); ``ratio`` must be above 0 (DeepSpeed allows 0: nothing offloaded) and, below 1, needs ``device:
"cpu"`` (the partial offload splits the optimizer step between the accelerator and the CPU).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import Problems
from .readers import as_float, as_int, check_fixed, check_keys, get_bool, get_int, is_auto

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""``offload_optimizer.device`` / ``offload_param.device``: ``"none"`` keeps the states on the accelerator."""

_OPTIMIZER_FIXED = {
    "super_offload": (False, "SuperOffload (DeepSpeed's offload for Grace superchips) is not supported"),
}


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (stages 1, 2 and 3): the optimizer states (fp32 master weights,
    moments, fp32 gradient shard) on ``device`` and the optimizer step on the CPU.

    ``nvme_path``: the directory of the swap files with ``device == "nvme"`` (any stage: zeropp swaps the
    optimizer's side unit by unit at every stage, where DeepSpeed documents stage 3 only); ``pin_memory``:
    page-locked host buffers (DeepSpeed's default true since 0.19.5, false before: needed for asynchronous copies at
    full bandwidth); ``buffer_count``: NVMe: how many units' states are in memory at once (and the swap's host
    buffers); ``pipeline_read`` / ``pipeline_write``: overlap the read of the next units / the write of the previous
    ones with the optimizer step of the current one (NVMe); ``fast_init``: with the parameters on NVMe too, write the
    initial NVMe master weights from them in batches instead of one sub-group at a time; ``ratio`` (stage 3,
    ``device == "cpu"``): the fraction of the optimizer states (and of the step) on the CPU, the rest staying on the
    accelerator."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0

    @property
    def enabled(self) -> bool:
        """Whether the optimizer states leave the accelerator (``device`` is not ``"none"``)."""
        return self.device != "none"

    @property
    def nvme(self) -> bool:
        return self.device == "nvme"

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived switch: the NVMe swapper that overlaps reads or writes with the step."""
        return self.pipeline_read or self.pipeline_write

    @property
    def partial(self) -> bool:
        """Whether only part (``ratio`` < 1) of the optimizer states goes to the CPU."""
        return self.enabled and self.ratio < 1.0

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems, stage: int | None) -> OffloadOptimizerConfig:
        """Read the block; ``stage`` is the ZeRO stage (``None`` when it did not parse: no stage rule is checked)."""
        w = "zero_optimization.offload_optimizer"
        valid = ["device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write", "fast_init",
                 "ratio", "cpuadam_cores_perc", *_OPTIMIZER_FIXED]
        check_keys(p, block, w, valid)
        check_fixed(p, block, w, _OPTIMIZER_FIXED)
        if "cpuadam_cores_perc" in block:  # sizes SuperOffload's CPU Adam only: checked, no effect
            _fraction(p, block["cpuadam_cores_perc"], f"{w}.cpuadam_cores_perc", above_zero=False)
        d = cls()
        device = _device(p, block, w)
        name = f"{w}.device"
        ratio = d.ratio
        if "ratio" in block:
            ratio = _fraction(p, block["ratio"], f"{w}.ratio", above_zero=True, fallback=d.ratio)
        if ratio < 1.0 and device != "none" and p.ok(name):
            if stage in (1, 2):
                p.add(f"{w}.ratio", f"{w}.ratio={ratio:g}: partial optimizer offload needs stage 3, as in DeepSpeed; "
                                    "set the stage to 3, or the ratio to 1")
            elif device == "nvme":
                p.add(f"{w}.ratio", f"{w}.ratio={ratio:g}: partial offload keeps the rest of the optimizer states on "
                                    "the accelerator and steps them there, which works with device \"cpu\" only; set "
                                    "the device to \"cpu\", or the ratio to 1")
        return cls(
            device=device,
            nvme_path=_nvme_path(p, block, w, device),
            pin_memory=get_bool(p, block, "pin_memory", w, d.pin_memory),
            buffer_count=get_int(p, block, "buffer_count", w, d.buffer_count, minimum=1),
            pipeline_read=get_bool(p, block, "pipeline_read", w, d.pipeline_read),
            pipeline_write=get_bool(p, block, "pipeline_write", w, d.pipeline_write),
            fast_init=get_bool(p, block, "fast_init", w, d.fast_init),
            ratio=ratio,
        )


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3 only): the 16-bit parameter shards on ``device`` between uses.

    ``nvme_path``: the directory of the swap files with ``device == "nvme"``; ``pin_memory``: page-locked host buffers
    (DeepSpeed's default true since 0.19.5, false before); ``buffer_count`` and ``buffer_size`` (elements): the pool
    of buffers that NVMe reads and writes go through, ``buffer_count`` also the most swapped shards in memory at once
    (DeepSpeed cannot swap a parameter larger than a buffer; zeropp chunks it); ``max_in_cpu`` (elements): with NVMe,
    how many shard elements (the first units') stay in CPU memory, the rest on NVMe
    (``zeropp.engine.param_offload``)."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    @property
    def enabled(self) -> bool:
        """Whether the parameter shards leave the accelerator (``device`` is not ``"none"``)."""
        return self.device != "none"

    @property
    def nvme(self) -> bool:
        return self.device == "nvme"

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems, stage: int | None) -> OffloadParamConfig:
        """Read the block; ``stage`` is the ZeRO stage (``None`` when it did not parse: no stage rule is checked)."""
        w = "zero_optimization.offload_param"
        check_keys(p, block, w, ["device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"])
        d = cls()
        device = _device(p, block, w)
        if device != "none" and stage in (1, 2):
            p.add(f"{w}.device", f"{w}.device={device!r}: parameter offload moves the parameter shards, which exist "
                                 "at stage 3 only (DeepSpeed: valid only with stage 3); set the stage to 3, or the "
                                 "device to \"none\" (offload_optimizer works at every stage)")
        return cls(
            device=device,
            nvme_path=_nvme_path(p, block, w, device),
            pin_memory=get_bool(p, block, "pin_memory", w, d.pin_memory),
            buffer_count=get_int(p, block, "buffer_count", w, d.buffer_count, minimum=1),
            buffer_size=get_int(p, block, "buffer_size", w, d.buffer_size, minimum=1),
            max_in_cpu=get_int(p, block, "max_in_cpu", w, d.max_in_cpu, minimum=0),
        )


DIRECT_IO_ALIGNMENT = 4096
"""Bytes: ``aio.block_size`` is a multiple of it (``zeropp.offload.ALIGNMENT``, the swap files' O_DIRECT unit)."""

_AIO_FIXED = {
    "use_gds": (False, "GPUDirect Storage is not supported"),
}


@dataclass(frozen=True)
class AioConfig:
    """``aio`` (top level): how NVMe swap files are read and written (Linux asynchronous I/O), DeepSpeed's defaults.

    ``block_size`` (bytes): the size of one I/O request; ``queue_depth``: requests in flight; ``intra_op_parallelism``
    (DeepSpeed's older name ``thread_count``): threads sharing one read or write; ``single_submit``: submit requests
    one by one instead of as a batch; ``overlap_events``: submit new requests without waiting for earlier ones to
    complete. Read only with an NVMe offload device."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems) -> AioConfig:
        w = "aio"
        check_keys(p, block, w, ["block_size", "queue_depth", "intra_op_parallelism", "thread_count",
                                 "single_submit", "overlap_events", *_AIO_FIXED])
        check_fixed(p, block, w, _AIO_FIXED)
        d = cls()
        threads_key = "intra_op_parallelism"
        if "thread_count" in block:  # DeepSpeed's name before 0.16.4
            if threads_key in block:
                p.add(f"{w}.thread_count", f"{w}.thread_count is the old name of {w}.{threads_key}; give only one")
            else:
                threads_key = "thread_count"
        block_size = get_int(p, block, "block_size", w, d.block_size, minimum=1)
        if p.ok(f"{w}.block_size") and block_size % DIRECT_IO_ALIGNMENT:
            p.add(f"{w}.block_size", f"{w}.block_size={block_size} must be a multiple of {DIRECT_IO_ALIGNMENT} bytes "
                                     f"(the O_DIRECT alignment of the swap files), e.g. {d.block_size}")
        return cls(
            block_size=block_size,
            queue_depth=get_int(p, block, "queue_depth", w, d.queue_depth, minimum=1),
            intra_op_parallelism=get_int(p, block, threads_key, w, d.intra_op_parallelism, minimum=1),
            single_submit=get_bool(p, block, "single_submit", w, d.single_submit),
            overlap_events=get_bool(p, block, "overlap_events", w, d.overlap_events),
        )


MEMORY_TIERS = ("device", "cpu")
"""The keys of ``zero_optimization.zeropp.memory_budget``; NVMe, the last tier, has no budget (it takes the rest)."""


@dataclass(frozen=True)
class MemoryBudget:
    """``zero_optimization.zeropp.memory_budget``: at most this many bytes per rank of ZeRO states on the accelerator
    (``device``) and in CPU memory (``cpu``); ``None``: no budget given for that tier, the engine uses what it measures
    free there during the first step.

    The engine places each unit's states, from the sizes the first step measured, on the accelerator up to ``device``
    bytes, then in CPU memory up to ``cpu`` bytes, then on NVMe; each kind of state goes no farther than its offload
    block's ``device`` allows (``zeropp.config`` docstring)."""

    device: int | None = None
    cpu: int | None = None

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems) -> MemoryBudget:
        w = "zero_optimization.zeropp.memory_budget"
        nvme = f"{w}.nvme"
        if "nvme" in block:
            p.add(nvme, f"{nvme}: NVMe is the last tier and takes what the device and CPU budgets leave, so it has "
                        "no budget; remove the key and give nvme_path (with device \"nvme\") in "
                        "zero_optimization.offload_optimizer or offload_param")
        check_keys(p, {k: v for k, v in block.items() if k != "nvme"}, w, list(MEMORY_TIERS))
        values: dict[str, int | None] = {}
        for tier in MEMORY_TIERS:
            name = f"{w}.{tier}"
            value = block.get(tier)
            if value is not None:
                value = as_int(p, value, name, minimum=1)
            values[tier] = value if p.ok(name) else None
        return cls(**values)


def offload_consistency(p: Problems, optimizer: OffloadOptimizerConfig, param: OffloadParamConfig,
                        budget: MemoryBudget | None) -> None:
    """The checks between ``memory_budget`` and the offload blocks: a budget needs a block whose device lets some
    state leave the accelerator, and replaces ``offload_optimizer.ratio`` (two ways to split the same states)."""
    w = "zero_optimization.zeropp.memory_budget"
    if budget is None:
        return
    blocks = ("zero_optimization.offload_optimizer", "zero_optimization.offload_param")
    if p.ok(*blocks, *(f"{block}.device" for block in blocks)) and not (optimizer.enabled or param.enabled):
        p.add(w, f"{w} places states beyond the accelerator only as far as the offload blocks allow, and both "
                 "zero_optimization.offload_optimizer.device and offload_param.device are \"none\": set either to "
                 "\"cpu\" (or \"nvme\" with nvme_path), or remove memory_budget")
    if optimizer.partial and p.ok("zero_optimization.offload_optimizer.ratio"):
        p.add("zero_optimization.offload_optimizer.ratio",
              f"zero_optimization.offload_optimizer.ratio={optimizer.ratio:g} fixes how much of the optimizer states "
              f"goes to the CPU, and {w} places them by size: remove one of the two")


def _device(p: Problems, block: Mapping[str, Any], where: str) -> str:
    """``device``: one of ``OFFLOAD_DEVICES`` (absent or null: ``"none"``)."""
    name = f"{where}.device"
    value = block.get("device")
    if value is None or is_auto(p, value, name):
        return "none"
    if value in OFFLOAD_DEVICES:
        return value
    close = difflib.get_close_matches(str(value).lower(), OFFLOAD_DEVICES, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    p.add(name, f"{name}={value!r} must be \"none\", \"cpu\" or \"nvme\"{hint}")
    return "none"


def _nvme_path(p: Problems, block: Mapping[str, Any], where: str, device: str) -> str | None:
    """``nvme_path``: a non-empty path (str or os.PathLike), required with ``device == "nvme"``."""
    name = f"{where}.nvme_path"
    value = block.get("nvme_path")
    if value is None:
        if device == "nvme":
            p.add(name, f"{where}.device=\"nvme\" needs {name}: the directory, on a local NVMe drive, where the "
                        "states are swapped; add it")
        return None
    if is_auto(p, value, name):
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        p.add(name, f"{name}={value!r} must be a non-empty path (a string)")
        return None
    return value


def _fraction(p: Problems, value: Any, name: str, *, above_zero: bool, fallback: float = 0.0) -> float:
    """A number in ``(0, 1]`` (``above_zero``) or ``[0, 1]``."""
    number = as_float(p, value, name, fallback=fallback)
    if not p.ok(name):
        return fallback
    if number > 1.0 or number < 0.0 or (above_zero and number == 0.0):
        low = "above 0" if above_zero else "at least 0"
        p.add(name, f"{name}={number:g} must be a fraction {low} and at most 1")
        return fallback
    return number

