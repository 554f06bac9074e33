"""Running a command on the emulated cluster: one ``torchrun`` per node, supervised, always cleaned up.

Shaped: node ``i``'s ``torchrun --nnodes K --node-rank i --nproc-per-node R --master-addr <node 0> --master-port
P`` runs inside namespace ``zeropp-<id>-n<i>`` (``ip netns exec``), with ``GLOO_SOCKET_IFNAME=eth0`` so gloo
reaches the other nodes over the shaped link. Unshaped (``--unshaped``, or the automatic fallback): one
``torchrun --nproc-per-node K*R`` on the host's loopback. Either way the ranks get ``ZEROPP_RANKS_PER_NODE=R``
(so ``zeropp.comm.Topology`` forms the same K nodes), ``OMP_NUM_THREADS`` (1 unless the caller sets it) and
``ZEROPP_CLUSTER_*`` variables describing the run.

Supervision: the first node whose ``torchrun`` exits non-zero stops the run (the other nodes' ranks would wait in
a collective until gloo's 30-minute timeout): every ``torchrun`` gets SIGTERM (it stops its ranks), then SIGKILL
with its ranks (found through /proc, or as the processes left in the namespaces) after a grace period, and the
launcher names the rank that failed, its node and its exit code (read from the failure report torchrun writes to
its stderr, which the launcher copies through to its own as it comes). The same stop happens on a timeout, on
Ctrl-C and on SIGTERM/SIGHUP to the launcher, and the namespaces are deleted last. If the launcher itself is killed
(SIGKILL), each torchrun gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and stops its ranks; the namespaces
are left behind, and the next launcher to build a network removes them (``netns.cleanup_stale``), as does
``python -m zeropp.cluster --cleanup``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .netns import (
    SETUP_HINT,
    ClusterUnavailable,
    emulated_network,
    kill_namespace_processes,
    shaping_available,
)
from .rates import format_rate
from .spec import ClusterSpec

TIMEOUT_EXIT = 124
_PYTHON = re.compile(r"^python[0-9.]*$")
# torchrun's failure report: "Root Cause (first observed failure):" then "rank : 3 (local_rank: 1)", "exitcode : 1"
_ROOT_CAUSE = re.compile(rb"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*exitcode\s*:\s*(-?\d+)", re.DOTALL)
_TAIL_BYTES = 1 << 16


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGTERM or SIGHUP (SIGINT arrives as a plain KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def torchrun_args(command: Sequence[str]) -> list[str]:
    """What follows torchrun's own options for ``command``, the per-rank command.

    ``python -m mod args`` -> ``-m mod args``; ``python script.py args`` and ``script.py args`` -> ``script.py
    args`` (any ``python``/``python3.x``/``sys.executable`` is replaced by the launcher's interpreter, the one
    torchrun runs its ranks with); anything else (a program) -> ``--no-python prog args``.
    """
    command = list(command)
    if not command:
        raise ValueError("no command given: e.g. `-- python -m zeropp.bench.training --steps 20`")
    exe = command[0]
    is_python = _PYTHON.match(os.path.basename(exe)) is not None or (
        os.path.exists(exe) and os.path.realpath(exe) == os.path.realpath(sys.executable))
    if is_python:
        rest = command[1:]
        if not rest:
            raise ValueError("`python` needs a script or `-m module` to run under torchrun")
        if rest[0] == "-m":
            if len(rest) < 2:
                raise ValueError("`python -m` needs a module name")
            return ["-m", *rest[1:]]
        if rest[0].startswith("-m") and len(rest[0]) > 2:
            return ["-m", rest[0][2:], *rest[1:]]
        if rest[0].startswith("-"):
            raise ValueError(f"python option {rest[0]!r} is not supported under torchrun: use `-m module` or a "
                             "script path (set interpreter options through the environment, e.g. PYTHONWARNINGS)")
        return rest
    if exe.endswith(".py"):
        return command
    return ["--no-python", *command]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(spec: ClusterSpec, env: Mapping[str, str] | None, shaped: bool, node: int | None = None,
             run_id: str = "") -> dict[str, str]:
    """The environment the ranks of ``node`` get: the caller's, ``env`` on top, then the cluster's variables."""
    e = dict(os.environ)
    if env:
        e.update({str(k): str(v) for k, v in env.items()})
    e["ZEROPP_RANKS_PER_NODE"] = str(spec.ranks_per_node)
    e.setdefault("OMP_NUM_THREADS", str(spec.omp_threads))
    e["ZEROPP_CLUSTER_NODES"] = str(spec.nodes)
    e["ZEROPP_CLUSTER_SHAPED"] = "1" if shaped and spec.rate is not None else "0"
    e["ZEROPP_CLUSTER_RATE_BPS"] = str(int(spec.rate_bps)) if shaped and spec.rate is not None else "0"
    e["ZEROPP_CLUSTER_RUN_ID"] = run_id
    if shaped:
        from .netns import NODE_IFNAME

        e["GLOO_SOCKET_IFNAME"] = NODE_IFNAME
        e["TP_SOCKET_IFNAME"] = NODE_IFNAME
        # c10d warns on every store connection that the node's private address has no host name (no reverse
        # DNS inside the namespaces); keep its warnings out unless the caller asked for a log level
        e.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        e["ZEROPP_CLUSTER_NODE"] = str(node)
    else:
        e.pop("ZEROPP_CLUSTER_NODE", None)
    return e


def _launcher() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def _descendants(pids: list[int]) -> list[int]:
    """All live descendants of ``pids`` (from /proc; torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(pids)
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _find_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up in the launcher (the child must run as little Python as it can), or ``None``
    off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the torchrun gets SIGTERM if the launcher dies (even by SIGKILL); kept across exec."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


class _StderrCopy(threading.Thread):
    """Copies one torchrun's stderr (which its ranks share) to this process's stderr (fd 2) as it comes, and keeps
    the last ``_TAIL_BYTES`` of it, where torchrun's failure report ends up."""

    def __init__(self, pipe: int) -> None:
        super().__init__(daemon=True)
        self.pipe = pipe
        self.tail = b""

    def run(self) -> None:
        try:
            while chunk := os.read(self.pipe, 65536):
                self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
                view = memoryview(chunk)
                while view:
                    view = view[os.write(2, view):]
        except OSError:
            pass
        finally:
            os.close(self.pipe)

    def failed_rank(self) -> tuple[int, int, int] | None:
        """``(rank, local rank, exit code)`` of the first failure torchrun reported, if it did."""
        found = _ROOT_CAUSE.findall(self.tail)
        return tuple(int(v) for v in found[-1]) if found else None  # type: ignore[return-value]


def _signal_all(procs: list[subprocess.Popen], extra: list[int], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
    for pid in extra:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop(procs: list[subprocess.Popen], namespaces: list[str], grace: float = 5.0) -> None:
    """SIGTERM the torchruns (they stop their ranks), then SIGKILL them and every descendant left."""
    if not any(p.poll() is None for p in procs) and not namespaces:
        return
    ranks = _descendants([p.pid for p in procs])
    _signal_all(procs, [], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    ranks += _descendants([p.pid for p in procs if p.poll() is None])
    _signal_all(procs, ranks, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
    if namespaces:
        kill_namespace_processes(namespaces, grace=0.5)


def _failure_report(node: int, rc: int, copy: _StderrCopy, ranks_per_node: int, shaped: bool) -> str:
    """One line naming the failed rank (from torchrun's report) and node, and what the launcher did."""
    found = copy.failed_rank()
    where = f"node {node}'s torchrun exited with {rc}" if shaped else f"torchrun exited with {rc}"
    if found is None:
        return f"zeropp.cluster: {where} (its report above names the failed rank); stopped every rank"
    rank, local, code = found
    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
    return (f"zeropp.cluster: rank {rank} (node {rank // ranks_per_node}, local rank {local}) {how}; {where}; "
            "stopped every other rank")


def _supervise(commands: list[list[str]], envs: list[dict[str, str]], timeout: float | None,
               namespaces: list[str], quiet: bool, ranks_per_node: int = 1, shaped: bool = False) -> int:
    procs: list[subprocess.Popen] = []
    copies: list[_StderrCopy] = []
    handlers: dict[int, object] = {}
    failure: tuple[int, int] | None = None

    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, on_signal)
    try:
        # every torchrun is forked before the copying threads start: preexec_fn runs Python in the child, which is
        # only safe while this process has no other thread of its own
        for cmd, env in zip(commands, envs):
            read, write = os.pipe()
            copies.append(_StderrCopy(read))
            try:
                procs.append(subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stderr=write, start_new_session=True,
                    preexec_fn=_die_with_parent if _PRCTL is not None else None))  # noqa: PLW1509 - see above
            finally:
                os.close(write)
        for copy in copies:
            copy.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                failure = failed[0]
                rc = failure[1]
                return rc if rc > 0 else 128 - rc
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                if not quiet:
                    print(f"zeropp.cluster: timed out after {timeout:g} s; stopping all nodes", file=sys.stderr,
                          flush=True)
                return TIMEOUT_EXIT
            time.sleep(0.05)
    finally:
        _stop(procs, namespaces)
        for copy in copies:
            if copy.ident is None:  # never started (a Popen failed): its pipe is still ours to close
                os.close(copy.pipe)
            else:
                copy.join(timeout=2.0)  # the ranks are gone: their stderr ends at once
        if failure is not None:
            node, rc = failure
            print(_failure_report(node, rc, copies[node], ranks_per_node, shaped), file=sys.stderr, flush=True)
        for sig, old in handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def resolve_shaped(spec: ClusterSpec, quiet: bool = False) -> bool:
    """Whether ``run(spec, ...)`` uses namespaces: ``False`` when ``spec.unshaped``; when namespaces cannot be
    built here, ``False`` with a note (``fallback="auto"``) or ``ClusterUnavailable`` (``fallback="error"``)."""
    if spec.unshaped:
        return False
    ok, reason = shaping_available()
    if ok:
        return True
    message = f"cannot build emulated nodes: {reason}. {SETUP_HINT}"
    if spec.fallback == "error":
        raise ClusterUnavailable(message)
    if not quiet:
        print(f"zeropp.cluster: {message}\nzeropp.cluster: falling back to --unshaped (no rate limit).",
              file=sys.stderr, flush=True)
    return False


def run(spec: ClusterSpec, command: Sequence[str], env: Mapping[str, str] | None = None,
        timeout: float | None = None, *, quiet: bool = False) -> int:
    """Run ``command`` on every rank of the emulated cluster ``spec``; return 0 when every rank succeeded.

    Args:
        spec: the cluster (nodes, ranks per node, rate, fallback).
        command: the per-rank command, e.g. ``["python", "-m", "zeropp.bench.training", "--steps", "20"]`` or
            ``["path/to/script.py", "--flag"]`` (see ``torchrun_args``).
        env: variables added to the launcher's environment for the ranks.
        timeout: seconds before everything is stopped (returns 124).
        quiet: no notes on stderr (a failed rank is still named there). The ranks' output goes to this process's
            stdout and stderr as it comes (stderr copied through the launcher, which reads torchrun's failure
            report from it).

    Returns:
        0, or the exit status of the first node whose torchrun failed (torchrun exits 1 when a rank fails; the
        rank, its node and its own exit code are named on stderr), or 124 on timeout.

    Raises:
        ClusterUnavailable: namespaces impossible here and ``spec.fallback == "error"``.
        KeyboardInterrupt: Ctrl-C (``Interrupted`` for SIGTERM/SIGHUP), after everything was stopped and removed.
    """
    tail = torchrun_args(command)
    shaped = resolve_shaped(spec, quiet=quiet)
    launcher = _launcher()
    if not shaped:
        port = spec.port or free_port()
        cmd = launcher + ["--nnodes", "1", "--nproc-per-node", str(spec.world_size), "--master-addr", "127.0.0.1",
                          "--master-port", str(port)] + tail
        if not quiet:
            print(f"zeropp.cluster: {spec.nodes} nodes x {spec.ranks_per_node} ranks, unshaped (one torchrun on "
                  "loopback, nodes = rank groups)", file=sys.stderr, flush=True)
        return _supervise([cmd], [rank_env(spec, env, False)], timeout, [], quiet, spec.ranks_per_node, False)
    port = spec.port or 29500  # each run's namespaces are a fresh network stack: nothing else listens there
    with emulated_network(spec) as net:
        if not quiet:
            rate = "unshaped veth" if spec.rate is None else f"{format_rate(spec.rate_bps)} per node, each way"
            print(f"zeropp.cluster: {spec.nodes} nodes x {spec.ranks_per_node} ranks, links {rate}, namespaces "
                  f"{net.nodes[0].namespace} .. {net.nodes[-1].namespace}, master {net.master_addr}:{port}",
                  file=sys.stderr, flush=True)
        commands, envs = [], []
        for node in net.nodes:
            commands.append(node.exec_prefix() + launcher + [
                "--nnodes", str(spec.nodes), "--node-rank", str(node.index),
                "--nproc-per-node", str(spec.ranks_per_node),
                "--master-addr", net.master_addr, "--master-port", str(port)] + tail)
            envs.append(rank_env(spec, env, True, node.index, net.run_id))
        return _supervise(commands, envs, timeout, net.namespaces, quiet, spec.ranks_per_node, True)
