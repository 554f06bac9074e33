"""End-to-end training benchmark: ZeRO-3 against ZeRO++ (qwZ, hpZ, qgZ), FSDP2 and HSDP (and DeepSpeed where
it is installed) on an emulated cluster with slow links.

Why: ZeRO++ exists to cut the bytes that cross slow links; this measures the step time, the bytes sent across and
inside nodes (counted and at the NIC) and the loss of each config side by side, from the same weights on the same
batches. Run it as one command; the driver launches the cluster (``zeropp.cluster``) and every rank runs the
worker::

    python -m zeropp.bench.training --nodes 2 --ranks-per-node 2 --rate 1gbit --quick
    python -m zeropp.bench.training --configs zero3,zeropp,fsdp2,hsdp --dtypes fp32,bf16   # side by side

The configs, launchers, columns and output files: docs/benchmarks.md; measured runs: docs/results/training.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zeropp.bench.report import ProgressBar, draw_loss_curve

CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": "rpn"},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": "rpn", "zero_quantized_gradients": True},
    "zeropp-w4": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"weight_bits": 4},
    },
    "zeropp-g8": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"gradient_bits": 8},
    },
    "zeropp-ef": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"error_feedback": True},
    },
    "zeropp-rot": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"gradient_rotation": "hadamard"},
    },
    "zeropp-deltas": {
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"weight_deltas": True},
    },
    "zeropp-sdp4": {  # SDP4Bit's recipe on ZeRO-3: int4 weight deltas, gradients int8 in the node, int4 across, rotated
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"weight_deltas": True, "gradient_bits_intra": 8, "gradient_rotation": "hadamard"},
    },
    "zeropp-g2": {  # the fewest cross-node bytes of qgZ: int2 across nodes (int8 inside), rotated, error feedback
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": "rpn",
        "zero_quantized_gradients": True,
        "zeropp": {"weight_deltas": True, "gradient_bits": 2, "gradient_bits_intra": 8,
                   "gradient_rotation": "hadamard", "error_feedback": True},
    },
}
EXTERNAL = ("fsdp2", "hsdp", "deepspeed")  # not zeropp engines, torch's collectives: zeropp.bench.fsdp, DeepSpeed
# FSDP2 / HSDP with zeropp.fsdp comms (counted)
FSDP_ZEROPP = ("fsdp2-zeropp", "fsdp2-qwz", "fsdp2-hpz", "fsdp2-qgz", "hsdp-zeropp")
DEEPSPEED_ZEROPP = "deepspeed-zeropp"  # DeepSpeed's engine on zeropp.deepspeed (its quantized collectives counted)
DEEPSPEEDS = ("deepspeed", DEEPSPEED_ZEROPP)
ALL_CONFIGS = (*CONFIGS, *EXTERNAL, DEEPSPEED_ZEROPP, *FSDP_ZEROPP)
DEFAULT_CONFIGS = ("zero3", "qwz", "hpz", "qgz", "zeropp", "zeropp-w4", "fsdp2", "hsdp")
DTYPES = ("fp32", "bf16")
LABELS = {
    "zero3": "ZeRO-3 (exact)",
    "qwz": "+qwZ (int8 weights)",
    "hpz": "+hpZ",
    "qgz": "+qgZ (int4 grads)",
    "zeropp": "ZeRO++ (qwZ+hpZ+qgZ)",
    "zeropp-w4": "ZeRO++, int4 weights",
    "zeropp-g8": "ZeRO++, int8 grads",
    "zeropp-ef": "ZeRO++, qgZ error feedback",
    "zeropp-rot": "ZeRO++, qgZ Hadamard rotation (32)",
    "zeropp-deltas": "ZeRO++, int4 weight deltas",
    "zeropp-sdp4": "ZeRO++, int4 deltas, grads int8/int4 rotated",
    "zeropp-g2": "ZeRO++, int4 deltas, grads int8/int2 rotated + EF",
    "fsdp2": "FSDP2 (torch fully_shard)",
    "hsdp": "HSDP (FSDP2, replicated across nodes)",
    "deepspeed": "DeepSpeed ZeRO-3",
    DEEPSPEED_ZEROPP: "DeepSpeed ZeRO++ on zeropp.deepspeed",
    "fsdp2-zeropp": "FSDP2 + ZeRO++ (zeropp.fsdp)",
    "fsdp2-qwz": "FSDP2 + qwZ (int8 weights)",
    "fsdp2-hpz": "FSDP2 + hpZ (reshard to node)",
    "fsdp2-qgz": "FSDP2 + qgZ (int4 grads)",
    "hsdp-zeropp": "HSDP + zeropp (qwZ, qgZ, int4 all-reduce)",
}
DEFAULT_OUT = "bench/out/training"
QUICK = {"steps": 10, "warmup": 3}

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_spec(spec: str) -> tuple[str, str, str]:
    """``NAME[@on|@off][:DTYPE]`` -> (name, overlap ``""``/``"on"``/``"off"``, dtype ``""``/``"fp32"``/``"bf16"``)."""
    rest, _, dtype = spec.partition(":")
    base, _, overlap = rest.partition("@")
    return base, overlap, dtype


def label(name: str) -> str:
    """The legend label of a config spec (``name``, ``name@on``/``name@off``, ``name:bf16``)."""
    base, overlap, dtype = parse_spec(name)
    return LABELS[base] + (f", overlap {overlap}" if overlap else "") + (f", {dtype}" if dtype else "")


def baseline_of(name: str) -> str:
    """The spec of the exact ZeRO-3 run a config is compared with: ``zero3`` in the same dtype."""
    _, _, dtype = parse_spec(name)
    return "zero3" + (f":{dtype}" if dtype else "")


def parse_rate(text: str | None) -> float | None:
    """``"1gbit"`` -> 1e9 bits per second (tc's spelling: kbit, mbit, gbit; ``none``/``off``: unshaped)."""
    if text is None or text.strip().lower() in ("", "none", "off", "0"):
        return None
    m = _RATE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate like 1gbit, 100mbit or none")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zeropp.bench.training", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--rate", default="1gbit", help="link rate between nodes, tc spelling (default 1gbit; none: "
                   "unshaped)")
    p.add_argument("--launcher", choices=("auto", "cluster", "torchrun", "none"), default="auto",
                   help="auto: zeropp.cluster when importable, else one unshaped torchrun")
    p.add_argument("--steps", type=int, default=40, help="training steps per config (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timings (default 5)")
    p.add_argument("--preset", default="small", help="zeropp.models.gpt preset (default small: 10.7M parameters)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {','.join(ALL_CONFIGS)} (default: "
                   f"{','.join(DEFAULT_CONFIGS)}); NAME@off or NAME@on sets overlap_comm for that config only; "
                   "NAME:bf16 its dtype")
    p.add_argument("--dtypes", default="fp32",
                   help="comma-separated dtypes every config runs in, from fp32,bf16 (default fp32); with two, "
                   "the rows are named NAME:DTYPE")
    p.add_argument("--block-size", type=int, default=None,
                   help="zeropp.block_size, elements per quantization block (default: the library's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-warmup", type=int, default=10,
                   help="steps of linear learning-rate warm-up from lr/N to lr (default 10; 1: none)")
    p.add_argument("--clip", type=float, default=1.0,
                   help="gradient_clipping, global norm (default 1.0, as GPT training usually does; 0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap-comm", choices=("on", "off"), default="on",
                   help="zero_optimization.overlap_comm (default on)")
    p.add_argument("--schedule", choices=("sequential", "interleaved"), default="sequential",
                   help="sequential (default): one config after the other, one engine alive at a time; "
                   "interleaved: every config's engine alive at once and step s of each before step s+1 of any "
                   "(load changes on a shared machine hit all configs alike, but the CPU-bound ZeRO++ steps ran "
                   "~30%% slower with 7 engines alive)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help=f"short run for a demo: {QUICK['steps']} steps, {QUICK['warmup']} warm-up")
    p.add_argument("--steps-per-print", type=int, default=10,
                   help="the zeropp and DeepSpeed engines' steps_per_print: rank 0 prints a step line every N "
                   "steps, above the progress bar (default 10, DeepSpeed's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--timeout", type=float, default=None, help="driver: seconds before the job is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = QUICK["steps"], QUICK["warmup"]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtypes {','.join(args.dtypes)}: choose from {','.join(DTYPES)}")
    specs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if len(args.dtypes) > 1:
        specs = [f"{c}:{d}" for d in args.dtypes for c in specs if not parse_spec(c)[2]]
    args.configs = specs
    known = set(ALL_CONFIGS)
    unknown = [c for c in args.configs if parse_spec(c)[0] not in known or parse_spec(c)[1] not in ("", "on", "off")
               or parse_spec(c)[2] not in ("", *DTYPES)]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {list(ALL_CONFIGS)} (NAME@on/off, NAME:fp32/bf16)")
    if any(parse_spec(c)[0] in DEEPSPEEDS for c in args.configs):
        try:
            import_deepspeed()
        except ImportError as e:
            p.error(f"configs {','.join(DEEPSPEEDS)}: DeepSpeed is not installed ({e}): pip install deepspeed, or "
                    "leave them out")
    if args.steps_per_print < 1:
        p.error(f"--steps-per-print {args.steps_per_print}: must be at least 1")
    if not 0 <= args.warmup < args.steps:
        p.error(f"need 0 <= --warmup < --steps, got {args.warmup} and {args.steps}")
    args.rate_bps = parse_rate(args.rate)
    if args.out is None:
        args.out = DEFAULT_OUT
    return args


# ---- worker ---------------------------------------------------------------------------------------------------


def nic_bytes() -> tuple[int, int] | None:
    """(tx, rx) bytes of ``$GLOO_SOCKET_IFNAME`` (this network namespace's view), or None."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return None
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return None


def dtype_of(name: str, args: argparse.Namespace) -> str:
    """A config spec's dtype: its ``:DTYPE``, else the one of ``--dtypes``."""
    return parse_spec(name)[2] or args.dtypes[0]


def zero_config(name: str, args: argparse.Namespace, ranks_per_node: int) -> dict[str, Any]:
    """The DeepSpeed-style config dict of a zeropp (or DeepSpeed) config spec."""
    base, overlap, _ = parse_spec(name)
    zero: dict[str, Any] = {"stage": 3, "overlap_comm": (overlap or args.overlap_comm) == "on"}
    for key, value in CONFIGS.get("zeropp" if base == DEEPSPEED_ZEROPP else base, {}).items():
        zero[key] = ranks_per_node if value == "rpn" else (dict(value) if isinstance(value, dict) else value)
    if args.block_size is not None and base != DEEPSPEED_ZEROPP and any(k.startswith("zero_quantized") for k in zero):
        zero.setdefault("zeropp", {})["block_size"] = args.block_size
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": args.steps_per_print,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "bf16": {"enabled": dtype_of(name, args) == "bf16"},
    }


def import_deepspeed() -> Any:
    """``import deepspeed`` (with ``deepspeed.ops``) on its CPU accelerator unless ``DS_ACCELERATOR`` says otherwise:
    the benchmark trains on CPU tensors over gloo, and DeepSpeed fixes its accelerator on first use."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    return deepspeed


def deepspeed_engine(model: Any, config: dict[str, Any], install_zeropp: bool = False) -> Any:
    """DeepSpeed's engine for ``model`` on the config dict, nothing compiled; with ``install_zeropp``, after
    ``zeropp.deepspeed.install()`` (its ZeRO++ flags on zeropp's collectives).

    The optimizer is a ``torch.optim.AdamW`` with the config's optimizer block (from the block DeepSpeed would build
    its FusedAdam, a C++ op it compiles on first use; torch's AdamW is the arithmetic the other rows step with).
    DeepSpeed joins the process group the worker already started (gloo: its CPU accelerator's backend without
    oneCCL). Its shared-memory all-reduce op (``deepspeed_shm_comm``, which its torch backend compiles with ninja
    and a C++ compiler when it starts) is marked not buildable: only tensor-parallel inference calls it, ZeRO-3
    moves its bytes with ``torch.distributed``'s all-gather and reduce-scatter.

    DeepSpeed 0.19.8 keeps the hpZ group of an engine in a module global that later engines of the process pick up
    (hpZ on whatever their config says); it is cleared first, so each engine gets its own config's hpZ (an engine
    already made keeps the group it holds)."""
    import torch

    deepspeed = import_deepspeed()
    from deepspeed.utils import groups

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if install_zeropp:
        import zeropp.deepspeed

        zeropp.deepspeed.install()
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    config = dict(config)
    params = dict(config.pop("optimizer")["params"])
    optimizer = torch.optim.AdamW(model.parameters(), **params)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class ConfigRun:
    """One config's engine on this rank and what its steps measured (steps, losses, bytes, NIC counters)."""

    def __init__(self, name: str, args: argparse.Namespace, topo: Any) -> None:
        import zeropp
        from zeropp.bench.fsdp import KINDS, FSDPTrainer
        from zeropp.models.gpt import GPT, GPTConfig

        self.name, self.args = name, args
        base = parse_spec(name)[0]
        model = GPT(GPTConfig.preset(args.preset, block_size=max(args.seq, 1)), seed=args.seed)
        config = zero_config(name, args, topo.ranks_per_node)
        self.counted = base not in EXTERNAL  # zeropp.comm.stats() sees its collectives
        if base in KINDS:
            self.engine: Any = FSDPTrainer(model, base, ranks_per_node=topo.ranks_per_node,
                                           dtype=dtype_of(name, args), lr=args.lr, weight_decay=0.01, clip=args.clip,
                                           block_size=args.block_size)
        elif base in DEEPSPEEDS:
            self.engine = deepspeed_engine(model, config, install_zeropp=base == DEEPSPEED_ZEROPP)
        else:
            self.engine, _, _, _ = zeropp.initialize(model=model, config=config, topology=topo)
        self.engine.train()
        self.losses: list[float] = []
        self.times: list[float] = []
        self.phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer step
        self.sent = {k: dict.fromkeys(_FIELDS, 0) for k in KINDS_COUNTED}
        self.nic = [0, 0] if nic_bytes() is not None else None
        self.window_s = 0.0

    def step(self, step: int, data: Any) -> None:
        """One training step, between barriers; counters and NIC bytes are added up after the warm-up."""
        import torch.distributed as dist

        from zeropp import comm

        rank, world = dist.get_rank(), dist.get_world_size()
        inputs, targets = data.micro_batch(step, rank=rank, world_size=world)
        for group in self.engine.optimizer.param_groups:  # linear warm-up (the engine reads lr at every step)
            group["lr"] = self.args.lr * min(1.0, (step + 1) / max(self.args.lr_warmup, 1))
        dist.barrier()
        s0, n0 = comm.stats(), nic_bytes()
        t0 = time.perf_counter()
        _, loss = self.engine(inputs, targets)
        ta = time.perf_counter()
        self.engine.backward(loss)
        tb = time.perf_counter()
        self.engine.step()
        self.times.append(time.perf_counter() - t0)
        self.phases.append((ta - t0, tb - ta, self.times[-1] - (tb - t0)))
        self.losses.append(float(loss.item()))
        dist.barrier()  # every rank of every node is done: the NIC counters hold this step's traffic only
        t1, s1, n1 = time.perf_counter(), comm.stats(), nic_bytes()
        if step >= self.args.warmup:
            self.window_s += t1 - t0
            for kind, fields in self.sent.items():
                for f in fields:
                    fields[f] += s1.get(kind, {}).get(f, 0) - s0.get(kind, {}).get(f, 0)
            if self.nic is not None and n0 is not None and n1 is not None:
                self.nic[0] += n1[0] - n0[0]
                self.nic[1] += n1[1] - n0[1]

    def finish(self, eval_batch: Any) -> dict[str, Any]:
        """Eval loss on the held-out batch; this rank's raw measurements. Frees the engine."""
        import torch

        self.engine.eval()
        with torch.no_grad():
            _, eval_loss = self.engine(*eval_batch)
        measured = self.args.steps - self.args.warmup
        out = {
            "losses": self.losses,
            "times": self.times,
            "phases": self.phases,
            "per_kind": ({k: {f: v / measured for f, v in fields.items()} for k, fields in self.sent.items()}
                         if self.counted else None),
            "nic": None if self.nic is None else (self.nic[0] / measured, self.nic[1] / measured),
            "window_s": self.window_s,
            "eval_loss": float(eval_loss.item()),
        }
        del self.engine
        return out


_FIELDS = ("calls", "sent_intra", "sent_inter", "recv_intra", "recv_inter")
KINDS_COUNTED = ("all_gather", "reduce_scatter", "exchange")
"""The ``zeropp.comm.stats()`` kinds added up (``"exchange"``: the weight deltas of ``zeropp-deltas``)."""


def status(step: int, t_start: float, loss: float) -> str:
    """The progress bar's status after step ``step`` (from 0) of a run started at ``t_start``
    (``time.perf_counter``): steps per second so far and the last loss."""
    return f"{(step + 1) / (time.perf_counter() - t_start):5.2f} step/s  loss {loss:6.3f}"


def run_configs(args: argparse.Namespace, topo: Any, data: Any, eval_batch: Any,
                progress: ProgressBar) -> dict[str, dict[str, Any]]:
    """Train every config; return this rank's measurements per config.

    ``sequential``: one config after the other (a fresh engine each). ``interleaved``: every config's engine is
    built first (same seed: same initial weights) and step ``s`` of each config runs before step ``s + 1`` of any,
    so a change in the machine's load (other processes on a shared box) hits every config alike."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    if args.schedule == "interleaved":
        runs = [ConfigRun(name, args, topo) for name in args.configs]
        for step in range(args.steps):
            for run in runs:
                run.step(step, data)
            if rank == 0:
                progress.update("all", step + 1, args.steps, status(step, t_start, runs[0].losses[-1]))
        progress.finish()
        for run in runs:
            results[run.name] = run.finish(eval_batch)
        return results
    for name in args.configs:
        run = ConfigRun(name, args, topo)
        t_start = time.perf_counter()
        for step in range(args.steps):
            run.step(step, data)
            if rank == 0:
                progress.update(name, step + 1, args.steps, status(step, t_start, run.losses[-1]))
        progress.finish()
        results[name] = run.finish(eval_batch)
        # the engine and its hooks form reference cycles: free its memory now, not at some later config's expense
        del run
        gc.collect()
    return results


def summarize(name: str, per_rank: list[dict[str, Any]], args: argparse.Namespace, ranks_per_node: int,
              world: int, tokens_per_step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One CSV row (and the loss-curve rows) for config ``name`` from every rank's measurements."""
    steps = args.steps
    step_times = [max(r["times"][s] for r in per_rank) for s in range(steps)]
    losses = [sum(r["losses"][s] for r in per_rank) / world for s in range(steps)]
    median = statistics.median(step_times[args.warmup:])
    mb = 1e6

    def sent(r: dict[str, Any], field: str, kinds: tuple[str, ...] | None = None) -> float:
        return sum(v[field] for k, v in (r["per_kind"] or {}).items() if kinds is None or k in kinds)

    nodes = world // ranks_per_node
    node_inter = [sum(sent(per_rank[n * ranks_per_node + i], "sent_inter") for i in range(ranks_per_node))
                  for n in range(nodes)]
    node_intra = [sum(sent(per_rank[n * ranks_per_node + i], "sent_intra") for i in range(ranks_per_node))
                  for n in range(nodes)]
    nics = [r["nic"] for r in per_rank if r["nic"] is not None]
    window = max(r["window_s"] for r in per_rank)
    measured = steps - args.warmup
    row: dict[str, Any] = {
        "config": name,
        "label": label(name),
        "dtype": dtype_of(name, args),
        "preset": args.preset,
        "world": world,
        "ranks_per_node": ranks_per_node,
        "rate": args.rate,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "block_size": args.block_size or "",
        "steps": steps,
        "warmup": args.warmup,
        "step_s": round(median, 4),
        "step_s_min": round(min(step_times[args.warmup:]), 4),
        "step_s_max": round(max(step_times[args.warmup:]), 4),
        "tokens_per_s": round(tokens_per_step / median, 1),
        **{f"{ph}_s": round(statistics.median(max(r["phases"][s][i] for r in per_rank)
                                              for s in range(args.warmup, steps)), 4)
           for i, ph in enumerate(("fwd", "bwd", "opt"))},
        "speedup": None,
        "inter_MB_rank": round(sum(sent(r, "sent_inter") for r in per_rank) / world / mb, 3),
        "intra_MB_rank": round(sum(sent(r, "sent_intra") for r in per_rank) / world / mb, 3),
        "ag_inter_MB_rank": round(sum(sent(r, "sent_inter", ("all_gather",)) for r in per_rank) / world / mb, 3),
        "rs_inter_MB_rank": round(sum(sent(r, "sent_inter", ("reduce_scatter",)) for r in per_rank) / world / mb,
                                  3),
        "inter_MB_node": round(max(node_inter) / mb, 3),
        "intra_MB_node": round(max(node_intra) / mb, 3),
        "util_counted": None,
        "nic_tx_MB_node": None,
        "nic_rx_MB_node": None,
        "util_nic": None,
        "final_loss": round(sum(losses[-min(5, steps):]) / min(5, steps), 4),
        "eval_loss": round(sum(r["eval_loss"] for r in per_rank) / world, 4),
        "loss_vs_zero3": None,
        "window_s_per_step": round(window / measured, 4),
        "schedule": args.schedule,
        "overlap_comm": args.overlap_comm,
        "loadavg_start": round(args.load[0], 2),
        "loadavg_end": round(args.load[1], 2),
    }
    if all(r["per_kind"] is None for r in per_rank):  # torch's own collectives: not counted
        for key in ("inter_MB_rank", "intra_MB_rank", "ag_inter_MB_rank", "rs_inter_MB_rank", "inter_MB_node",
                    "intra_MB_node"):
            row[key] = None
    elif args.rate_bps:
        row["util_counted"] = round(max(node_inter) * 8 / median / args.rate_bps, 3)
    if nics:
        tx, rx = max(n[0] for n in nics), max(n[1] for n in nics)
        row["nic_tx_MB_node"] = round(tx / mb, 3)
        row["nic_rx_MB_node"] = round(rx / mb, 3)
        if args.rate_bps:
            # bytes over the whole measured window (barriers included) per second, against the link rate
            row["util_nic"] = round(max(tx, rx) * measured * 8 / window / args.rate_bps, 3)
    curve = [{"config": name, "step": s, "loss": round(losses[s], 5), "step_s": round(step_times[s], 4)}
             for s in range(steps)]
    return row, curve


def worker(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Run every config on this rank (under torchrun); rank 0 writes and prints the results and returns the rows."""
    import torch
    import torch.distributed as dist

    from zeropp import comm
    from zeropp.data import TextBatches, stdlib_corpus

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = int(os.environ.get("ZEROPP_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE") or args.ranks_per_node)
    topo = comm.Topology(ranks_per_node=rpn, hpz_partition_sizes=(rpn,))
    corpus = stdlib_corpus()
    data = TextBatches(corpus, seq_len=args.seq, global_batch=args.micro_batch * world, seed=args.seed)
    held_out = TextBatches(corpus, seq_len=args.seq, global_batch=8 * world, seed=args.seed + 10_000)
    eval_batch = held_out.micro_batch(0, rank=rank, world_size=world)
    load0 = os.getloadavg()[0]
    # rank 0 draws the bar, every rank's lines (the engine's step lines, warnings) go above it or replace it
    with ProgressBar(not args.no_progress, elsewhere=rank != 0) as progress:
        mine = run_configs(args, topo, data, eval_batch, progress)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    gathered = {name: [r[name] for r in everyone] for name in args.configs}
    args.load = (load0, os.getloadavg()[0])
    if "ZEROPP_CLUSTER_SHAPED" in os.environ:
        shaped = os.environ["ZEROPP_CLUSTER_SHAPED"] == "1"
    else:
        shaped = bool(os.environ.get("GLOO_SOCKET_IFNAME")) and args.rate_bps is not None
    rows = None
    if rank == 0:
        rows = report(gathered, args, rpn, world, shaped)
    dist.barrier()
    dist.destroy_process_group()
    return rows


# ---- report ---------------------------------------------------------------------------------------------------


TABLE = [
    ("config", "config", "{}"),
    ("step_s", "step s", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("fwd_s", "fwd", "{:.2f}"),
    ("bwd_s", "bwd", "{:.2f}"),
    ("opt_s", "opt", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("inter_MB_rank", "inter MB/rank", "{:.2f}"),
    ("intra_MB_rank", "intra MB/rank", "{:.2f}"),
    ("inter_MB_node", "inter MB/node", "{:.2f}"),
    ("util_counted", "util cnt", "{:.0%}"),
    ("nic_tx_MB_node", "NIC tx MB", "{:.2f}"),
    ("util_nic", "util NIC", "{:.0%}"),
    ("final_loss", "loss", "{:.4f}"),
    ("eval_loss", "eval loss", "{:.4f}"),
    ("loss_vs_zero3", "vs zero3", "{:+.2%}"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [[h for _, h, _ in TABLE]]
    for row in rows:
        cells.append(["-" if row.get(k) is None else f.format(row[k]) for k, _, f in TABLE])
    widths = [max(len(r[i]) for r in cells) for i in range(len(TABLE))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def explanation(rows: list[dict[str, Any]], args: argparse.Namespace, world: int, rpn: int, shaped: bool) -> str:
    """One sentence saying what the table shows, then a line of details."""
    from zeropp.models.gpt import GPT, GPTConfig

    n_params = GPT(GPTConfig.preset(args.preset, block_size=max(args.seq, 1))).num_params()
    nodes = world // rpn
    where = (f"{nodes} emulated nodes x {rpn} ranks whose links are shaped to {args.rate} each way"
             if shaped else
             f"{nodes} emulated nodes x {rpn} ranks on one machine with NO rate limit (loopback fallback, so the "
             f"times are not those of a slow link)")
    base = next((r for r in rows if parse_spec(r["config"])[0] == "zero3"), None)
    best = next((r for r in rows if parse_spec(r["config"])[0] == "zeropp" and base is not None
                 and r["dtype"] == base["dtype"]), None)
    result = ""
    if base and best:
        result = (f"; full ZeRO++ ran {best['speedup']:.2f}x as fast as ZeRO-3 ({best['step_s']:.3f} s vs "
                  f"{base['step_s']:.3f} s per step) while sending "
                  f"{best['inter_MB_node'] / max(base['inter_MB_node'], 1e-12):.2f}x its cross-node bytes")
        peers = [r for r in rows if parse_spec(r["config"])[0] in EXTERNAL and r["dtype"] == best["dtype"]]
        if peers:  # what the user would otherwise run: FSDP2, HSDP, DeepSpeed
            result += ", and " + ", ".join(f"{r['step_s'] / best['step_s']:.2f}x as fast as {LABELS.get(name, name)}"
                                           for r in peers for name in [parse_spec(r["config"])[0]])
    sentence = (f"You are seeing one training job of a {n_params / 1e6:.1f}M-parameter GPT on {where}, each "
                f"config trained from the same weights on the same data; 'speedup' is ZeRO-3's step time (in the "
                f"same dtype) divided by the config's{result}.")
    details = (
        f"Details: {args.preset} preset, {'/'.join(args.dtypes)}, AdamW lr {args.lr:g} ({args.lr_warmup} warm-up steps), clipping "
        f"{args.clip:g}, {args.micro_batch} x "
        f"{args.seq} tokens per rank per step, median "
        f"of {args.steps - args.warmup} steps after {args.warmup} warm-up, configs {args.schedule}, overlap_comm "
        f"{args.overlap_comm}; MB = 1e6 bytes sent per step (inter = across nodes, counted by zeropp.comm.stats; "
        f"'NIC tx' measured on the node's interface; the fsdp2, hsdp and deepspeed rows are not counted); ZeRO-3 "
        f"all-gathers and reduce-scatters in the compute dtype (4 bytes per element in fp32, 2 in bf16) and keeps "
        f"units whole by DeepSpeed's stage3_* defaults; load average {args.load[0]:.1f} -> {args.load[1]:.1f} on "
        f"{os.cpu_count()} cores."
    )
    return sentence + "\n" + details


def report(gathered: dict[str, list[dict[str, Any]]], args: argparse.Namespace, rpn: int, world: int,
           shaped: bool) -> list[dict[str, Any]]:
    from zeropp.bench.report import write_csv

    tokens_per_step = args.micro_batch * args.seq * world
    rows, curves = [], []
    for name, per_rank in gathered.items():
        row, curve = summarize(name, per_rank, args, rpn, world, tokens_per_step)
        row["shaped"] = shaped
        rows.append(row)
        curves += curve
    by_name = {r["config"]: r for r in rows}
    for row in rows:
        base = by_name.get(baseline_of(row["config"]))
        if base:
            row["speedup"] = round(base["step_s"] / row["step_s"], 3)
            row["loss_vs_zero3"] = round(row["eval_loss"] / base["eval_loss"] - 1, 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, str(out / "training.csv"))
    write_csv(curves, str(out / "training_loss.csv"))
    if not args.no_plots:
        plot(rows, curves, out, args, shaped)
    print(format_table(rows))
    print()
    print(explanation(rows, args, world, rpn, shaped))
    print(f"(results in {out}/)")
    sys.stdout.flush()
    return rows


def traffic_bars(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The traffic plot's bars, one entry per row: ``config``; ``nic_tx_MB``, the bytes the node's interface sent
    per step, measured (MB, the busiest node; every row of a shaped run, whoever moves the bytes; ``None``
    unshaped); ``counted_inter_MB`` and ``counted_intra_MB``, what ``zeropp.comm.stats()`` counted the node's
    ranks sending across and inside nodes (``None`` for the rows whose collectives are torch's: fsdp2, hsdp,
    deepspeed). Only cross-node bytes pass the interface: in-node traffic goes through the namespace's ``lo``."""
    return [{"config": r["config"], "nic_tx_MB": r["nic_tx_MB_node"], "counted_inter_MB": r["inter_MB_node"],
             "counted_intra_MB": r["intra_MB_node"]} for r in rows]


def plot(rows: list[dict[str, Any]], curves: list[dict[str, Any]], out: Path, args: argparse.Namespace,
         shaped: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = f"{rows[0]['world'] // rows[0]['ranks_per_node']}x{rows[0]['ranks_per_node']} ranks, " + (
        f"{args.rate} links" if shaped else "unshaped")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    k = max(1, min(5, args.steps // 4))  # moving average: the per-step loss of a few sequences is noisy
    for row in rows:
        pts = [c for c in curves if c["config"] == row["config"]]
        draw_loss_curve(ax, [c["step"] for c in pts], [c["loss"] for c in pts],
                        f"{row['label']} (eval {row['eval_loss']:.3f})", k)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"Loss, {args.preset} GPT {'/'.join(args.dtypes)}, {where}\n(thin: per step; thick: mean of the last {k} steps)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "training_loss.png", dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["config"] for r in rows]
    bars = a1.bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    for b, r in zip(bars, rows):
        if r["speedup"] is not None:
            a1.annotate(f"{r['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=9)
    a1.set_ylabel("tokens / s")
    a1.set_title(f"Throughput ({where})")
    a1.tick_params(axis="x", rotation=30)
    traffic = traffic_bars(rows)
    x = range(len(traffic))
    half = 0.4
    measured = [t["nic_tx_MB"] for t in traffic]
    nic = any(m is not None for m in measured)
    if nic:
        a2.bar([i - half / 2 for i in x], [m or 0.0 for m in measured], half, color="tab:purple",
               label="NIC tx, measured (cross-node)")
    inter = [t["counted_inter_MB"] for t in traffic]
    intra = [t["counted_intra_MB"] for t in traffic]
    right = [i + half / 2 if nic else i for i in x]
    a2.bar(right, [v or 0.0 for v in inter], half, color="tab:red", label="counted cross-node")
    a2.bar(right, [v or 0.0 for v in intra], half, bottom=[v or 0.0 for v in inter], color="tab:gray", alpha=0.6,
           label="counted intra-node")
    for i, t in zip(right, traffic):
        if t["counted_inter_MB"] is None:  # torch's collectives
            a2.annotate("not counted", (i, 0), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", rotation=90, fontsize=7, color="tab:gray")
    a2.set_xticks(list(x), [t["config"] for t in traffic])
    a2.set_ylim(0, 1.35 * max([1e-9, *(m or 0.0 for m in measured),
                               *((v or 0.0) + (w or 0.0) for v, w in zip(inter, intra))]))  # legend room
    a2.set_ylabel("MB sent per step, per node (busiest)")
    a2.set_title("Traffic per step: NIC counters and zeropp.comm.stats" if shaped else
                 "Traffic per step: zeropp.comm.stats (unshaped: no NIC measured)", fontsize=10)
    a2.tick_params(axis="x", rotation=30)
    a2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "training_throughput.png", dpi=110)
    plt.close(fig)


# ---- driver ---------------------------------------------------------------------------------------------------


def worker_argv(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The worker's command line: this module with the same options, ``--worker`` added."""
    return [sys.executable, "-m", "zeropp.bench.training", *argv, "--worker"]


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    world = args.nodes * args.ranks_per_node
    launcher = args.launcher
    cluster = None
    if launcher in ("auto", "cluster"):
        try:
            from zeropp import cluster  # type: ignore[attr-defined,no-redef]
        except ImportError:
            if launcher == "cluster":
                raise SystemExit("--launcher cluster: zeropp.cluster is not available") from None
            cluster = None
        launcher = "cluster" if cluster is not None else "torchrun"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env["ZEROPP_RANKS_PER_NODE"] = str(args.ranks_per_node)
    if launcher == "none":
        print("start the workers yourself: torchrun ... " + shlex.join(worker_argv(args, argv)[1:]))
        return 0
    if launcher == "cluster":
        assert cluster is not None
        spec = cluster.ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                                   rate=None if args.rate_bps is None else args.rate)
        return cluster.run(spec, worker_argv(args, argv), env=env, timeout=args.timeout)
    if args.rate_bps is not None:
        print(f"note: no shaped cluster (zeropp.cluster missing or --launcher torchrun): running {world} ranks "
              f"unshaped over loopback as {args.nodes} emulated nodes", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "--log-dir", tmp,
               *worker_argv(args, argv)[1:]]
        try:
            return subprocess.run(cmd, check=False, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"timed out after {args.timeout} s", file=sys.stderr)
            return 124


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker or "LOCAL_RANK" in os.environ:  # a rank started by torchrun (ours, zeropp.cluster's or the user's)
        worker(args)
        return 0
    return drive(args, [a for a in argv if a != "--worker"])


if __name__ == "__main__":
    sys.exit(main())
