"""Predict one plan's step time and memory, and rank the plans of a cluster.

Step time = compute + quantization kernels + exposed communication (per link class) + optimizer + offload I/O.

Overlap (the assumption): a micro-batch's forward takes 1/3 of its compute and its backward 2/3. The forward's
gathers hide under the forward compute (prefetch) and the backward's gathers and gradient reduce-scatters under the
backward compute (``overlap_comm``), except the first gather of each forward and the last reduction of each
backward, which nothing can hide; one process group runs its collectives one after another, so a phase's
communication is the sum of its calls. The calls bounded by the inter-node link hide under up to
``Cluster.overlap`` of the compute, those bounded by the intra-node link under up to ``Cluster.intra_overlap`` of
it less what the inter-node calls already took (equal fractions: ``overlap`` of the compute hides the phase's
total, as with one class). The collectives at the end of the accumulation window
(ZeRO-1's reduction, MiCS's cross-group all-reduce), after the step (stages 1 and 2's gathers, weight deltas) and
the quantization kernels (on the compute stream) are exposed. The optimizer is memory-bound: AdamW reads and writes
``28 + b`` bytes per element it steps (master, two moments, gradient; the new compute-dtype weight), on the device,
or on the host when offloaded, plus the gradient down and the weight up over ``host_bw`` (and for NVMe the three
float32 states read and written over ``nvme_bw``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster
from .cost import call_time, kernel_time
from .memory import memory
from .model import ModelSpec
from .space import Plan, plans
from .traffic import Collective, Layout, alignment, collectives, shard_numel, totals
from .units import duration

COMPONENTS = ("compute", "quant", "comm_intra", "comm_inter", "optimizer", "io")
"""The parts of a predicted step time, in seconds."""


@dataclass(frozen=True)
class Batch:
    """Per-rank batch: ``micro`` sequences of ``seq`` tokens per micro-batch, ``accum`` micro-batches per step,
    parameters and gradients in a compute dtype of ``dtype_bytes`` (2: bf16/fp16, 4: fp32)."""

    micro: int = 1
    seq: int = 2048
    accum: int = 1
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("micro", "seq", "accum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"batch {name}={v!r} must be a positive integer")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes={self.dtype_bytes!r} must be 2 (bf16/fp16) or 4 (fp32)")


@dataclass
class Prediction:
    """What the planner predicts for one plan (times in seconds, memory and bytes per rank)."""

    plan: Plan
    label: str
    step_time: float
    breakdown: dict[str, float]
    memory: dict[str, int]
    fits: bool
    unsupported: str | None
    traffic: dict[str, dict[str, int]]
    calls: int
    config: dict[str, Any] | None = field(default=None)

    @property
    def memory_total(self) -> int:
        return sum(self.memory.values())

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.label, "step_time_s": self.step_time, "breakdown_s": self.breakdown,
                "memory_bytes": {**self.memory, "total": self.memory_total}, "fits": self.fits,
                "runs_today": self.unsupported is None, "why_not": self.unsupported,
                "bytes_per_step": self.traffic, "collective_calls": self.calls, "zero_optimization": self.config}


def _phase(colls: list[Collective], cluster: Cluster, compute: float, unhidden: float) -> dict[str, float]:
    """Exposed seconds per link class of one overlappable phase (module docstring): of the time beyond the
    ``unhidden`` part (taken from each class in proportion), the inter-node calls' hides under ``overlap *
    compute``, the intra-node calls' under what is left of ``intra_overlap * compute``; the exposed total is split in
    the proportion of each class's time."""
    spent = {"intra": 0.0, "inter": 0.0}
    for c in colls:
        t, link = call_time(c, cluster)
        spent[link] += c.calls * t
    total = spent["intra"] + spent["inter"]
    if total == 0.0:
        return spent
    hideable = max(0.0, total - unhidden) / total
    hidden_inter = min(hideable * spent["inter"], cluster.overlap * compute)
    hidden_intra = min(hideable * spent["intra"], max(0.0, cluster.intra_overlap * compute - hidden_inter))
    exposed = total - hidden_inter - hidden_intra
    return {k: exposed * v / total for k, v in spent.items()}


