"""The emulated network: one Linux network namespace per node, joined by a bridge, links shaped with ``tbf``.

Layout of a run with id ``<id>`` (``<owner pid>-<owner start time>-<serial>``, see ``new_run_id``)::

    namespace zeropp-<id>-sw        bridge br0, ports n0 .. n<K-1>        (the "switch": nothing touches the
                                     | tbf egress: switch -> node i        host's own network namespace)
    namespace zeropp-<id>-n<i>      eth0 = <subnet host i+1>/24, lo up
                                       tbf egress: node i -> switch

Both ends of node ``i``'s veth pair carry a root ``tbf`` qdisc at the spec's rate, so everything node ``i`` sends
to or receives from other nodes is limited to the rate. Traffic between ranks of one node never leaves the
namespace: to the node's own address (or 127.0.0.1) the kernel delivers it through ``lo``, unshaped, even when
gloo binds its sockets to ``eth0``'s address (measured: see docs/cluster.md).

Every command here is ``ip``/``tc`` run on namespaces this module creates; the host's namespace is only read
(``ip netns list``). Tearing down kills the processes left in the namespaces, then deletes them; deleting a
namespace destroys its veth ends (and with them the peers and the qdiscs): no link ever lives in the host's
namespace, so the namespaces are all a run leaves behind.

Concurrent runs never collide: each has its own switch namespace, so addresses, the bridge name and ports are
per-run network stacks, and the run ids (so the namespace names) are unique per launcher process and run. A run
whose launcher was killed (SIGKILL) leaves its namespaces; ``build_network`` removes those of launchers that no
longer exist (``cleanup``) before it builds, so they do not pile up.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .rates import tc_rate
from .spec import ClusterSpec

PREFIX = "zeropp-"
NODE_IFNAME = "eth0"
BRIDGE = "br0"
# <pid>-<start time>-<serial>-<sw|n<i>>; names of older versions, <pid>-<4 hex>-<...>, have no start time
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(?:(\d+)-)?([0-9a-f]+)-(sw|n\d+)$")
_SERIAL = itertools.count()

SETUP_HINT = (
    "emulated nodes need Linux network namespaces: run as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN, "
    "e.g. `sudo`, or a container started with --privileged / --cap-add NET_ADMIN --cap-add SYS_ADMIN) with "
    "iproute2 installed (`apt-get install iproute2` on Debian/Ubuntu: it provides `ip` and `tc`, with the "
    "tbf qdisc). Without them, --unshaped (ClusterSpec(unshaped=True)) runs all ranks in one namespace on "
    "loopback, the nodes emulated by rank groups only (one torchrun with K*R processes and "
    "ZEROPP_RANKS_PER_NODE=R): same code paths, no rate limit."
)


class ClusterUnavailable(RuntimeError):
    """Network namespaces or shaping cannot be set up on this machine (the message says why and how to fix)."""


class NetworkSetupError(RuntimeError):
    """An ``ip``/``tc`` command failed while building the network."""


def _cmd(args: list[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetworkSetupError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@functools.lru_cache(maxsize=1)
def shaping_available() -> tuple[bool, str]:
    """Whether shaped namespaces can be built here, and why not: ``(True, "")`` or ``(False, reason)``.

    Checks Linux, ``ip`` and ``tc`` on the PATH, then really builds a probe namespace with a veth pair
    and a ``tbf`` qdisc and deletes it (an unprivileged container passes the first checks and fails here).
    The answer is cached for the process.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are Linux only (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found on PATH (package iproute2)"
    probe = f"{PREFIX}{new_run_id()}-sw"
    try:
        _cmd(["ip", "netns", "add", probe])
    except (NetworkSetupError, OSError, subprocess.TimeoutExpired) as e:
        if os.geteuid() != 0:
            return False, f"not running as root (euid {os.geteuid()}): `ip netns add` failed: {e}"
        return False, f"`ip netns add` failed (no CAP_SYS_ADMIN here, e.g. an unprivileged container?): {e}"
    try:
        _cmd(["ip", "-n", probe, "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1"])
        _cmd(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit",
              "burst", "65536", "latency", "50ms"])
    except (NetworkSetupError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"veth pair or tbf qdisc could not be made in a namespace: {e}"
    finally:
        _cmd(["ip", "netns", "del", probe], check=False)
    return True, ""


def require_shaping() -> None:
    """Raise ``ClusterUnavailable`` (what is missing and how to fix it) unless ``shaping_available()``."""
    ok, reason = shaping_available()
    if not ok:
        raise ClusterUnavailable(f"cannot build emulated nodes: {reason}. {SETUP_HINT}")


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, its address on the cluster subnet and its interface there."""

    index: int
    namespace: str
    address: str
    interface: str = NODE_IFNAME
    switch_port: str = ""

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the node (``ip netns exec <namespace>``)."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass
class Network:
    """A built emulated network (what ``emulated_network`` yields)."""

    run_id: str
    spec: ClusterSpec
    switch: str
    nodes: list[Node] = field(default_factory=list)

    @property
    def namespaces(self) -> list[str]:
        """All namespaces of the run, switch first."""
        return [self.switch] + [n.namespace for n in self.nodes]

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address

    def qdisc_bytes(self, node: int) -> tuple[int, int]:
        """Bytes that passed node ``node``'s shapers so far: ``(sent by the node, received by the node)``."""
        n = self.nodes[node]
        return (_tbf_sent(n.namespace, n.interface), _tbf_sent(self.switch, n.switch_port))


def _tbf_sent(namespace: str, dev: str) -> int:
    out = _cmd(["tc", "-n", namespace, "-s", "qdisc", "show", "dev", dev]).stdout
    m = re.search(r"Sent (\d+) bytes", out)
    return int(m.group(1)) if m else 0


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22); ``None`` when there
    is no such process. With the pid it names one process for good: a pid reused later has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def new_run_id() -> str:
    """``<pid>-<start time>-<serial>``: the launcher process (pid and start time, so ``cleanup`` can tell a live
    launcher from a dead one whose pid was reused) and a per-process serial, so that runs of one launcher, even
    concurrent ones in threads, get distinct names. Unique by construction; ``ip netns add`` refuses an existing
    name anyway."""
    pid = os.getpid()
    return f"{pid}-{process_start_time(pid) or 0}-{next(_SERIAL)}"


