"""Validate the planner on the emulated cluster: predicted against measured step time and memory per rank.

    python -m zeropp.plan.validate --cases zero3@1gbit@2x2,zeropp@100mbit@2x2,mics@1gbit@2x4 --csv out.csv

A case is ``PLAN@RATE@NODESxRANKS``: a named plan (``PLANS``), the node link rate (``tc`` units) and the layout.
Cases of one layout and rate share one job on the emulated cluster (``python -m zeropp.cluster``, one job at a
time): its ranks first calibrate the cluster (``zeropp.plan.calibrate``, so the links are measured at that rate and
the compute rate with every rank running at once), then train each plan for ``--steps`` steps from the same
weights, with ``EVERY_GATHER`` (the planner models no persistent or kept units). Measured per plan:

* **step time**: the median, over the steps after ``--warmup``, of the wall time from a barrier before the forward
  to a barrier after ``step()`` (the slowest rank's step), seconds; beside it rank 0's own forward, backward and
  ``step()`` times (medians, no barriers: where the time goes);
* **memory**: the engine's resident model states on rank 0, bytes, each storage counted once: ``params`` (the
  units' compute buffers and shards), ``secondary`` (hpZ secondaries, the larger of their bytes after the forward and
  after the backward; the step drops them), ``grads`` (fp32 gradient shards) and ``optimizer`` (fp32 masters and AdamW's states), against the
  planner's same four terms. The planner's ``gathered`` (stage 3's working set of whole units) and
  ``activations`` are transient and are not in this comparison; the peak RSS growth of the plan (``VmHWM`` reset
  before the engine is built, minus the RSS then) is printed beside the planner's total as a rough check.

The planner predicts from the job's calibration file (``Cluster``: links, quantization kernels, overlap; a file
from before the calibration measured ``overlap_intra`` leaves it unset, and the planner uses ``overlap`` for every
collective, the model of that time: its ``cal_overlap_intra`` column is empty), with the
compute rate of the model's own forward and backward measured in the job (every rank at once, ``_model_flops``)
instead of the calibration's matmul rate, the model preset and the batch; the table and the CSV give both, their
ratio (measured / predicted) and whether it is within ``--time-tol`` and ``--mem-tol`` (and the ratio with the
matmul rate). ``--keep`` keeps each job's files and a ``manifest.json``; ``--analyse FOLDER`` applies the planner
as it is now to a kept folder without running anything.
docs/planner.md, results in docs/results/planner.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..bench.report import ProgressBar, markdown_table, write_csv
from ..cluster.rates import parse_rate
from .cluster import Cluster
from .model import from_preset
from .search import Batch, predict
from .space import Partition, Plan

PLANS = ("zero1", "zero2", "zero3", "zero3-hpz", "zeropp", "zeropp-w4", "zero3-qgz", "mics", "mics-qgz",
         "zero1-node", "zero2-node", "split-node", "resident-node")
"""Named plans, each on any layout of ``d`` ranks per node and ``P`` ranks: ZeRO-1/2/3, ZeRO-3 with hpZ over the
node, ZeRO++ (qwZ int8, qgZ int4, hpZ over the node), the same with qwZ int4, ZeRO-3 with qgZ int4 only, MiCS over
the node (``(d, d, d)``, exact), MiCS with qgZ int4, and the grouped stage-1 and stage-2 points over the node
(``(1, 1, d)``, ``(1, d, d)``: optimizer states, and gradients, sharded inside the node and the gradients
all-reduced across nodes), gradients over the node with optimizer states over the world (``(1, d, W)``) and the
resident point (``(d, W, W)``: ZeRO-3 with the parameters kept over the node)."""

EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
"""Added to each plan's ``zero_optimization``: what the planner models (every unit gathered at each use; no
persistent or kept units, which DeepSpeed's defaults would make of the whole model and save the backward gathers)."""

MEMORY_TERMS = ("params", "secondary", "grads", "optimizer")
"""The planner's memory terms compared with the engine's tensors (``zeropp.plan.memory``)."""


