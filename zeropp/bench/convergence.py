"""Convergence harness: train one model on the same real text with a list of DeepSpeed configs and compare each
with the first (the reference, exact ZeRO-3 by default): loss curves, held-out eval loss and its difference from
the reference, bytes sent across and inside nodes per step, and the median step time.

Why: a compression setting (int4 weights, int4 or 2-bit gradients, per-layer rules, ...) is only worth its bytes
if the model still learns as it does without it; run this on your model before trusting one. Every config starts
from the same weights (same seed) and sees the same batches in the same order, so the differences are the
config's alone. Under torchrun (or the emulated cluster, whose ranks torchrun starts)::

    torchrun --nproc-per-node 4 -m zeropp.bench.convergence --configs exact zeropp zeropp-w4 --steps 200
    ZEROPP_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 -m zeropp.bench.convergence --configs exact my.json
    python -m zeropp.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        python -m zeropp.bench.convergence --model mypkg.models:build --configs exact zeropp

Outputs in ``--out``: ``results.csv`` (one row per config), ``curves.csv`` (training loss per step and eval loss
at each eval point, per config) and ``curves.png``; the results table is printed as Markdown. Options, the model
and data contracts and how to read the table: docs/convergence.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zeropp.bench.report import ProgressBar, draw_loss_curve, rows_table, write_csv
from zeropp.bench.training import CONFIGS as TRAINING_CONFIGS

NAMED: dict[str, dict[str, Any]] = {"exact": {}, **TRAINING_CONFIGS}
"""Named configs: ``zero_optimization`` entries on top of ``{"stage": 3}`` (``"rpn"``: the ranks per node)."""
DEFAULT_CONFIGS = ("exact", "zeropp")
DEFAULT_OUT = "bench/out/convergence"
EVAL_FRACTION = 0.1  # the corpus's last tenth is held out for the eval loss, never trained on
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zeropp.bench.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:small",
                   help="preset:NAME (a zeropp.models.gpt byte-level preset: tiny, mini, small) or module:attr, a "
                   "callable taking no arguments that returns the model (default preset:small)")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   help=f"DeepSpeed JSON files and/or named configs ({', '.join(NAMED)}); the first is the "
                   f"reference (default: {' '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--data", default="stdlib",
                   help="training text: stdlib (the Python standard library's sources, zeropp.data) or a file "
                   "path, read as bytes (default stdlib)")
    p.add_argument("--data-bytes", type=int, default=4 << 20, help="bytes of text used (default 4 MiB)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per config (default 200)")
    p.add_argument("--eval-every", type=int, default=50, help="eval loss every K steps and after the last "
                   "(default 50)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="held-out batches per eval, one micro-batch of sequences per rank each (default 8)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step time and bytes "
                   "(default 5)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--micro-batch", type=int, default=4,
                   help="sequences per rank per step, for configs that set no batch size (default 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW lr, for configs without an optimizer block")
    p.add_argument("--lr-warmup", type=int, default=20,
                   help="linear warm-up steps (WarmupLR), for configs without a scheduler block (default 20; 0: "
                   "constant lr)")
    p.add_argument("--clip", type=float, default=1.0,
                   help="gradient_clipping, for configs that do not set it (default 1.0; 0: off)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--no-plots", action="store_true", help="skip curves.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or args.eval_batches < 1:
        p.error(f"--steps, --eval-every and --eval-batches must be positive, got {args.steps}, {args.eval_every}, "
                f"{args.eval_batches}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"need 0 <= --warmup < --steps, got {args.warmup} and {args.steps}")
    for spec in args.configs:
        if spec not in NAMED and not Path(spec).is_file():
            p.error(f"--configs {spec}: neither a JSON file nor a named config ({', '.join(NAMED)})")
    args.labels = labels(args.configs)
    return args


def labels(specs: Sequence[str]) -> list[str]:
    """Each config's name in the table: a named config's name or a file's stem; the second of two equal names gets
    ``#2`` (the third ``#3``), so a config can be run twice (a determinism check)."""
    out: list[str] = []
    for spec in specs:
        name = spec if spec in NAMED else Path(spec).stem
        seen = sum(1 for o in out if o == name or o.startswith(name + "#"))
        out.append(f"{name}#{seen + 1}" if seen else name)
    return out


