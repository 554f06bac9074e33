"""``python -m zeropp.plan``: rank the partition plans of a model on a cluster (see docs/planner.md).

    python -m zeropp.plan --model gpt2 --nodes 2 --ranks-per-node 8 --inter 100gbit
    python -m zeropp.plan --model path/to/config.json --nodes 16 --ranks-per-node 8 --inter 400gbit --json
    python -m zeropp.plan --params 7000000000 --layers 32 --hidden 4096 --seq 4096 --nodes 16 --ranks-per-node 8
    torchrun --nnodes 2 --nproc-per-node 8 ... -m zeropp.plan --calibrate cluster.json   # then --cluster cluster.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ..bench.report import parse_size
from ..cluster.rates import parse_rate
from .cluster import Cluster
from .model import ModelSpec, from_hf_config, from_preset, from_sizes
from .report import as_json, text
from .search import Batch, rank
from .space import LOSSY, OFFLOAD_TIERS


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except ``None`` (the cluster options, whose defaults are ``Cluster.default``'s and
    named in their help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    a = argparse.ArgumentParser(prog="python -m zeropp.plan", description=__doc__.splitlines()[0],
                                formatter_class=_Help)
    m = a.add_argument_group("model (a preset or config.json, or --params/--layers/--hidden)")
    m.add_argument("--model", help="a zeropp.models preset (tiny, mini, small, gpt2, ...; ':nobias' for no biases) "
                                   "or a Hugging Face config.json")
    m.add_argument("--params", type=int, help="parameter count")
    m.add_argument("--layers", type=int, help="transformer blocks")
    m.add_argument("--hidden", type=int, help="hidden size")
    c = a.add_argument_group("cluster")
    c.add_argument("--cluster-file", "--cluster", dest="cluster_file",
                   help="a JSON file of Cluster fields (SI units), e.g. from --calibrate; the options below are then "
                        "ignored")
    c.add_argument("--calibrate", metavar="FILE",
                   help="measure this cluster's links, compute and memory rates and write them to FILE (run on every "
                        "rank, under torchrun or python -m zeropp.cluster); nothing is planned")
    h100 = Cluster.default()
    c.add_argument("--nodes", type=int, default=h100.nodes)
    c.add_argument("--ranks-per-node", type=int, default=h100.ranks_per_node)
    c.add_argument("--intra", help=f"intra-node bandwidth per rank (default {h100.intra_bw * 8 / 1e12:g}tbit)")
    c.add_argument("--inter", help=f"inter-node bandwidth per node, all its NICs (default "
                                   f"{h100.inter_bw * 8 / 1e9:g}gbit)")
    c.add_argument("--intra-latency-us", type=float, help=f"(default {h100.intra_latency * 1e6:g})")
    c.add_argument("--inter-latency-us", type=float, help=f"(default {h100.inter_latency * 1e6:g})")
    c.add_argument("--memory", help=f"memory per rank (bytes; K, M, G suffixes are binary; default "
                                    f"{h100.memory / 2**30:g}G)")
    c.add_argument("--flops", type=float, help=f"achieved training FLOP/s per rank (default {h100.flops:g})")
    c.add_argument("--mem-bw", type=float, help=f"memory bandwidth per rank, bytes/s (default {h100.mem_bw:g})")
    c.add_argument("--overlap", type=float, help=f"fraction of compute that hides communication (default "
                                                 f"{h100.overlap:g})")
    b = a.add_argument_group("batch")
    b.add_argument("--micro", type=int, default=1, help="micro-batch per rank (sequences)")
    b.add_argument("--seq", type=int, help="sequence length (default: the model's context)")
    b.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    b.add_argument("--dtype-bytes", type=int, default=2, help="compute dtype size: 2 (bf16/fp16) or 4 (fp32)")
    o = a.add_argument_group("output")
    o.add_argument("--offload", default=",".join(OFFLOAD_TIERS), help="optimizer offload tiers to consider")
    o.add_argument("--lossy", choices=LOSSY, default="standard",
                   help="lossy options to consider: none, standard (qwZ, qgZ int4, deltas), all (+ int2 gradients)")
    o.add_argument("--runnable", action="store_true", help="only plans the engine runs today")
    o.add_argument("--top", type=int, default=15, help="plans to show")
    o.add_argument("--json", action="store_true", help="JSON instead of a table")
    return a


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model of the command line: ``--model`` (a preset name or a ``.json`` path) or the three sizes."""
    sizes = (args.params, args.layers, args.hidden)
    if args.model is not None:
        if any(v is not None for v in sizes):
            raise ValueError("give --model or --params/--layers/--hidden, not both")
        if args.model.endswith(".json"):
            return from_hf_config(args.model, args.seq)
        return from_preset(args.model, args.seq)
    if any(v is None for v in sizes):
        raise ValueError("no model: give --model (a preset or a config.json) or all of --params, --layers, --hidden")
    return from_sizes(args.params, args.layers, args.hidden, args.seq or 2048)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    if args.cluster_file:
        return Cluster.from_json(args.cluster_file)
    changes: dict[str, float] = {}
    if args.memory is not None:
        try:
            changes["memory"] = float(parse_size(args.memory))
        except ValueError:
            raise ValueError(f"--memory={args.memory!r} is not a size; use bytes or K, M, G (binary), e.g. 80G") \
                from None
    for flag, field, value in (("--intra", "intra_bw", args.intra), ("--inter", "inter_bw", args.inter)):
        if value is not None:
            try:
                changes[field] = parse_rate(value) / 8
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
    for field, value, scale in (("intra_latency", args.intra_latency_us, 1e-6),
                                ("inter_latency", args.inter_latency_us, 1e-6), ("flops", args.flops, 1.0),
                                ("mem_bw", args.mem_bw, 1.0), ("overlap", args.overlap, 1.0)):
        if value is not None:
            changes[field] = value * scale
    return replace(Cluster.default(args.nodes, args.ranks_per_node), **changes)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.calibrate:
        from .calibrate import main as calibrate

        try:
            return calibrate(args.calibrate)
        except ValueError as e:
            print(f"python -m zeropp.plan --calibrate: {e}", file=sys.stderr)
            return 2
    try:
        model = model_from_args(args)
        cluster = cluster_from_args(args)
        batch = Batch(args.micro, args.seq or model.seq, args.accum, args.dtype_bytes)
        tiers = tuple(t.strip() for t in args.offload.split(",") if t.strip())
        bad = [t for t in tiers if t not in OFFLOAD_TIERS]
        if bad or not tiers:
            raise ValueError(f"--offload={args.offload!r}: tiers must be among {list(OFFLOAD_TIERS)}")
        if args.top < 1:
            raise ValueError(f"--top={args.top} must be at least 1")
        if cluster.world < 2:
            raise ValueError(f"{cluster.nodes} node(s) x {cluster.ranks_per_node} rank(s): one rank has nothing to "
                             f"shard; give at least 2 ranks")
    except ValueError as e:
        print(f"python -m zeropp.plan: {e}", file=sys.stderr)
        return 2
    ranked = rank(model, cluster, batch, tiers, args.runnable, args.lossy)
    print((as_json if args.json else text)(model, cluster, batch, ranked, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