def plan_of(name: str, nodes: int, ranks_per_node: int) -> Plan:
    """The ``Plan`` of a named plan (``PLANS``) on ``nodes`` x ``ranks_per_node`` ranks.

    Raises:
        ValueError: for an unknown name, or MiCS/hpZ on a layout where they are not a real point (one rank per node).
    """
    world, d = nodes * ranks_per_node, ranks_per_node
    full = Partition(world, world, world)
    if name in ("zero3-hpz", "zeropp", "zeropp-w4", "mics", "mics-qgz", "zero1-node", "zero2-node", "split-node",
                "resident-node") and d < 2:
        raise ValueError(f"plan {name!r} needs at least 2 ranks per node (hpZ and the grouped points act over the "
                         f"node)")
    table = {
        "zero1": Plan(Partition(1, 1, world)),
        "zero2": Plan(Partition(1, world, world)),
        "zero3": Plan(full),
        "zero3-hpz": Plan(full, hpz=d),
        "zeropp": Plan(full, weight_bits=8, gradient_bits=4, hpz=d),
        "zeropp-w4": Plan(full, weight_bits=4, gradient_bits=4, hpz=d),
        "zero3-qgz": Plan(full, gradient_bits=4),
        "mics": Plan(Partition(d, d, d)),
        "mics-qgz": Plan(Partition(d, d, d), gradient_bits=4),
        "zero1-node": Plan(Partition(1, 1, d)),
        "zero2-node": Plan(Partition(1, d, d)),
        "split-node": Plan(Partition(1, d, world)),
        "resident-node": Plan(Partition(d, world, world)),
    }
    if name not in table:
        raise ValueError(f"unknown plan {name!r}; choose among {', '.join(PLANS)}")
    return table[name]


@dataclass(frozen=True)
class Case:
    """One (plan, link rate, layout) pair to validate."""

    plan: str
    rate: str
    nodes: int
    ranks_per_node: int

    @property
    def job(self) -> tuple[int, int, str]:
        """The cluster job this case runs in: cases with the same layout and rate share one."""
        return self.nodes, self.ranks_per_node, self.rate


def parse_case(text: str) -> Case:
    """``"zero3@1gbit@2x2"`` -> ``Case("zero3", "1gbit", 2, 2)``.

    Raises:
        ValueError: naming the bad part (format, plan, rate or layout).
    """
    parts = text.strip().split("@")
    if len(parts) != 3:
        raise ValueError(f"case {text!r} is not PLAN@RATE@NODESxRANKS, e.g. zero3@1gbit@2x2")
    name, rate, layout = parts
    parse_rate(rate)  # raises with the rate named
    try:
        nodes, per_node = (int(v) for v in layout.lower().split("x"))
    except ValueError:
        raise ValueError(f"case {text!r}: layout {layout!r} is not NODESxRANKS, e.g. 2x2") from None
    if nodes < 2 or per_node < 2:
        raise ValueError(f"case {text!r}: the layout needs at least 2 nodes of 2 ranks (both link classes are "
                         f"calibrated)")
    plan_of(name, nodes, per_node)
    return Case(name, rate, nodes, per_node)