# ---- configs, model, data --------------------------------------------------------------------------------------


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    """The top-level keys a config that lacks them gets: batch size, clipping, AdamW, linear warm-up (none with
    ``--lr-warmup 0``)."""
    base = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": args.lr_warmup,
                                                     "warmup_type": "linear"}},
    }
    if args.lr_warmup < 1:
        del base["scheduler"]
    return base


def config_dict(spec: str, args: argparse.Namespace, ranks_per_node: int) -> dict[str, Any]:
    """The engine config of ``spec`` (a named config or a JSON file): its own keys, and ``base_config``'s for the
    top-level keys it does not set (a block is taken whole, never merged key by key; the batch keys only when it
    sets none of them)."""
    from zeropp.config.load import read_json

    if spec in NAMED:
        zero: dict[str, Any] = {"stage": 3}
        for key, value in NAMED[spec].items():
            zero[key] = ranks_per_node if value == "rpn" else (dict(value) if isinstance(value, dict) else value)
        own: dict[str, Any] = {"zero_optimization": zero}
    else:
        own = read_json(spec)
        if not isinstance(own, dict):
            raise ValueError(f"{spec}: a DeepSpeed config is a JSON object, got a {type(own).__name__}")
    merged = {k: v for k, v in base_config(args).items()
              if k not in own and not (k in BATCH_KEYS and any(b in own for b in BATCH_KEYS))}
    return {**merged, **own}


def model_factory(spec: str, args: argparse.Namespace) -> Callable[[], Any]:
    """A callable building a fresh model with the same initial weights every time (``--seed``)."""
    import torch

    kind, sep, rest = spec.partition(":")
    if kind == "preset" and sep:
        from zeropp.models.gpt import GPT, PRESETS, GPTConfig

        if rest not in PRESETS:
            raise SystemExit(f"--model {spec}: unknown preset; choose from {', '.join(sorted(PRESETS))}")
        return lambda: GPT(GPTConfig.preset(rest, block_size=max(args.seq, 1)), seed=args.seed)
    if not sep or not kind or not rest:
        raise SystemExit(f"--model {spec}: expected preset:NAME or module:attr (e.g. mypkg.models:build)")
    try:
        target: Any = importlib.import_module(kind)
    except ImportError as e:
        raise SystemExit(f"--model {spec}: cannot import {kind} ({e}); is it on PYTHONPATH?") from None
    for part in rest.split("."):
        if not hasattr(target, part):
            raise SystemExit(f"--model {spec}: {kind} has no attribute {rest}")
        target = getattr(target, part)
    if not callable(target):
        raise SystemExit(f"--model {spec}: {rest} is not callable; give a function or class that returns the model")

    def build() -> Any:
        torch.manual_seed(args.seed)
        return target()

    return build


def loss_of(output: Any) -> Any:
    """The scalar loss in a model's output: the output itself, its ``.loss`` (Hugging Face style), or the last item
    of a tuple or list (``(logits, loss)``)."""
    import torch

    loss = output
    if not isinstance(loss, torch.Tensor):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)) and output:
            loss = output[-1]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the model's forward(inputs, targets) must return the scalar loss, an object with .loss or "
                        f"a tuple ending with it; got {type(output).__name__}")
    return loss