def predict(model: ModelSpec, plan: Plan, cluster: Cluster, batch: Batch) -> Prediction:
    """The step time, its breakdown and the memory per rank of ``plan`` (see the module docstring)."""
    world, d = cluster.world, cluster.ranks_per_node
    layout = Layout(world, d)
    colls = collectives(model, plan, layout, batch.accum, batch.dtype_bytes)
    per_micro = model.flops_per_token(batch.seq) * batch.micro * batch.seq / cluster.flops
    compute = per_micro * batch.accum
    root = model.units[0].name
    first = [c for c in colls if c.phase == "forward" and c.unit == root]
    last = [c for c in colls if c.phase == "backward" and c.unit == root]
    unhidden_f = sum(call_time(c, cluster)[0] for c in first) * batch.accum
    unhidden_b = sum(call_time(c, cluster)[0] for c in last) * batch.accum
    parts = [_phase([c for c in colls if c.phase == "forward"], cluster, compute / 3, unhidden_f),
             _phase([c for c in colls if c.phase == "backward"], cluster, 2 * compute / 3, unhidden_b),
             _phase([c for c in colls if c.phase in ("boundary", "step")], cluster, 0.0, 0.0)]
    so = sum(count * shard_numel(u, alignment(plan), plan.partition.optimizer) for u, count in model.groups())
    b = batch.dtype_bytes
    on_host = plan.offload != "none"
    optimizer = so * (28 + b) / (cluster.host_mem_bw if on_host else cluster.mem_bw)
    io = 0.0
    if on_host:
        io = so * (4 + b) / cluster.host_bw + (so * 24 / cluster.nvme_bw if plan.offload == "nvme" else 0.0)
    breakdown = {
        "compute": compute,
        "quant": sum(c.calls * kernel_time(c, cluster) for c in colls),
        "comm_intra": sum(p["intra"] for p in parts),
        "comm_inter": sum(p["inter"] for p in parts),
        "optimizer": optimizer,
        "io": io,
    }
    mem = memory(model, plan, world, batch.micro, batch.seq, b)
    unsupported = plan.unsupported(world, d)
    return Prediction(plan, plan.label(world, d), sum(breakdown.values()), breakdown, mem,
                      sum(mem.values()) <= cluster.memory, unsupported, totals(colls), sum(c.calls for c in colls),
                      None if unsupported else plan.zero_config(world))


def _bits(plan: Plan) -> int:
    """Lossy options a plan uses, for breaking ties toward exact plans."""
    return (plan.weight_bits is not None) + (plan.gradient_bits is not None) + plan.weight_deltas


def rank(model: ModelSpec, cluster: Cluster, batch: Batch, offload: tuple[str, ...] = ("none", "cpu", "nvme"),
         runnable_only: bool = False, lossy: str = "standard") -> list[Prediction]:
    """Every plan of the cluster's space (``zeropp.plan.space.plans``), predicted and sorted: plans that fit in
    memory first, then by step time (to 6 significant digits: closer times are ties), then fewer collective calls,
    then fewer lossy options (exact first), then less memory."""
    world, d = cluster.world, cluster.ranks_per_node
    return ordered([predict(model, p, cluster, batch) for p in plans(world, d, offload, lossy)
                    if not (runnable_only and p.unsupported(world, d))])


def ordered(predictions: list[Prediction]) -> list[Prediction]:
    """``predictions`` in ``rank``'s order: fitting in memory first, then by step time (to 6 significant digits),
    then fewer collective calls, then fewer lossy options, then less memory."""
    return sorted(predictions, key=lambda p: (not p.fits, float(f"{p.step_time:.6g}"), p.calls, _bits(p.plan),
                                              p.memory_total))


def why(ranked: list[Prediction]) -> str:
    """One paragraph: why the first plan wins over the first plan more than 0.5% slower (the component with the
    largest gap), which plans tie with it (within 0.5%, fitting in memory as it does), what a lossy winner saves against the best exact plan, and which plan
    that runs today is best when the winner does not."""
    if not ranked:
        return "no plan: the cluster has a single rank"
    best = ranked[0]
    lines = []
    if not best.fits:
        gib = best.memory_total / 2**30
        lines.append(f"No plan fits in memory; the least slow needs {gib:.1f} GiB per rank.")
    other = next((p for p in ranked[1:] if p.step_time > 1.005 * best.step_time), None)
    if other is None:
        lines.append(f"{best.label} at {duration(best.step_time)} per step; every other plan is within 0.5% of it.")
    else:
        gaps = {k: other.breakdown[k] - best.breakdown[k] for k in COMPONENTS}
        key = max(gaps, key=lambda k: gaps[k])
        lines.append(f"{best.label} wins at {duration(best.step_time)} per step against the next slower plan, "
                     f"{other.label}, at {duration(other.step_time)}: its {key.replace('_', ' ')} is "
                     f"{duration(best.breakdown[key])} against {duration(other.breakdown[key])}.")
        if not other.fits and best.fits:
            lines.append(f"{other.label} would need {other.memory_total / 2**30:.1f} GiB per rank.")
        worse = {k: -g for k, g in gaps.items() if g < 0}
        if worse:
            k = max(worse, key=lambda k: worse[k])
            lines.append(f"It pays {duration(worse[k])} more {k.replace('_', ' ')}.")
        ties = [p.label for p in ranked[1:] if p.fits == best.fits and p.step_time <= 1.005 * best.step_time]
        if ties:
            lines.append(f"Within 0.5% of it: {', '.join(ties[:3])}{' ...' if len(ties) > 3 else ''}.")
    exact = next((p for p in ranked if not _bits(p.plan)), None)
    if _bits(best.plan) and exact is not None:
        gaps = {k: exact.breakdown[k] - best.breakdown[k] for k in COMPONENTS}
        key = max(gaps, key=lambda k: gaps[k])
        lines.append(f"Against the best exact plan, {exact.label} at {duration(exact.step_time)}, it saves "
                     f"{duration(gaps[key])} of {key.replace('_', ' ')}.")
    if best.unsupported:
        today = next((p for p in ranked if p.unsupported is None), None)
        lines.append(f"It does not run today ({best.unsupported})." + (
            f" Best plan that runs today: {today.label} at {duration(today.step_time)}." if today else ""))
    return " ".join(lines)
