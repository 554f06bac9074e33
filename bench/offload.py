"""The offload tiers side by side: step time, its phases and peak memory per rank, and the NVMe rates against the
disk's raw rates measured in the same run (just before each NVMe tier).

    python bench/offload.py --preset small --nodes 2 --ranks-per-node 2 --steps 6 --nvme /tmp/zeropp-nvme
    python bench/offload.py --big --nvme /var/tmp/zeropp-nvme --steps 3       # GPT-2 XL's blocks (1.5B), one rank
    python bench/offload.py --big --steps 2 --checkpoint --tiers nvme-pipelined  # + a checkpoint save and load

Each tier runs in its own ``torchrun`` (gloo, the emulated nodes of ``zeropp.cluster``'s convention:
``ZEROPP_RANKS_PER_NODE``), so that each process's peak RSS is that tier's. Tiers: ``none`` (the
optimizer's side on the device), ``cpu`` (``offload_optimizer.device: "cpu"``: on a CPU-only machine the same memory
as ``none``), ``nvme`` (swap files, each read and write waited for: DeepSpeed's default), ``nvme-pipelined``
(``pipeline_read`` and ``pipeline_write``: reads ahead and writes behind overlap the step); and the compute shards'
tiers (stage 3): ``param-cpu`` (``offload_param: "cpu"``), ``param-nvme`` (``offload_param: "nvme"``, every shard
swapped: ``max_in_cpu`` 0) and ``both-nvme`` (``nvme-pipelined`` and ``param-nvme`` together). Per tier: the seconds
``initialize`` took; the median step time of the steps after the first, split into forward, backward and optimizer
step, and within the step the seconds the engine waited for swap reads and writes; the swap bytes per step, the
rate they were moved at over the optimizer step (bytes / its time) and that rate as a fraction of the raw disk's
("of raw": the time the raw rates would take to read and then write the same bytes, over the optimizer step's
time); peak RSS per rank (the largest rank), also per phase (``initialize``, forward and backward, optimizer step:
Linux's ``VmHWM``, reset at each phase's start), and RSS before ``initialize``. The parameter tiers add the shard
bytes swapped per step. With ``--checkpoint``, each tier then saves a checkpoint (under ``--nvme``) and loads it back
into the same engine: the seconds and peak RSS of each (an NVMe save reads each parameter's piece from the swap files
as it is written, a load holds ``buffer_count`` units at a time), then deletes it.

``--big`` builds a byte-level GPT of ``--n-layer`` x ``--n-embd`` (default 49 x 1600: 1.51B parameters, GPT-2 XL's
blocks plus one, which its byte vocabulary's small embedding leaves out of its 1.5B) on the meta device
(``zeropp.Init``), stage 3 in bf16 at one rank, and runs the NVMe tiers only: its fp32 masters and Adam moments (12
bytes per parameter) live in the swap files, the fp32 gradient shard (4 bytes) and the bf16 weights (2 bytes) in
memory. Before each NVMe tier, ``zeropp.offload.measure_disk`` writes and reads a file of ``--disk-bytes`` under
``--nvme`` (O_DIRECT where the filesystem allows it): the raw sequential rates the engine's are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIERS = {
    "none": {},
    "cpu": {"offload_optimizer": {"device": "cpu"}},
    "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}"}},
    "nvme-pipelined": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "pipeline_read": True,
                                             "pipeline_write": True}},
    "param-cpu": {"offload_param": {"device": "cpu"}},
    "param-nvme": {"offload_param": {"device": "nvme", "nvme_path": "{nvme}", "max_in_cpu": 0}},
}
TIERS["both-nvme"] = {**TIERS["nvme-pipelined"], **TIERS["param-nvme"]}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start a new peak-RSS window (Linux: ``VmHWM`` reset by writing 5 to ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    """Peak RSS in bytes since the last ``_reset_peak`` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(args: argparse.Namespace) -> None:
    """One tier under torchrun: train, time, and write rank 0's JSON (every rank's memory gathered)."""
    import torch
    import torch.distributed as dist

    import zeropp
    from zeropp.models.gpt import GPT, GPTConfig

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tier = json.loads(json.dumps(TIERS[args.worker]).replace("{nvme}", args.nvme))
    for block in tier.values():
        block["pin_memory"] = False  # no CUDA here: page-locked memory is for copies to a GPU
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v is not None}
    if args.big:
        overrides.setdefault("n_layer", 49)
        overrides.setdefault("n_embd", 1600)
        overrides.setdefault("n_head", 25)
    cfg = GPTConfig.preset(args.preset, **overrides)
    config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": args.stage, **tier},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    if args.dtype != "fp32":
        config[args.dtype] = {"enabled": True}
    rss_before = _rss()
    _reset_peak()
    start = time.perf_counter()
    if args.big:
        with zeropp.Init():
            model = GPT(cfg)
        engine, _, _, _ = zeropp.initialize(model=model, config=config, init_seed=0)
    else:
        engine, _, _, _ = zeropp.initialize(model=GPT(cfg, seed=0), config=config)
    init_s = time.perf_counter() - start
    peaks = {"init": _peak()}
    psi = sum(sum(s.numel() for s in u.shapes) for u in engine.units)
    g = torch.Generator().manual_seed(rank)
    seq = min(cfg.block_size, args.seq)
    phases: list[dict[str, float]] = []
    for step in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=g)
        before = {**engine.offload.counters, **_param_counters(engine)}
        _reset_peak()
        t0 = time.perf_counter()
        _, loss = engine(x[:, :-1], x[:, 1:])
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        peaks["forward+backward"] = max(peaks.get("forward+backward", 0), _peak())
        _reset_peak()
        engine.step()
        t3 = time.perf_counter()
        peaks["step"] = max(peaks.get("step", 0), _peak())
        after = {**engine.offload.counters, **_param_counters(engine)}
        phases.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0,
                       **{k: after[k] - before[k] for k in after}})
        if rank == 0:
            print(f"[{args.worker}] step {step}: {t3 - t0:.2f} s (optimizer step {t3 - t2:.2f} s), loss "
                  f"{loss.item():.3f}", file=sys.stderr, flush=True)
    saving: dict[str, float] = {}
    if args.checkpoint:
        where = os.path.join(args.nvme, "checkpoint")
        for what, call in (("save", lambda: engine.save_checkpoint(where, tag="t")),
                           ("load", lambda: engine.load_checkpoint(where, tag="t"))):
            _reset_peak()
            start = time.perf_counter()
            call()
            saving[f"{what} s"] = time.perf_counter() - start
            peaks[what] = _peak()
        if rank == 0:
            shutil.rmtree(where)
    peak = max(peaks.values())  # (resetting VmHWM also resets what getrusage's ru_maxrss reads)
    engine.destroy()
    mine = {"peak_rss": peak, "rss_before": rss_before, "peaks": peaks, "saving": saving}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        timed = phases[1:] or phases
        median = {k: statistics.median(p[k] for p in timed) for k in timed[0]}
        Path(args.out).write_text(json.dumps({"tier": args.worker, "psi": psi, "init_s": init_s, "world": world,
                                              "median": median, "ranks": every, "steps": phases}))
    dist.destroy_process_group()