def build_network(spec: ClusterSpec, run_id: str | None = None) -> Network:
    """Create the namespaces, bridge, veth pairs and qdiscs of ``spec`` (torn down again if any step fails).

    Raises:
        ClusterUnavailable: when namespaces cannot be built here.
        NetworkSetupError: when an ``ip``/``tc`` step fails.
    """
    require_shaping()
    removed, errors = cleanup_stale()
    if removed:
        print(f"zeropp.cluster: removed {len(removed)} namespaces of launchers that no longer exist: "
              f"{' '.join(removed)}", file=sys.stderr, flush=True)
    if errors:
        print(f"zeropp.cluster: could not delete stale namespaces {errors}", file=sys.stderr, flush=True)
    run_id = run_id or new_run_id()
    net = Network(run_id=run_id, spec=spec, switch=f"{PREFIX}{run_id}-sw")
    prefix_len = int(spec.subnet.split("/")[1]) if "/" in spec.subnet else 32
    created: list[str] = []
    try:
        _cmd(["ip", "netns", "add", net.switch])
        created.append(net.switch)
        sw = ["ip", "-n", net.switch]
        _cmd(sw + ["link", "add", "name", BRIDGE, "type", "bridge"])
        _cmd(sw + ["link", "set", BRIDGE, "up"])
        _cmd(sw + ["link", "set", "lo", "up"])
        for i, addr in enumerate(spec.addresses()):
            node = Node(index=i, namespace=f"{PREFIX}{run_id}-n{i}", address=addr, switch_port=f"n{i}")
            _cmd(["ip", "netns", "add", node.namespace])
            created.append(node.namespace)
            ns = ["ip", "-n", node.namespace]
            _cmd(sw + ["link", "add", "name", node.switch_port, "type", "veth",
                       "peer", "name", node.interface, "netns", node.namespace])
            _cmd(sw + ["link", "set", node.switch_port, "master", BRIDGE])
            _cmd(sw + ["link", "set", node.switch_port, "up"])
            _cmd(ns + ["link", "set", "lo", "up"])
            # IPv4 only: an IPv6 link-local address on eth0 could be picked by gloo for GLOO_SOCKET_IFNAME.
            _cmd(node.exec_prefix() + ["sh", "-c",
                 f"echo 1 > /proc/sys/net/ipv6/conf/{node.interface}/disable_ipv6"], check=False)
            _cmd(ns + ["addr", "add", f"{addr}/{prefix_len}", "dev", node.interface])
            _cmd(ns + ["link", "set", node.interface, "up"])
            if spec.rate is not None:
                tbf = ["root", "tbf", "rate", tc_rate(spec.rate_bps), "burst", str(spec.burst_bytes),
                       "latency", f"{spec.latency:g}ms"]
                _cmd(["tc", "-n", node.namespace, "qdisc", "add", "dev", node.interface] + tbf)
                _cmd(["tc", "-n", net.switch, "qdisc", "add", "dev", node.switch_port] + tbf)
            net.nodes.append(node)
    except BaseException:
        _delete_namespaces(created)
        raise
    return net


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes living in ``namespace``."""
    out = _cmd(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_namespace_processes(namespaces: list[str], grace: float = 2.0) -> None:
    """SIGTERM every process in ``namespaces``, SIGKILL what is left after ``grace`` seconds."""
    pids = [p for ns in namespaces for p in namespace_pids(ns)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for ns in namespaces for p in namespace_pids(ns)]
            if not pids:
                return
            time.sleep(0.05)


def _delete_namespaces(namespaces: list[str]) -> list[str]:
    """Kill the processes in ``namespaces``, delete them; returns error messages (empty when all went)."""
    errors: list[str] = []
    with contextlib.suppress(Exception):
        kill_namespace_processes(namespaces)
    # Nodes first, switch last (deleting a node destroys its veth, the switch's port with it).
    for ns in sorted(namespaces, key=lambda n: n.endswith("-sw")):
        proc = _cmd(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in list_namespaces():
            errors.append(f"{ns}: {proc.stderr.strip()}")
    return errors


def teardown(net: Network) -> None:
    """Kill the processes left in ``net``'s namespaces and delete them (warns on stderr about leftovers)."""
    errors = _delete_namespaces(net.namespaces)
    if errors:
        print(f"zeropp.cluster: could not delete {errors}; run `python -m zeropp.cluster --cleanup`",
              file=sys.stderr)


