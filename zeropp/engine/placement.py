"""``zero_optimization.zeropp.memory_budget``: in which tier each unit's optimizer side lives, chosen from what the
first step measured (PatrickStar's and Colossal-AI Gemini's idea: place states by measured memory, not by hand).

Tiers, nearest first: ``"device"`` (the compute device's memory), ``"cpu"`` (host memory), ``"nvme"`` (swap files,
``zeropp.engine.offload``). A unit's optimizer side is ``S`` elements of fp32 master, fp32 gradient shard and ``K``
optimizer state kinds (Adam 2, SGD with momentum 1). Per rank it costs, in bytes:

* ``"device"``: ``(2 + K) * 4 S`` of device memory; ``"cpu"``: the same of host memory;
* ``"nvme"``: ``(1 + K) * 4 S`` on disk (master and state kinds), the gradient shard's ``4 S`` in host memory, and,
  shared by all NVMe units, the step's staging in host memory: the ``buffer_count`` largest NVMe units' ``(1 + K) *
  4 S`` (in memory while stepped) plus the swap's buffer pool (``buffer_count`` buffers of the largest region, at
  most ``zeropp.offload.swap.BUFFER_SIZE``).

Room. A memory tier's room for these states is its budget less the other ZeRO states there that the budget does not
place: the stage-3 compute-dtype parameter shards (on the device, or in host memory with ``offload_param: cpu``,
where they stay: this build places only the optimizer side by size). A tier without a budget: what the first step
left free there at its peak, plus the optimizer states the tier held then (they are what gets placed) — host memory:
``MemAvailable`` less what this process's resident set has shrunk since its peak (``VmHWM - VmRSS``), split evenly
between the ranks on the host; CUDA: the driver's free memory plus what torch's allocator holds unused, less the
step's peak (``torch.cuda.max_memory_allocated``). Every rank places with the smallest room any rank found, so all
ranks choose the same tiers.

On a CPU compute device the device's memory is host memory: ``"device"`` and ``"cpu"`` are one pool, called
``"device"`` in the plan (``"cpu"`` gets nothing), whose budget is the smaller of the two given (each bounds the same
memory) and which holds the NVMe units' host memory too.

The rule (``place``): a unit may go as far as ``offload_optimizer.device`` allows (``"none"``: the device only,
``"cpu"``: device or CPU, ``"nvme"``: all three); the first step runs with every unit in that farthest tier. The
device's room is filled first, first fit in unit order (a unit there takes no host memory); the other units start
in the farthest tier, and if that does not fit, ``PlacementError`` names the bytes (a state is never spilled past
its offload block's device). Then each of them in turn (unit order) moves to CPU memory (with ``"nvme"``) when it
fits there together with every other unit where it is. On a CPU compute device the pool is filled the same way,
units in order, each on the device when it fits with the rest on NVMe.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..offload.aio import round_up
from ..offload.swap import BUFFER_SIZE

TIERS = ("device", "cpu", "nvme")
"""Nearest first. ``"device"`` and ``"cpu"`` are memory tiers with a room; ``"nvme"`` takes the rest."""

_KEY = "zero_optimization.zeropp.memory_budget"


class PlacementError(ConfigError):
    """The optimizer states fit in no tier the offload block allows within ``memory_budget``: raised at the first
    step, naming the bytes needed and the room."""


@dataclass(frozen=True)
class UnitStates:
    """One unit's optimizer side, bytes per rank: ``swapped`` (fp32 master and optimizer state kinds: what NVMe
    holds) and ``grad`` (the fp32 gradient shard, in memory on every tier)."""

    swapped: int
    grad: int

    @property
    def total(self) -> int:
        return self.swapped + self.grad


@dataclass(frozen=True)
class Placement:
    """What ``place`` chose. ``tiers``: each unit's tier, in unit order; ``room``: bytes the placed states may use
    in each memory tier; ``used``: the bytes they use per tier (``"nvme"``: on disk); ``sources``: for each memory
    tier, ``"budget"`` or ``"measured"`` (the first step's free memory); ``fixed``: the parameter-shard bytes taken
    from a budget; ``shared``: ``"device"`` and ``"cpu"`` are one memory (a CPU compute device)."""

    tiers: tuple[str, ...]
    room: dict[str, int]
    used: dict[str, int]
    sources: dict[str, str]
    fixed: dict[str, int]
    shared: bool

    def units_in(self, tier: str) -> list[int]:
        """The indices of the units placed in ``tier``."""
        return [u for u, t in enumerate(self.tiers) if t == tier]

    def describe(self) -> str:
        """One line per tier: units, bytes, room and where the room came from."""
        lines = [f"{_KEY}: the optimizer states of {len(self.tiers)} units, placed from the first step"
                 f"{' (CPU compute device: device and cpu are one memory)' if self.shared else ''}:"]
        for tier in TIERS:
            if tier == "cpu" and self.shared:
                continue
            line = f"  {tier:<6} {len(self.units_in(tier)):>4} units, {_mb(self.used[tier])}"
            if tier in self.room:
                line += f" of {_mb(self.room[tier])} ({self.sources[tier]}"
                line += f", less {_mb(self.fixed[tier])} of parameter shards)" if self.fixed.get(tier) else ")"
            else:
                line += " on disk"
            lines.append(line)
        return "\n".join(lines)


def usage(tiers: Sequence[str], units: Sequence[UnitStates], *, buffer_count: int, shared: bool) -> dict[str, int]:
    """Bytes per rank that ``units`` use in each tier when placed in ``tiers`` (module docstring); ``shared``: the
    host memory of ``"cpu"`` and NVMe is counted in ``"device"``."""
    used = dict.fromkeys(TIERS, 0)
    swapped = []
    for tier, unit in zip(tiers, units, strict=True):
        if tier == "nvme":
            used["nvme"] += unit.swapped
            used["cpu"] += unit.grad
            if unit.swapped:
                swapped.append(unit)
        else:
            used[tier] += unit.total
    if swapped:
        used["cpu"] += sum(u.swapped for u in heapq.nlargest(buffer_count, swapped, key=lambda u: u.swapped))
        used["cpu"] += buffer_count * min(BUFFER_SIZE, round_up(max(u.grad for u in swapped)))
    if shared:
        used["device"] += used["cpu"]
        used["cpu"] = 0
    return used


def rooms(budget: Mapping[str, int | None], *, fixed: Mapping[str, int], free: Mapping[str, int],
          shared: bool) -> tuple[dict[str, int], dict[str, str]]:
    """Each memory tier's room for the optimizer states (bytes per rank) and its source: ``budget[tier]`` (``None``:
    not given) less ``fixed[tier]`` (parameter shards there), or, without a budget, ``free[tier]`` (measured, the
    states already counted free). ``shared``: one pool, ``"device"``, the smaller given budget less all the fixed
    bytes, else ``free["device"]``."""
    if shared:
        given = [b for b in (budget.get("device"), budget.get("cpu")) if b is not None]
        if given:
            return {"device": min(given) - fixed.get("device", 0) - fixed.get("cpu", 0)}, {"device": "budget"}
        return {"device": free["device"]}, {"device": "measured"}
    room, sources = {}, {}
    for tier in ("device", "cpu"):
        b = budget.get(tier)
        room[tier] = free[tier] if b is None else b - fixed.get(tier, 0)
        sources[tier] = "measured" if b is None else "budget"
    return room, sources


def place(units: Sequence[UnitStates], *, farthest: str, room: Mapping[str, int], buffer_count: int,
          shared: bool) -> tuple[str, ...]:
    """Each unit's tier (module docstring's rule): ``farthest`` is ``offload_optimizer.device`` as a tier
    (``"device"`` for ``"none"``); ``room``: bytes per memory tier (``rooms``; ``shared``: ``"device"`` only).

    Raises:
        PlacementError: every unit in ``farthest`` still needs more than some tier's room (the message names the
            bytes of each tier and what to change).
    """
    if farthest not in TIERS:
        raise ValueError(f"farthest={farthest!r} must be one of {TIERS}")
    allowed = [t for t in TIERS[: TIERS.index(farthest) + 1] if not (shared and t == "cpu")] or ["device"]
    memory = ["device"] if shared else ["device", "cpu"]

    def over(plan: Sequence[str]) -> dict[str, tuple[int, int]]:
        used = usage(plan, units, buffer_count=buffer_count, shared=shared)
        return {t: (used[t], room[t]) for t in memory if used[t] > room[t]}

    plan = [allowed[-1]] * len(units)
    nearer = allowed[:-1]
    if not shared and nearer:  # the device first: a unit there takes no host memory
        on_device = 0
        for u, unit in enumerate(units):
            if on_device + unit.total <= room["device"]:
                plan[u] = "device"
                on_device += unit.total
        nearer = nearer[1:]
    too_much = over(plan)
    if too_much:
        raise PlacementError(_no_fit(too_much, farthest, shared))
    for u in range(len(units)):
        if plan[u] != allowed[-1]:
            continue
        for tier in nearer:
            trial = plan[:u] + [tier] + plan[u + 1 :]
            if not over(trial):
                plan = trial
                break
    return tuple(plan)


def _no_fit(too_much: Mapping[str, tuple[int, int]], farthest: str, shared: bool) -> str:
    device = {"device": "none", "cpu": "cpu", "nvme": "nvme"}[farthest]
    parts = [f"{need} bytes per rank of {'host' if shared or tier == 'cpu' else 'device'} memory, which has room for "
             f"{have}" for tier, (need, have) in too_much.items()]
    further = ("" if farthest == "nvme" else
               ", or let them go further: zero_optimization.offload_optimizer.device=\"nvme\" with an nvme_path")
    what = "the NVMe units' gradient shards and staging buffers" if farthest == "nvme" else "the optimizer states"
    return (f"{_KEY}: the optimizer states fit in no tier allowed: with every unit's states as far as "
            f"offload_optimizer.device={device!r} allows, {what} take {'; and '.join(parts)} (the room is the "
            f"budget less the parameter shards there, or without a budget what the first step left free); raise "
            f"{_KEY}.{'device' if shared else 'cpu' if 'cpu' in too_much else 'device'}{further}")


def choose(engine: Any) -> Placement:
    """The placement for ``engine`` (a ``ZeroEngine`` right after its first step, every unit still in the farthest
    tier): its units' sizes, the parameter shards a budget is charged with and, for a tier without a budget, what
    the step left free there (measured on every rank; the smallest wins: one gather of host names and one small
    all-reduce). Every rank calls it and gets the same tiers."""
    zero = engine.config.zero_optimization
    budget = zero.zeropp.memory_budget
    kinds = len(engine.optimizer.state)
    units = [UnitStates(swapped=u.master.numel() * u.master.element_size() * (1 + kinds),
                        grad=u.grad_shard.numel() * u.grad_shard.element_size()) for u in engine.units]
    shared = engine.device.type == "cpu"
    buffer_count = zero.offload_optimizer.buffer_count
    shards = 0
    if engine.stage == 3:
        for unit in engine.units:
            for part in (unit, unit.frozen):
                if part is not None:
                    shards += part.shard.numel() * part.shard.element_size()
    fixed = {"cpu" if engine.param_offload.enabled else "device": shards}
    given = {"device": budget.device, "cpu": budget.cpu}
    free = {"device": 0, "cpu": 0}
    if (all if shared else any)(b is None for b in given.values()):
        held = usage(engine.offload.tiers, units, buffer_count=0, shared=shared)  # the states, staging aside
        world, rank = engine.comm.world_size, engine.comm.rank
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, engine.topology.host, group=engine.topology.group)
        host = host_free_bytes(hosts.count(engine.topology.host))
        mine = [host + held["device"], 0] if shared else [cuda_free_bytes(engine.device) + held["device"],
                                                          host + held["cpu"]]
        every = torch.zeros(world, 2, dtype=torch.float64, device=engine.device)
        every[rank] = torch.tensor(mine, dtype=torch.float64)
        least = engine.comm.all_reduce_sum(every.view(-1)).view(world, 2).min(0).values.tolist()
        free = {"device": int(least[0]), "cpu": int(least[1])}
    room, sources = rooms(given, fixed=fixed, free=free, shared=shared)
    farthest = {"none": "device", "cpu": "cpu", "nvme": "nvme"}[zero.offload_optimizer.device]
    tiers = place(units, farthest=farthest, room=room, buffer_count=buffer_count, shared=shared)
    return Placement(tiers=tiers, room=room, used=usage(tiers, units, buffer_count=buffer_count, shared=shared),
                     sources=sources, fixed=fixed, shared=shared)


def host_free_bytes(ranks_on_host: int) -> int:
    """Host memory free for this rank at the peak so far: ``MemAvailable`` less what this process's resident set has
    shrunk since its peak (``VmHWM - VmRSS``, ``/proc/self/status``), over the ``ranks_on_host`` ranks sharing the
    host."""
    meminfo = _proc_kb("/proc/meminfo", ("MemAvailable",))
    status = _proc_kb("/proc/self/status", ("VmHWM", "VmRSS"))
    free = meminfo["MemAvailable"] - (status["VmHWM"] - status["VmRSS"])
    return max(0, free) * 1024 // max(1, ranks_on_host)


def cuda_free_bytes(device: torch.device) -> int:
    """CUDA memory free for this rank at the step's peak: the driver's free memory plus what torch's allocator
    reserves unused, less the peak allocated (``torch.cuda.max_memory_allocated``)."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device))


def _proc_kb(path: str, names: Sequence[str]) -> dict[str, int]:
    """``name: <n> kB`` lines of a ``/proc`` file."""
    out: dict[str, int] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in names:
                    out[name] = int(rest.split()[0])
    missing = [n for n in names if n not in out]
    if missing:
        raise RuntimeError(f"{_KEY} without a host budget measures free host memory from {path}, which has no "
                           f"{missing}: give {_KEY}.cpu (and device) in bytes instead")
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