def compare(case: Case, cluster: Cluster, measured: dict[str, Any], preset: str, micro: int, seq: int,
            time_tol: float, mem_tol: float, model_flops: float | None = None) -> dict[str, Any]:
    """One row of the result: the planner's prediction for ``case`` on the calibrated ``cluster`` beside what was
    ``measured`` (``step_s``, ``memory`` by term in bytes, ``rss_peak``), ratios measured / predicted and whether
    each is within its tolerance (a fraction, 0.15 = 15%). With ``model_flops`` (FLOP/s of the model's own step,
    ``_model_flops``) the prediction uses that compute rate instead of the calibration's matmul rate, which the
    row keeps as ``pred_matmul_step_s`` and ``time_ratio_matmul``."""
    model = from_preset(preset, seq)
    plan = plan_of(case.plan, case.nodes, case.ranks_per_node)
    batch = Batch(micro, seq, 1, 4)
    matmul = predict(model, plan, cluster, batch)
    pred = matmul if model_flops is None else predict(model, plan, replace(cluster, flops=model_flops), batch)
    pred_mem = sum(pred.memory[k] for k in MEMORY_TERMS)
    meas_mem = sum(measured["memory"][k] for k in MEMORY_TERMS)
    time_ratio = measured["step_s"] / pred.step_time
    mem_ratio = meas_mem / pred_mem
    return {
        "plan": pred.label, "name": case.plan, "rate": case.rate, "layout": f"{case.nodes}x{case.ranks_per_node}",
        "pred_step_s": pred.step_time, "meas_step_s": measured["step_s"], "time_ratio": time_ratio,
        "time_ok": abs(time_ratio - 1) <= time_tol,
        "pred_matmul_step_s": matmul.step_time, "time_ratio_matmul": measured["step_s"] / matmul.step_time,
        "time_ok_matmul": abs(measured["step_s"] / matmul.step_time - 1) <= time_tol,
        "pred_compute_s": pred.breakdown["compute"], "pred_comm_s": pred.breakdown["comm_intra"]
        + pred.breakdown["comm_inter"], "pred_quant_s": pred.breakdown["quant"],
        "pred_optimizer_s": pred.breakdown["optimizer"],
        "pred_states_MB": pred_mem / 1e6, "meas_states_MB": meas_mem / 1e6, "mem_ratio": mem_ratio,
        "mem_ok": abs(mem_ratio - 1) <= mem_tol,
        "pred_total_MB": pred.memory_total / 1e6, "rss_peak_MB": measured["rss_peak"] / 1e6,
        "step_times_s": " ".join(f"{t:.4f}" for t in measured["times"]),
        **{f"rank0_{k}_s": v for k, v in measured.get("phases_s", {}).items()},
        **{f"pred_{k}_B": pred.memory[k] for k in MEMORY_TERMS},
        **{f"meas_{k}_B": measured["memory"][k] for k in MEMORY_TERMS},
    }


COLUMNS = (("plan", "plan", "{}"), ("rate", "rate", "{}"), ("layout", "nodes", "{}"),
           ("pred_step_s", "pred s", "{:.3f}"), ("meas_step_s", "meas s", "{:.3f}"),
           ("time_ratio", "time x", "{:.2f}"), ("time_ok", "<=15%", "{}"),
           ("time_ratio_matmul", "x (matmul rate)", "{:.2f}"),
           ("pred_compute_s", "pred compute", "{:.3f}"), ("pred_comm_s", "pred comm", "{:.3f}"),
           ("pred_quant_s", "pred quant", "{:.3f}"),
           ("pred_states_MB", "pred states MB", "{:.2f}"), ("meas_states_MB", "meas states MB", "{:.2f}"),
           ("mem_ratio", "mem x", "{:.3f}"), ("mem_ok", "<=10%", "{}"),
           ("pred_total_MB", "pred total MB", "{:.1f}"), ("rss_peak_MB", "RSS peak MB", "{:.1f}"))


def table(rows: list[dict[str, Any]], time_tol: float = 0.15, mem_tol: float = 0.10) -> str:
    """The rows as a Markdown table (``zeropp.bench.report.markdown_table``)."""
    head = [h.replace("15%", f"{time_tol:.0%}").replace("10%", f"{mem_tol:.0%}") for _, h, _ in COLUMNS]
    body = [["" if k not in r else ("yes" if r[k] else "no") if isinstance(r[k], bool) else f.format(r[k])
             for k, _, f in COLUMNS] for r in rows]
    return markdown_table(head, body)


# ---- the worker: every rank of one cluster job -----------------------------------------------------------------


