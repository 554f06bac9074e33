"""The planner's output: a Markdown table of ranked plans (``zeropp.bench.report`` helpers; times as
``units.duration`` prints them, milliseconds below a second), the reason the best wins, and the same as JSON
(times in seconds)."""

from __future__ import annotations

import json
from typing import Any

from ..bench.report import Format, rows_table
from .cluster import Cluster
from .model import ModelSpec
from .search import COMPONENTS, Batch, Prediction, why
from .units import duration

COLUMNS = ("rank", "plan", "today", "step", "compute", "quant", "comm_intra", "comm_inter", "optimizer", "io",
           "mem_GiB", "fits")


def rows(ranked: list[Prediction]) -> list[dict[str, Any]]:
    """One table row per plan: times in seconds (``step`` and the ``search.COMPONENTS``), memory in GiB per rank,
    "yes" where the engine runs it today."""
    return [{"rank": i + 1, "plan": p.label, "today": "yes" if p.unsupported is None else "no",
             "step": p.step_time, **p.breakdown, "mem_GiB": p.memory_total / 2**30,
             "fits": "yes" if p.fits else "no"} for i, p in enumerate(ranked)]


def text(model: ModelSpec, cluster: Cluster, batch: Batch, ranked: list[Prediction], top: int) -> str:
    """The report: inputs, the table of the first ``top`` plans, and why the best wins."""
    head = (f"model {model.name}: {model.params:,} parameters, {model.layers} layers, hidden {model.hidden}; "
            f"cluster {cluster.nodes} x {cluster.ranks_per_node} ranks, intra {cluster.intra_bw * 8 / 1e9:.4g} "
            f"Gbit/s per rank, inter {cluster.inter_bw * 8 / 1e9:.4g} Gbit/s per node, {cluster.memory / 2**30:.4g} "
            f"GiB per rank; batch {batch.micro} x {batch.seq} tokens x {batch.accum} accumulation steps per rank")
    fmt: dict[str, Format] = {k: duration for k in ("step", *COMPONENTS)}
    fmt["mem_GiB"] = ".3f"
    best = ranked[0] if ranked else None
    config = ("" if best is None or best.config is None else
              f"\n\nzero_optimization of the best plan: {json.dumps(best.config)}")
    return f"{head}\n\n{rows_table(rows(ranked[:top]), COLUMNS, fmt)}\n\n{why(ranked)}{config}"


def as_json(model: ModelSpec, cluster: Cluster, batch: Batch, ranked: list[Prediction], top: int) -> str:
    """The report as JSON: inputs, ``plans`` (the first ``top``, best first) and ``why``."""
    return json.dumps({
        "model": {"name": model.name, "params": model.params, "layers": model.layers, "hidden": model.hidden,
                  "units": len(model.units)},
        "cluster": json.loads(cluster.to_json()),
        "batch": {"micro": batch.micro, "seq": batch.seq, "accum": batch.accum, "dtype_bytes": batch.dtype_bytes},
        "plans": [p.to_dict() for p in ranked[:top]],
        "why": why(ranked),
    }, indent=2)