def corpus_of(args: argparse.Namespace) -> Any:
    """The text as int64 token ids 0..255 (bytes), at most ``--data-bytes`` of them."""
    import torch

    from zeropp.data import stdlib_corpus

    if args.data == "stdlib":
        return stdlib_corpus(args.data_bytes)
    path = Path(args.data)
    if not path.is_file():
        raise SystemExit(f"--data {args.data}: no such file (or use --data stdlib)")
    data = path.read_bytes()[: args.data_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def split_corpus(corpus: Any, seq: int) -> tuple[Any, Any]:
    """(training text, held-out text): the last ``EVAL_FRACTION`` is held out."""
    cut = int(corpus.numel() * (1 - EVAL_FRACTION))
    if cut < seq + 2 or corpus.numel() - cut < seq + 2:
        raise SystemExit(f"the text has {corpus.numel()} bytes: too short to hold out a tenth with --seq {seq} "
                         f"(need {10 * (seq + 2)} at least)")
    return corpus[:cut], corpus[cut:]


def check_batches(specs: Sequence[str], configs: Sequence[dict[str, Any]], world: int) -> None:
    """Raise unless every config trains on the reference's global batch (same data, same order)."""
    from zeropp.config.load import load_config

    sizes = [load_config(c, world).train_batch_size for c in configs]
    for spec, size in zip(specs, sizes):
        if size != sizes[0]:
            raise SystemExit(f"--configs {spec}: {size} sequences per step, the reference {specs[0]} {sizes[0]}: "
                             f"the same data needs the same train_batch_size in every config (set its batch keys "
                             f"as the reference's, or leave them out for --micro-batch)")


# ---- worker ---------------------------------------------------------------------------------------------------


def count_bytes() -> tuple[int, int]:
    """This rank's (cross-node, intra-node) bytes sent so far, all collectives (``zeropp.comm.stats``)."""
    from zeropp import comm

    stats = comm.stats()
    return (sum(v.get("sent_inter", 0) for v in stats.values()),
            sum(v.get("sent_intra", 0) for v in stats.values()))


def evaluate(engine: Any, batches: list[Any]) -> float:
    """Mean loss over ``batches`` (this rank's) and every rank."""
    import torch
    import torch.distributed as dist

    engine.eval()
    with torch.no_grad():
        total = torch.tensor([sum(float(loss_of(engine(*b)).item()) for b in batches) / len(batches)],
                             dtype=torch.float64)
    engine.train()
    dist.all_reduce(total)
    return float(total.item()) / dist.get_world_size()


def train_config(name: str, config: dict[str, Any], build: Callable[[], Any], args: argparse.Namespace,
                 corpus: tuple[Any, Any], progress: ProgressBar, aligned: Any = None) -> dict[str, Any]:
    """Train one config; this rank's losses, step times, bytes per step and the eval points. Every step starts
    with a barrier on ``aligned`` (a process group of the same ranks, default the world), timed from there to the
    end of its last ``step()``. A group other than the engine's lets the communication a step leaves in flight (the
    weight-delta exchange, ``zeropp.engine.weight_deltas``) overlap the next forward, as in a loop without
    barriers: gloo's barrier waits for every collective issued before it on its group."""
    import torch.distributed as dist

    import zeropp
    from zeropp.data import TextBatches

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = zeropp.initialize(model=build(), config=config)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = TextBatches(corpus[0], seq_len=args.seq, global_batch=micro * accum * world, seed=args.seed)
    held = TextBatches(corpus[1], seq_len=args.seq, global_batch=micro * world, seed=args.seed + 10_000)
    evals = [held.micro_batch(k, rank=rank, world_size=world) for k in range(args.eval_batches)]
    out: dict[str, Any] = {"losses": [], "times": [], "inter": [], "intra": [], "evals": [],
                           "global_batch": micro * accum * world}
    engine.train()
    t_start = time.perf_counter()
    for step in range(args.steps):
        dist.barrier(group=aligned)
        b0, t0 = count_bytes(), time.perf_counter()
        loss_sum = 0.0
        for k in range(accum):
            loss = loss_of(engine(*data.micro_batch(step, rank=rank, world_size=world, micro=k,
                                                    micro_batches=accum)))
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.item())
        out["times"].append(time.perf_counter() - t0)
        b1 = count_bytes()
        out["inter"].append(b1[0] - b0[0])
        out["intra"].append(b1[1] - b0[1])
        out["losses"].append(loss_sum / accum)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            out["evals"].append((step + 1, evaluate(engine, evals)))
        if rank == 0:
            rate = (step + 1) / (time.perf_counter() - t_start)
            progress.update(name, step + 1, args.steps, f"{rate:5.2f} step/s  loss {out['losses'][-1]:6.3f}")
    progress.finish()
    del engine
    gc.collect()  # the engine's hooks form reference cycles: free it before the next config's
    return out