@contextlib.contextmanager
def emulated_network(spec: ClusterSpec, run_id: str | None = None) -> Iterator[Network]:
    """Build the shaped network of ``spec``, yield it (``Network``: ``.nodes[i].namespace/.address``), tear it
    down on exit, whatever happens inside (exception, KeyboardInterrupt, SystemExit).

    Raises:
        ClusterUnavailable: when namespaces cannot be built here (no fallback: this is the network itself).
    """
    net = build_network(spec, run_id)
    try:
        yield net
    finally:
        teardown(net)


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces starting with ``prefix``."""
    if shutil.which("ip") is None:
        return []
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def owner_alive(name: str) -> bool | None:
    """Whether the launcher that made namespace ``name`` still runs: its pid exists and, for names that carry it,
    started at the recorded time (else the pid was reused by another process). ``None`` for names not made here."""
    m = _NAME.match(name)
    if m is None:
        return None
    pid, started = int(m.group(1)), m.group(2)
    now = process_start_time(pid)
    if now is None:
        return False
    return started is None or int(started) == now


def cleanup_stale(force: bool = False) -> tuple[list[str], list[str]]:
    """Delete the namespaces of runs whose launcher no longer exists (all of them with ``force``), killing the
    processes inside. Returns the names deleted and the errors (names that would not go)."""
    stale = [name for name in list_namespaces() if owner_alive(name) is False or (force and _NAME.match(name))]
    errors = _delete_namespaces(stale)
    return [name for name in stale if not any(e.startswith(f"{name}:") for e in errors)], errors


def cleanup(force: bool = False) -> list[str]:
    """Delete the namespaces of crashed runs (their launcher is gone; all of them with ``force``), killing the
    processes inside. Returns the names deleted; raises ``NetworkSetupError`` naming those that would not go."""
    removed, errors = cleanup_stale(force)
    if errors:
        raise NetworkSetupError(f"could not delete {errors}")
    return removed