def _param_counters(engine) -> dict[str, int]:
    return {f"param_{k}": v for k, v in engine.param_offload.counters.items() if k.startswith("bytes")}


def run_tier(args: argparse.Namespace, tier: str, out: Path) -> dict:
    world = 1 if args.big else args.nodes * args.ranks_per_node
    env = {**os.environ, "ZEROPP_RANKS_PER_NODE": str(1 if args.big else args.ranks_per_node),
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__,
           "--worker", tier, "--out", str(out), *sys.argv[1:]]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/offload.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-embd", type=int)
    parser.add_argument("--big", action="store_true", help="a 1.51B-parameter GPT on one rank, NVMe tiers only")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--tiers", default=None, help="comma-separated, from " + ",".join(TIERS))
    parser.add_argument("--nvme", default=None, help="the swap directory (default: a temporary one under /var/tmp)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="after the steps, save a checkpoint under --nvme and load it back (time, peak RSS)")
    parser.add_argument("--disk-bytes", type=float, default=2 * 2**30, help="--big: the raw-rate test file's size")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from zeropp.bench.report import progress, rows_table
    from zeropp.offload import measure_disk

    tiers = args.tiers.split(",") if args.tiers else (["nvme", "nvme-pipelined"] if args.big else list(TIERS))
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        if args.nvme is None:
            args.nvme = scratch
            sys.argv += ["--nvme", scratch]
        Path(args.nvme).mkdir(parents=True, exist_ok=True)
        rows = []
        for tier in tiers:
            disk = None
            if "nvme" in tier:  # just before the tier: the disk is shared, its rates drift
                progress(f"raw disk rates under {args.nvme} ({args.disk_bytes / 2**30:.1f} GiB)")
                disk = measure_disk(args.nvme, int(args.disk_bytes))
            progress(f"tier {tier}")
            r = run_tier(args, tier, Path(scratch) / f"{tier}.json")
            m = r["median"]
            moved = m["bytes_read"] + m["bytes_written"]
            rows.append({"tier": tier, "init s": r["init_s"], "step s": m["total"], "forward s": m["forward"],
                         "backward s": m["backward"], "optimizer s": m["step"], "read wait s": m["read_wait_s"],
                         "write wait s": m["write_wait_s"],
                         "swap GB/step": moved / 1e9, "swap GB/s": moved / m["step"] / 1e9 if moved else None,
                         "param swap GB/step": (m["param_bytes_read"] + m["param_bytes_written"]) / 1e9,
                         "of raw": (m["bytes_read"] / disk.read_bytes_per_s
                                    + m["bytes_written"] / disk.write_bytes_per_s) / m["step"]
                         if moved and disk is not None else None,
                         "raw R/W GB/s": (f"{disk.read_bytes_per_s / 1e9:.2f}/{disk.write_bytes_per_s / 1e9:.2f}"
                                          f"{'' if disk.direct else ' (cached)'}" if disk is not None else None),
                         "peak RSS GB": max(x["peak_rss"] for x in r["ranks"]) / 1e9,
                         **{f"{phase} peak GB": max(x["peaks"][phase] for x in r["ranks"]) / 1e9
                            for phase in ("init", "forward+backward", "step", *(("save", "load") if args.checkpoint
                                                                                else ()))},
                         **({k: max(x["saving"][k] for x in r["ranks"]) for k in ("save s", "load s")}
                            if args.checkpoint else {}),
                         "RSS before GB": max(x["rss_before"] for x in r["ranks"]) / 1e9})
        world = 1 if args.big else args.nodes * args.ranks_per_node
        print(f"GPT {args.preset}{' --big' if args.big else ''}: {r['psi'] / 1e6:.1f}M parameters, {world} rank(s), "
              f"stage {args.stage}, {args.dtype}, AdamW, batch {args.batch} x {args.seq}, {args.threads} thread(s) "
              f"per rank; medians of steps 2-{args.steps}")
        print(rows_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
