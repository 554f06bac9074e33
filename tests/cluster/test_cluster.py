"""The emulated cluster (zeropp.cluster): namespaces built and always removed, links shaped to the rate, torchrun
across nodes, failure handling, the unshaped fallback.

Tests that build namespaces skip (with the reason) only when this machine cannot: not root, no iproute2, or
``ip netns add`` refused (an unprivileged container)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeropp.cluster import (
    ClusterSpec,
    ClusterUnavailable,
    emulated_network,
    list_namespaces,
    netns,
    parse_rate,
    run,
    shaping_available,
    torchrun_args,
)
from zeropp.cluster import launch as cluster_launch

HERE = Path(__file__).parent
WORKER = str(HERE / "allreduce_worker.py")
TRANSFER = str(HERE / "transfer.py")
SHAPING, WHY_NOT = shaping_available()
needs_netns = pytest.mark.skipif(not SHAPING, reason=f"network namespaces unavailable here: {WHY_NOT}")
# The ranks need no Triton kernels: keep them off the interpreter (see tests/conftest.py).
RANK_ENV = {"ZEROPP_QUANT_BACKEND": "torch"}


def _tc(ns: str, dev: str) -> str:
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout


def _worker_processes() -> list[int]:
    """Pids of live processes running WORKER (leftover ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if WORKER.encode() in cmdline:
                pids.append(int(entry))
    return pids


# ---- pure ---------------------------------------------------------------------------------------------------


def test_parse_rate():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("10gbit") == 1e10
    assert parse_rate("500mbit") == 5e8
    assert parse_rate("2.5Gbit") == 2.5e9
    assert parse_rate("1mibit") == 2**20
    assert parse_rate(100e6) == 100e6
    for bad, match in [("fast", "not understood"), ("1gbps", "byte rates"), ("1GB", "byte rates"),
                       ("10furlongs", "unknown unit"), ("0gbit", "positive"), ("-1gbit", "not understood"),
                       ("", "not understood"), ("100bit", "too slow"), (True, "not a rate")]:
        with pytest.raises(ValueError, match=match):
            parse_rate(bad)
    with pytest.raises(ValueError, match="unknown unit"):
        ClusterSpec(nodes=2, ranks_per_node=2, rate="1 gigabit")
    with pytest.raises(ValueError, match="nodes"):
        ClusterSpec(nodes=0, ranks_per_node=2)


def test_torchrun_args():
    assert torchrun_args(["python", "-m", "zeropp.bench.training", "--steps", "20"]) == [
        "-m", "zeropp.bench.training", "--steps", "20"]
    assert torchrun_args([sys.executable, "x.py", "-a"]) == ["x.py", "-a"]
    assert torchrun_args(["python3.11", "-mfoo"]) == ["-m", "foo"]
    assert torchrun_args(["x.py", "1"]) == ["x.py", "1"]
    assert torchrun_args(["echo", "hi"]) == ["--no-python", "echo", "hi"]
    for bad in ([], ["python"], ["python", "-c", "pass"]):
        with pytest.raises(ValueError):
            torchrun_args(bad)


def test_fallback_error_raises(monkeypatch):
    monkeypatch.setattr(cluster_launch, "shaping_available", lambda: (False, "no namespaces in this test"))
    with pytest.raises(ClusterUnavailable, match="no namespaces in this test.*iproute2.*--unshaped"):
        run(ClusterSpec(2, 2, fallback="error"), ["python", WORKER])


# ---- namespaces ---------------------------------------------------------------------------------------------


@needs_netns
def test_network_built_and_removed():
    spec = ClusterSpec(nodes=2, ranks_per_node=1, rate="100mbit")
    with emulated_network(spec) as net:
        names = net.namespaces
        assert len(names) == 3 and set(names) <= set(list_namespaces())
        assert [n.address for n in net.nodes] == ["10.213.0.1", "10.213.0.2"]
        for node in net.nodes:
            assert "tbf" in _tc(node.namespace, node.interface) and "100Mbit" in _tc(node.namespace, node.interface)
            assert "tbf" in _tc(net.switch, node.switch_port)
        ping = subprocess.run(net.nodes[0].exec_prefix() + ["ping", "-c", "1", "-W", "2", "10.213.0.2"],
                              capture_output=True, text=True)
        assert ping.returncode == 0 or "not found" in ping.stderr or "No such file" in ping.stderr
    assert not set(names) & set(list_namespaces())

    with pytest.raises(RuntimeError, match="inside"):
        with emulated_network(spec) as net:
            names = net.namespaces
            assert set(names) <= set(list_namespaces())
            raise RuntimeError("inside")
    assert not set(names) & set(list_namespaces())


def _transfer(net, src: int, dst_ns: int, dst_addr: str, nbytes: int, port: int) -> float:
    """Seconds to send nbytes from node src to dst_addr (a server in node dst_ns)."""
    server = subprocess.Popen(net.nodes[dst_ns].exec_prefix() + [sys.executable, TRANSFER, "serve", dst_addr,
                              str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(net.nodes[src].exec_prefix() + [sys.executable, TRANSFER, "send", dst_addr,
                             str(port), str(nbytes)], capture_output=True, text=True, timeout=60, check=True)
        assert server.wait(timeout=30) == 0
        return float(out.stdout.strip())
    finally:
        server.kill()


@needs_netns
def test_cross_node_traffic_is_rate_limited():
    rate = 100e6
    nbytes = 6_000_000  # 0.48 s at 100 Mbit/s
    with emulated_network(ClusterSpec(nodes=2, ranks_per_node=1, rate="100mbit")) as net:
        before = net.qdisc_bytes(0)
        attempts = 0
        for src, dst in ((0, 1), (1, 0)):
            # Best of up to 3: on a loaded 2-core machine a starved sender can fall below the rate; it can never
            # go above it (checked on every attempt).
            ratios = []
            while len(ratios) < 3 and (not ratios or max(ratios) < 0.7):
                secs = _transfer(net, src, dst, net.nodes[dst].address, nbytes, 5000 + 10 * src + len(ratios))
                ratios.append(nbytes * 8 / secs / rate)
                assert ratios[-1] <= 1.05, f"node {src} -> node {dst}: {ratios[-1]:.2f} of the rate"
            assert max(ratios) >= 0.7, f"node {src} -> node {dst}: {ratios} of the rate"
            attempts += len(ratios) if src == 0 else 0
        sent, received = (a - b for a, b in zip(net.qdisc_bytes(0), before))
        assert sent >= attempts * nbytes and received >= nbytes, (sent, received)
        # Inside one node, to the node's own (shaped interface's) address: local delivery, not shaped.
        before = net.qdisc_bytes(0)
        secs = _transfer(net, 0, 0, net.nodes[0].address, nbytes, 5002)
        assert nbytes * 8 / secs > 3 * rate
        sent, received = (a - b for a, b in zip(net.qdisc_bytes(0), before))
        assert sent < 100_000 and received < 100_000, (sent, received)
    # The same link unshaped (veth speed) is much faster.
    with emulated_network(ClusterSpec(nodes=2, ranks_per_node=1, rate=None)) as net:
        secs = _transfer(net, 0, 1, net.nodes[1].address, nbytes, 5003)
        assert nbytes * 8 / secs > 3 * rate


# ---- torchrun -----------------------------------------------------------------------------------------------


@needs_netns
def test_run_across_namespaces_and_failure_cleanup():
    spec = ClusterSpec(nodes=2, ranks_per_node=2, rate="1gbit")
    mine = f"zeropp-{os.getpid()}-"  # run ids start with the launcher's pid (other runs may come and go)
    assert list_namespaces(mine) == []
    assert run(spec, ["python", WORKER], env=RANK_ENV, timeout=180) == 0
    assert list_namespaces(mine) == []
    # Rank 1 (node 1) fails; node 0's rank hangs (sleeps 10 minutes): run stops it at once.
    t0 = time.monotonic()
    spec = ClusterSpec(nodes=2, ranks_per_node=1, rate="1gbit")
    rc = run(spec, ["python", WORKER], env={**RANK_ENV, "CLUSTER_TEST_FAIL_RANK": "1"}, timeout=180)
    assert rc not in (0, 124), rc
    assert time.monotonic() - t0 < 120
    assert list_namespaces(mine) == []
    assert _worker_processes() == []


def test_unshaped_fallback_runs_the_same_script(monkeypatch, capsys):
    monkeypatch.setattr(cluster_launch, "shaping_available", lambda: (False, "pretend: no namespaces"))
    assert run(ClusterSpec(nodes=2, ranks_per_node=2), ["python", WORKER], env=RANK_ENV, timeout=180) == 0
    err = capsys.readouterr().err
    assert "pretend: no namespaces" in err and "falling back to --unshaped" in err
    assert _worker_processes() == []


# ---- leftovers, concurrent clusters, a failing rank (fast: `sh` ranks, no torch in them) ------------------------

LAUNCHER = [sys.executable, "-m", "zeropp.cluster"]


def _launcher_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(HERE.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _namespaces_of(pid: int) -> list[str]:
    return list_namespaces(f"zeropp-{pid}-")


def _running_ranks(launcher: int, command: str) -> int:
    """How many descendants of process ``launcher`` run ``sh -c <command>`` (the ranks it started)."""
    parents, argvs = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argvs[int(pid)] = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == launcher:
                return True
        return False

    return sum(argv[:3] == [b"sh", b"-c", command.encode()] and descends(pid) for pid, argv in argvs.items())


def _wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@needs_netns
def test_sigkilled_launcher_leftovers_removed_by_the_next_launcher():
    launcher = subprocess.Popen(LAUNCHER + ["--nodes", "2", "--ranks-per-node", "1", "--quiet", "--", "sh", "-c",
                                            "sleep 60"], env=_launcher_env(), stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(lambda: len(_namespaces_of(launcher.pid)) == 3), _namespaces_of(launcher.pid)
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    left = _namespaces_of(launcher.pid)
    assert len(left) == 3, left  # SIGKILL: nothing ran to remove them
    # a pid that exists but is not the launcher that made the name (pid reuse): its start time differs
    impostor = f"zeropp-{os.getpid()}-{netns.process_start_time(os.getpid()) + 1}-0-sw"
    subprocess.run(["ip", "netns", "add", impostor], check=True)
    t0 = time.monotonic()
    with emulated_network(ClusterSpec(nodes=1, ranks_per_node=1, rate=None)) as net:
        mine = net.namespaces
        assert not set(left) & set(list_namespaces()) and impostor not in list_namespaces()
        # a live launcher's namespaces are kept, whoever cleans up
        assert netns.cleanup() == [] and set(mine) <= set(list_namespaces())
    assert time.monotonic() - t0 < 15
    assert not set(mine) & set(list_namespaces())


@needs_netns
def test_owner_alive_tells_live_dead_and_reused_pids():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        start = netns.process_start_time(sleeper.pid)
        assert start is not None
        assert netns.owner_alive(f"zeropp-{sleeper.pid}-{start}-7-n0") is True
        assert netns.owner_alive(f"zeropp-{sleeper.pid}-{start + 5}-7-n0") is False
        assert netns.owner_alive(f"zeropp-{sleeper.pid}-ab12-sw") is True  # an older name: the pid alone
        assert netns.owner_alive("zeropp-probe") is None and netns.owner_alive("other-1-2-3-sw") is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert netns.owner_alive(f"zeropp-{sleeper.pid}-{start}-7-n0") is False


@needs_netns
def test_two_clusters_started_at_once_do_not_collide(tmp_path):
    # Both use the default subnet and port 29500; each rank records its run, node and the time it ran.
    # Each rank then waits (up to 30 s) until all 8 ranks of both clusters have written, so that on a loaded box the
    # two runs still overlap when both launched; one that never starts leaves the other's wait to time out.
    rank = ('echo "$ZEROPP_CLUSTER_RUN_ID $ZEROPP_CLUSTER_NODE $RANK $WORLD_SIZE $MASTER_ADDR:$MASTER_PORT '
            '$(date +%s.%N)" > "$OUT/$RANK"; for i in $(seq 300); do [ "$(ls "$ALL"/c*/[0-9] | wc -l)" -ge 8 ] '
            '&& break; sleep 0.1; done; sleep 0.5; echo "$(date +%s.%N)" >> "$OUT/$RANK"')
    launchers, outs = [], []
    for k in range(2):
        out = tmp_path / f"c{k}"
        out.mkdir()
        outs.append(out)
        launchers.append(subprocess.Popen(
            LAUNCHER + ["--nodes", "2", "--ranks-per-node", "2", "--rate", "1gbit", "--quiet", "--timeout", "60",
                        "--", "sh", "-c", rank], env={**_launcher_env(), "OUT": str(out), "ALL": str(tmp_path)}))
    assert [p.wait(timeout=90) for p in launchers] == [0, 0]
    runs, spans = [], []
    for out in outs:
        lines = [(out / str(r)).read_text().split() for r in range(4)]
        assert {line[0] for line in lines} == {lines[0][0]}  # one run id per cluster
        assert [(line[1], line[2], line[3]) for line in lines] == [("0", "0", "4"), ("0", "1", "4"), ("1", "2", "4"),
                                                                   ("1", "3", "4")]
        assert {line[4] for line in lines} == {"10.213.0.1:29500"}
        runs.append(lines[0][0])
        spans.append((min(float(line[5]) for line in lines), max(float(line[6]) for line in lines)))
    assert runs[0] != runs[1]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans  # they really ran at the same time
    assert not [n for p in launchers for n in _namespaces_of(p.pid)]


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_launcher_removes_everything(sig):
    launcher = subprocess.Popen(LAUNCHER + ["--nodes", "2", "--ranks-per-node", "1", "--", "sh", "-c", "sleep 60"],
                                env=_launcher_env(), stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: len(_namespaces_of(launcher.pid)) == 3)
    assert _wait_for(lambda: _running_ranks(launcher.pid, "sleep 60") == 2, timeout=60)  # both ranks started
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig, err
    assert "cleaned up" in err and _namespaces_of(launcher.pid) == []


@needs_netns
def test_failing_rank_is_named_and_the_others_stopped():
    before = set(list_namespaces())
    t0 = time.monotonic()
    failing = 'sleep 0.5; if [ "$RANK" = 3 ]; then exit 5; fi; sleep 120'
    proc = subprocess.run(LAUNCHER + ["--nodes", "2", "--ranks-per-node", "2", "--timeout", "60", "--", "sh", "-c",
                                      failing], check=False, env=_launcher_env(), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode not in (0, 124), proc.stderr[-2000:]
    assert "rank 3 (node 1, local rank 1) exited with 5; node 1's torchrun exited with 1" in proc.stderr, \
        proc.stderr[-2000:]
    assert time.monotonic() - t0 < 30  # the sleeping ranks were stopped, not waited for
    assert set(list_namespaces()) <= before


def test_failing_rank_is_named_unshaped(monkeypatch, capfd):
    monkeypatch.setattr(cluster_launch, "shaping_available", lambda: (False, "pretend: no namespaces"))
    failing = 'sleep 0.3; if [ "$RANK" = 2 ]; then exit 7; fi; sleep 120'
    t0 = time.monotonic()
    rc = run(ClusterSpec(nodes=2, ranks_per_node=2), ["sh", "-c", failing], timeout=60, quiet=True)
    assert rc == 1 and time.monotonic() - t0 < 30
    assert "rank 2 (node 1, local rank 2) exited with 7; torchrun exited with 1" in capfd.readouterr().err