def _rss() -> tuple[int, int]:
    """This process's (RSS, peak RSS since the last reset) in bytes, from /proc/self/status."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (``clear_refs`` value 5, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _states(engine: Any) -> dict[str, int]:
    """Bytes of the engine's resident model states on this rank by ``MEMORY_TERMS`` (storages counted once, freed
    ones not at all)."""
    seen: set[int] = set()
    out = dict.fromkeys(MEMORY_TERMS, 0)

    def add(key: str, t: Any) -> None:
        if t is None:
            return
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[key] += storage.nbytes()

    for u in engine.units:
        add("params", u.full)
        add("params", u.shard)
        add("secondary", u.secondary)
        add("grads", u.grad_shard)
        add("grads", u.grad_accumulator)
        add("optimizer", u.master)
    for tensors in engine.optimizer.state.values():
        for t in tensors.values() if isinstance(tensors, dict) else tensors:
            add("optimizer", t)
    return out


def _run_plan(name: str, args: argparse.Namespace, topo: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import zeropp
    from zeropp.models.gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_of(name, world // topo.ranks_per_node, topo.ranks_per_node)
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "zero_optimization": {**plan.zero_config(world), **EVERY_GATHER},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    gc.collect()
    _reset_peak_rss()
    rss0 = _rss()[0]
    engine, _, _, _ = zeropp.initialize(model=GPT(GPTConfig.preset(args.model), seed=0), config=config, topology=topo)
    engine.train()
    g = torch.Generator().manual_seed(1000 + rank)
    times, phases, secondary = [], [], 0
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        t1 = time.perf_counter()
        after_forward = _states(engine)["secondary"]
        t2 = time.perf_counter()
        engine.backward(loss)
        t3 = time.perf_counter()
        secondary = max(after_forward, _states(engine)["secondary"])
        t4 = time.perf_counter()
        engine.step()
        t5 = time.perf_counter()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        phases.append((t1 - t0, t3 - t2, t5 - t4))
    memory = {**_states(engine), "secondary": secondary}
    rss_peak = _rss()[1] - rss0
    del engine
    gc.collect()
    phase = {name: statistics.median(p[i] for p in phases[args.warmup:])
             for i, name in enumerate(("forward", "backward", "step"))}
    return {"times": times, "step_s": statistics.median(times[args.warmup:]), "phases_s": phase, "memory": memory,
            "rss_peak": rss_peak}


def _model_flops(args: argparse.Namespace, topo: Any, repeats: int = 3) -> float:
    """The training FLOP/s a rank reaches on this model's own forward and backward (plain torch, no communication,
    every rank at once, the slowest rank's median of ``repeats`` after one warm-up), counted as the planner counts
    (``ModelSpec.flops_per_token``): the compute rate of the model's small matmuls, attention and element-wise
    kernels, which a 1024 x 1024 matmul (the calibration's ``flops``) overstates."""
    import torch
    import torch.distributed as dist

    from zeropp.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.preset(args.model), seed=0)
    tokens = torch.randint(0, 256, (args.micro, args.seq + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=topo.group)
        t0 = time.perf_counter()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=topo.group)
    per_step = from_preset(args.model, args.seq).flops_per_token(args.seq) * args.micro * args.seq
    return per_step / slowest.item()


