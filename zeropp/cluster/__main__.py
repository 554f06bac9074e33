"""``python -m zeropp.cluster``: run a command on an emulated cluster, check the machine, or clean up.

    python -m zeropp.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- python -m zeropp.bench.training --steps 20
    python -m zeropp.cluster --nodes 2 --ranks-per-node 2 --unshaped -- path/to/script.py
    python -m zeropp.cluster --check            # can namespaces be built here? (exit 0 yes, 1 no)
    python -m zeropp.cluster --cleanup [--force]

Exit status: the command's (0 when every rank succeeded; the failing node's torchrun status otherwise), 124 on
--timeout, 128 + signal number when interrupted, 2 for bad arguments, 3 when namespaces are impossible and
--fallback error.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .launch import Interrupted, run
from .netns import SETUP_HINT, ClusterUnavailable, cleanup, shaping_available
from .rates import parse_rate
from .spec import ClusterSpec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zeropp.cluster",
        description="Run a torchrun command on K emulated nodes (network namespaces with rate-limited links).",
        epilog="Everything after `--` is the per-rank command: `python -m module args`, `python script.py args`, "
               "`script.py args` or a program. Needs root and iproute2 for namespaces; see docs/cluster.md.",
    )
    p.add_argument("--nodes", type=int, default=2, help="number of nodes K (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node R (default 2)")
    p.add_argument("--rate", default="1gbit", help="each node's link rate, both ways, e.g. 1gbit, 500mbit, 10gbit "
                   "(default 1gbit); 'none' keeps the namespaces but does not shape")
    p.add_argument("--unshaped", action="store_true",
                   help="no namespaces: one torchrun with K*R ranks on loopback, nodes = rank groups")
    p.add_argument("--fallback", choices=("auto", "error"), default="auto",
                   help="when namespaces are impossible here: auto = run --unshaped with a note (default), "
                        "error = exit 3")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default 29500 in the namespaces, "
                   "a free port when unshaped)")
    p.add_argument("--burst", type=int, default=None, help="tbf burst in bytes (default 4 ms of rate, >= 64 KiB)")
    p.add_argument("--latency", type=float, default=50.0, help="tbf queue latency in ms (default 50)")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds (exit 124)")
    p.add_argument("--quiet", action="store_true", help="no launcher notes on stderr")
    p.add_argument("--check", action="store_true", help="say whether namespaces can be built here, then exit")
    p.add_argument("--cleanup", action="store_true",
                   help="delete namespaces (and their processes) left by crashed runs, then exit")
    p.add_argument("--force", action="store_true", help="with --cleanup: also those of runs still alive")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the per-rank command")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.check:
        ok, reason = shaping_available()
        print("namespaces and tbf shaping: available" if ok else f"not available: {reason}. {SETUP_HINT}")
        return 0 if ok else 1
    if args.cleanup:
        ok, reason = shaping_available()
        if not ok:
            print(f"zeropp.cluster: nothing to clean here ({reason})", file=sys.stderr)
            return 0
        removed = cleanup(force=args.force)
        print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if not command:
        _parser().error("no command: add `-- python -m zeropp.bench.training ...` (or use --check / --cleanup)")
    try:
        rate = None if args.rate.lower() in ("none", "off") else args.rate
        if rate is not None:
            parse_rate(rate)
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate=rate,
                           unshaped=args.unshaped, fallback=args.fallback, port=args.port, burst=args.burst,
                           latency=args.latency)
    except ValueError as e:
        _parser().error(str(e))
    # a launcher started in the background of a non-interactive shell inherits SIGINT ignored: it must still stop
    # and clean up when sent one
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(spec, command, timeout=args.timeout, quiet=args.quiet)
    except ClusterUnavailable as e:
        print(f"zeropp.cluster: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        _parser().error(str(e))
    except Interrupted as e:
        print(f"zeropp.cluster: stopped by signal {e.signum}; cleaned up", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("zeropp.cluster: interrupted; cleaned up", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