def worker(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Every config on this rank, one after the other; rank 0 writes and prints the results and returns the rows."""
    import torch
    import torch.distributed as dist

    from zeropp import comm

    torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = comm.get_default_topology().ranks_per_node
    build = model_factory(args.model, args)
    configs = [config_dict(spec, args, rpn) for spec in args.configs]
    check_batches(args.configs, configs, world)
    corpus = split_corpus(corpus_of(args), args.seq)
    load0 = os.getloadavg()[0]
    aligned = dist.new_group(backend="gloo")  # the steps' barriers: not the engines' group (train_config)
    runs: dict[str, dict[str, Any]] = {}
    with ProgressBar(not args.no_progress, elsewhere=rank != 0) as progress:
        for name, config in zip(args.labels, configs):
            runs[name] = train_config(name, config, build, args, corpus, progress, aligned)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, runs)
    load = (load0, os.getloadavg()[0])
    rows = None
    if rank == 0:
        rows = report(args, everyone, world, rpn, load)
    dist.barrier()
    dist.destroy_process_group()
    return rows


# ---- report ---------------------------------------------------------------------------------------------------


COLUMNS = ("config", "eval_loss", "eval_diff", "eval_diff_pct", "final_train_loss", "inter_MB_step",
           "intra_MB_step", "inter_vs_ref", "step_s", "speedup")
FORMATS = {"eval_loss": ".4f", "eval_diff": "+.4f", "eval_diff_pct": "+.2f", "final_train_loss": ".4f",
           "inter_MB_step": ".3f", "intra_MB_step": ".3f", "inter_vs_ref": ".3f", "step_s": ".3f",
           "speedup": ".2f"}


def summarize(name: str, per_rank: list[dict[str, Any]], args: argparse.Namespace, world: int,
              rpn: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One results row and the curve rows of config ``name`` from every rank's measurements: losses averaged over
    the ranks, step time the slowest rank's, bytes per rank averaged over ranks and over the steps after
    ``--warmup``."""
    steps, measured = args.steps, range(args.warmup, args.steps)
    losses = [sum(r["losses"][s] for r in per_rank) / world for s in range(steps)]
    times = [max(r["times"][s] for r in per_rank) for s in measured]
    mb = 1e6

    def per_step(key: str) -> float:  # bytes one rank sends per step, mean over ranks and measured steps
        return sum(r[key][s] for r in per_rank for s in measured) / world / len(measured)

    def node_max(key: str) -> float:  # the busiest node's ranks together
        return max(sum(per_rank[n * rpn + i][key][s] for i in range(rpn) for s in measured)
                   for n in range(world // rpn)) / len(measured)

    evals = per_rank[0]["evals"]  # every rank holds the same, all-reduced values
    tail = min(10, steps)
    row = {
        "config": name,
        "eval_loss": evals[-1][1],
        "eval_diff": None,
        "eval_diff_pct": None,
        "final_train_loss": sum(losses[-tail:]) / tail,
        "inter_MB_step": per_step("inter") / mb,
        "intra_MB_step": per_step("intra") / mb,
        "inter_vs_ref": None,
        "step_s": statistics.median(times),
        "speedup": None,
        "inter_MB_node_step": node_max("inter") / mb,
        "intra_MB_node_step": node_max("intra") / mb,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "model": args.model,
        "world": world,
        "ranks_per_node": rpn,
        "global_batch": per_rank[0]["global_batch"],
        "seq": args.seq,
        "steps": steps,
        "warmup": args.warmup,
        "seed": args.seed,
    }
    curve = [{"config": name, "step": s + 1, "train_loss": losses[s], "eval_loss": ""} for s in range(steps)]
    for step, value in evals:
        curve[step - 1]["eval_loss"] = value
    return row, curve


def compare(rows: list[dict[str, Any]]) -> None:
    """Fill each row's differences from the first row (the reference)."""
    ref = rows[0]
    for row in rows:
        row["eval_diff"] = row["eval_loss"] - ref["eval_loss"]
        row["eval_diff_pct"] = 100 * row["eval_diff"] / ref["eval_loss"]
        row["inter_vs_ref"] = row["inter_MB_step"] / ref["inter_MB_step"] if ref["inter_MB_step"] else None
        row["speedup"] = ref["step_s"] / row["step_s"]


def where_text(world: int, rpn: int) -> str:
    """The cluster in words: nodes, ranks, and the link rate when ``zeropp.cluster`` shaped the links."""
    rate = int(os.environ.get("ZEROPP_CLUSTER_RATE_BPS", "0") or 0)
    shaped = os.environ.get("ZEROPP_CLUSTER_SHAPED") == "1" and rate > 0
    return f"{world // rpn} nodes x {rpn} ranks, " + (f"links shaped to {rate / 1e9:g} Gbit/s" if shaped
                                                      else "links not shaped")


def report(args: argparse.Namespace, everyone: list[dict[str, dict[str, Any]]], world: int, rpn: int,
           load: tuple[float, float]) -> list[dict[str, Any]]:
    """Write results.csv, curves.csv and curves.png; print the table; return the rows."""
    rows, curves = [], []
    for name in args.labels:
        row, curve = summarize(name, [r[name] for r in everyone], args, world, rpn)
        rows.append(row)
        curves += curve
    compare(rows)
    where = where_text(world, rpn)
    for row in rows:
        row["cluster"] = where
        row["loadavg"] = f"{load[0]:.1f}->{load[1]:.1f}"
    out = Path(args.out)
    write_csv(rows, str(out / "results.csv"))
    write_csv(curves, str(out / "curves.csv"))
    if not args.no_plots:
        plot(rows, curves, out / "curves.png", f"{args.model}, {where}")
    print(rows_table(rows, COLUMNS, FORMATS))
    print()
    print(f"Reference: {rows[0]['config']}. {args.model}, {world} ranks ({where}), {rows[0]['global_batch']} x "
          f"{args.seq} tokens per step, {args.steps} steps, seed {args.seed}; eval loss on {args.eval_batches} "
          f"held-out batches (the text's last tenth) after the last step; diff = eval loss - the reference's "
          f"(pct: of the reference's); MB = 1e6 bytes one rank sends per step (mean over ranks, counted by "
          f"zeropp.comm.stats; inter = across nodes); step s = median over steps {args.warmup + 1}-{args.steps} "
          f"of the slowest rank's; load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores.")
    print(f"(results in {out}/)")
    sys.stdout.flush()
    return rows


def plot(rows: list[dict[str, Any]], curves: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training loss per config (thin: per step; thick: moving average) and eval loss (markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    steps = max(c["step"] for c in curves)
    k = max(1, min(10, steps // 10))
    for row in rows:
        pts = [c for c in curves if c["config"] == row["config"]]
        color = draw_loss_curve(ax, [c["step"] for c in pts], [c["train_loss"] for c in pts],
                                f"{row['config']} (eval {row['eval_loss']:.4f})", k)
        ev = [c for c in pts if c["eval_loss"] != ""]
        ax.plot([c["step"] for c in ev], [c["eval_loss"] for c in ev], "o--", color=color, markersize=5,
                linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"{title}\n(thin: train loss per step; thick: mean of the last {k}; circles: held-out eval loss)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ and "RANK" not in os.environ:
        raise SystemExit("run it under torchrun (or zeropp.cluster): torchrun --nproc-per-node 4 -m "
                         "zeropp.bench.convergence " + " ".join(sys.argv[1:] if argv is None else argv))
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