def worker(args: argparse.Namespace) -> int:
    """Every rank: calibrate, then run each plan; rank 0 writes ``--out`` (JSON: the cluster file's path, the load
    average at start and end, and per plan what ``_run_plan`` measured)."""
    import torch
    import torch.distributed as dist

    from zeropp import comm

    from . import calibrate

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rpn = int(os.environ.get("ZEROPP_RANKS_PER_NODE") or os.environ["LOCAL_WORLD_SIZE"])
    topo = comm.Topology(ranks_per_node=rpn, hpz_partition_sizes=(rpn,))
    load0 = os.getloadavg()
    calibrate.run(args.calibration, topo)
    model_flops = _model_flops(args, topo)
    plans = args.plans.split(",")
    results = {}
    with ProgressBar(not args.no_progress, elsewhere=rank != 0) as bar:
        for i, name in enumerate(plans):
            bar.update("validate", i, len(plans), name)
            results[name] = _run_plan(name, args, topo)
        bar.update("validate", len(plans), len(plans))
    if rank == 0:
        Path(args.out).write_text(json.dumps({"cluster": args.calibration, "load": [load0, os.getloadavg()],
                                              "model_flops": model_flops, "plans": results}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---- the driver ------------------------------------------------------------------------------------------------


FAST_LINK_PLANS = ("zero1", "zero2", "zero3", "zeropp", "mics", "mics-qgz", "zero1-node", "zero2-node", "split-node",
                   "resident-node")
SLOW_LINK_PLANS = ("zero3", "zeropp", "mics", "mics-qgz", "resident-node")
DEFAULT_CASES = ",".join(
    [f"{p}@100mbit@2x2" for p in SLOW_LINK_PLANS]
    + [f"{p}@{r}@2x2" for r in ("1gbit", "10gbit") for p in FAST_LINK_PLANS]
    + [f"{p}@1gbit@{layout}" for layout in ("2x4", "4x2") for p in SLOW_LINK_PLANS]
    + [f"{p}@100mbit@{layout}" for layout in ("2x4", "4x2") for p in ("zeropp", "mics-qgz")])
"""39 cases in 7 jobs: every named plan family at 1 and 10 Gbit/s on 2 x 2, the plans whose steps stay under ~15 s at
100 Mbit/s (ZeRO-1 and the grouped stage-1/2 points move the whole gradient across nodes: 10 s and more per step
there), and 2 x 4 and 4 x 2 at 1 Gbit/s and 100 Mbit/s."""


def _parser() -> argparse.ArgumentParser:
    a = argparse.ArgumentParser(prog="python -m zeropp.plan.validate", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated PLAN@RATE@NODESxRANKS; plans: "
                   + ", ".join(PLANS))
    a.add_argument("--model", default="small", help="zeropp.models preset")
    a.add_argument("--seq", type=int, default=64, help="sequence length (tokens)")
    a.add_argument("--micro", type=int, default=1, help="sequences per rank per step")
    a.add_argument("--steps", type=int, default=6, help="steps per plan, warm-up included")
    a.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    a.add_argument("--time-tol", type=float, default=0.15, help="step time tolerance (fraction)")
    a.add_argument("--mem-tol", type=float, default=0.10, help="memory tolerance (fraction)")
    a.add_argument("--csv", default="planner_validation.csv", help="CSV of every row")
    a.add_argument("--timeout", type=float, default=1800, help="seconds per cluster job")
    a.add_argument("--keep", default="planner_validation",
                   help="folder for each job's calibration and measurements (and manifest.json)")
    a.add_argument("--analyse", metavar="FOLDER",
                   help="run nothing: the table of the jobs kept in FOLDER (with the same --model, --seq, --micro)")
    a.add_argument("--no-progress", action="store_true")
    a.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a.add_argument("--plans", help=argparse.SUPPRESS)
    a.add_argument("--out", help=argparse.SUPPRESS)
    a.add_argument("--calibration", help=argparse.SUPPRESS)
    return a


def _uptime() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def analyse(folder: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of the jobs kept in ``folder`` (``manifest.json``: per job its layout, rate, plans and files)."""
    rows: list[dict[str, Any]] = []
    for job in json.loads(Path(folder, "manifest.json").read_text()):
        result = json.loads(Path(folder, job["out"]).read_text())
        cluster = Cluster.from_json(Path(folder, job["cluster"]))
        for name in job["plans"]:
            case = Case(name, job["rate"], job["nodes"], job["ranks_per_node"])
            row = compare(case, cluster, result["plans"][name], args.model, args.micro, args.seq, args.time_tol,
                          args.mem_tol, result["model_flops"])
            row.update(cal_intra_gbit=cluster.intra_bw * 8 / 1e9, cal_inter_gbit=cluster.inter_bw * 8 / 1e9,
                       cal_intra_alpha_us=cluster.intra_latency * 1e6, cal_inter_alpha_us=cluster.inter_latency * 1e6,
                       cal_gflops=cluster.flops / 1e9, model_gflops=result["model_flops"] / 1e9,
                       cal_kernel_gbs=(cluster.kernel_bw or cluster.mem_bw) / 1e9, cal_overlap=cluster.overlap,
                       cal_overlap_intra="" if cluster.overlap_intra is None else cluster.overlap_intra,
                       load_start=result["load"][0][0], load_end=result["load"][1][0])
            rows.append(row)
    return rows


def drive(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the cases' cluster jobs one at a time, keeping each job's files in ``args.keep``; the rows."""
    cases = [parse_case(c) for c in args.cases.split(",") if c.strip()]
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup={args.warmup} leaves no measured step of --steps={args.steps}")
    jobs: dict[tuple[int, int, str], list[Case]] = {}
    for c in cases:
        jobs.setdefault(c.job, []).append(c)
    Path(args.keep).mkdir(parents=True, exist_ok=True)
    manifest: list[dict[str, Any]] = []
    for i, ((nodes, per_node, rate), members) in enumerate(jobs.items()):
        out, cal = Path(args.keep, f"job{i}.json"), Path(args.keep, f"cluster{i}.json")
        command = [sys.executable, "-m", "zeropp.cluster", "--nodes", str(nodes), "--ranks-per-node",
                   str(per_node), "--rate", rate, "--fallback", "error", "--timeout", str(args.timeout), "--",
                   sys.executable, "-m", "zeropp.plan.validate", "--worker", "--plans",
                   ",".join(c.plan for c in members), "--out", str(out), "--calibration", str(cal),
                   "--model", args.model, "--seq", str(args.seq), "--micro", str(args.micro),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
        if args.no_progress:
            command.append("--no-progress")
        print(f"job {i + 1}/{len(jobs)}: {nodes}x{per_node} at {rate}: {', '.join(c.plan for c in members)} "
              f"(load {_uptime()})", file=sys.stderr, flush=True)
        rc = subprocess.run(command).returncode
        if rc != 0:
            raise RuntimeError(f"cluster job {nodes}x{per_node} at {rate} exited with {rc}; the jobs before it are "
                               f"kept in {args.keep}")
        manifest.append({"nodes": nodes, "ranks_per_node": per_node, "rate": rate,
                         "plans": [c.plan for c in members], "out": out.name, "cluster": cal.name})
        Path(args.keep, "manifest.json").write_text(json.dumps(manifest, indent=1))
        write_csv(analyse(args.keep, args), args.csv)
    return analyse(args.keep, args)


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """How many rows are within the tolerances."""
    n = len(rows)
    times, matmul, mem = (sum(r[k] for r in rows) for k in ("time_ok", "time_ok_matmul", "mem_ok"))
    old = sum(r.get("cal_overlap_intra") == "" for r in rows)
    note = (f"; {old}/{n} rows from calibrations without overlap_intra (older runs): their intra-node collectives "
            f"hide under overlap, as all did before it was measured" if old else "")
    return (f"{times}/{n} within {args.time_tol:.0%} step time (the model's own compute rate; {matmul}/{n} with the "
            f"calibration's matmul rate), {mem}/{n} within {args.mem_tol:.0%} memory (model states){note}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args)
    try:
        if args.analyse:
            rows = analyse(args.analyse, args)
        else:
            print(f"load average at start: {_uptime()}", file=sys.stderr, flush=True)
            rows = drive(args)
            print(f"load average at end: {_uptime()}", file=sys.stderr, flush=True)
    except ValueError as e:
        print(f"python -m zeropp.plan.validate: {e}", file=sys.stderr)
        return 2
    write_csv(rows, args.csv)
    print(table(rows, args.time_tol, args.mem_tol))
    print(f"\n{summary(rows, args)}; CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
