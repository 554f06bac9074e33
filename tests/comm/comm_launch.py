"""Run a worker function on ``world_size`` real processes joined by a gloo process group.

``launch("module:function", world_size, tmp_path, **kwargs)`` starts ``world_size`` Python subprocesses (file
store in ``tmp_path``, no TCP port to pick), each of which initializes gloo (with ``pg_timeout`` seconds as the
default group's timeout when given), calls
``function(rank, world_size, **kwargs)`` from ``module`` (importable from tests/comm) and saves what it returns.
It returns the list of per-rank results, or raises with every failing rank's traceback. Unless ``env`` (or this
process's environment) says otherwise, workers run with ``ZEROPP_QUANT_BACKEND`` set to conftest's
``worker_quant_backend()`` (the native CPU library where it loads and no GPU is there, else the torch reference).

``launch_cases(target, world_size, tmp_path, cases, **kwargs)`` runs several cases of one worker in ONE launch (each
launch costs every rank the imports of torch and zeropp, seconds of CPU on a 2-core machine): every rank calls
``function(rank, world_size, **kwargs, **case)`` for each case in order, on the same process group, and the result
is each case's list of per-rank results, by case name. The cases share the processes: a worker whose result
depends on process-wide state (counters read as totals, a cache the previous case filled) is not for this.

The ranks are forked from a zygote: one process per pytest session that has imported torch (and its distributed
and dynamo packages, ~5 CPU-seconds per interpreter) and zeropp's engine, fsdp and models packages (another ~0.7
CPU-seconds a rank; zeropp reads its environment variables when called, never at import, so a rank's own environment
still decides), so each rank starts in milliseconds with its own environment and ``sys.path`` and imports its worker
fresh. A launch whose environment changes a
variable torch or Triton read at import (``TORCH*``, ``TRITON*``, ``OMP*``, ...) from the zygote's, or any launch
under ``ZEROPP_TEST_FRESH_PROCESSES=1``, starts fresh interpreters instead.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import importlib
import json
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

_CHILD = r"""
import os, pickle, sys, traceback
rank, world, tmp, target = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
pg_timeout = float(sys.argv[5]) if len(sys.argv) > 5 else None
result_path = os.path.join(tmp, f"result{rank}.pkl")
try:
    import datetime, importlib
    import torch.distributed as dist
    with open(os.path.join(tmp, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    timeout = None if pg_timeout is None else datetime.timedelta(seconds=pg_timeout)
    if timeout is not None:  # a short timeout: connect together, not as each interpreter finishes its imports
        ready = dist.FileStore(os.path.join(tmp, "ready"), world)
        ready.set(f"ready{rank}", "1")
        ready.wait([f"ready{r}" for r in range(world)], datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                            world_size=world, timeout=timeout)
    module, func = target.split(":")
    value = getattr(importlib.import_module(module), func)(rank, world, **kwargs)
    outcome = ("ok", value)
except BaseException:
    outcome = ("error", traceback.format_exc())
with open(result_path, "wb") as f:
    pickle.dump(outcome, f)
try:
    import torch.distributed as dist
    if outcome[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
except BaseException:
    pass
os._exit(0)
"""


_ZYGOTE = r"""
import json, os, signal, sys
import torch, torch.distributed, torch._dynamo  # the imports every rank would pay
import zeropp.engine, zeropp.fsdp, zeropp.models
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; the launcher polls their pids
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        # a process group, killed whole on a timeout; not a session: that is a scheduling group of its own
        # (autogroup), to which tests/ahead.py's nice-19 jobs would not yield
        os.setpgid(0, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout, sys.stderr = os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)
        os.chdir(request["cwd"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        torch.set_num_threads(int(request["env"].get("OMP_NUM_THREADS", "1")))
        sys.argv = ["-c", *request["argv"]]
        exec(compile(request["code"], "<rank>", "exec"), {"__name__": "__main__"})
        os._exit(0)
    sys.stdout.write(f"{pid}\n")
    sys.stdout.flush()
"""

_IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "TRITON", "OMP", "MKL", "KMP", "CUDA", "NCCL", "GLOO", "LD_")


class _Zygote:
    """The session's forking parent (``_ZYGOTE``), started at the first launch that can use it."""

    process: subprocess.Popen | None = None
    env: dict[str, str] = {}

    @classmethod
    def serves(cls, env: dict[str, str]) -> bool:
        if os.environ.get("ZEROPP_TEST_FRESH_PROCESSES") == "1":
            return False
        if cls.process is None or cls.process.poll() is not None:
            cls.env = {**os.environ, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
            cls.env.pop("PYTHONPATH", None)
            cls.process = subprocess.Popen([sys.executable, "-c", _ZYGOTE], env=cls.env, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
        keys = {k for k in (*env, *cls.env) if k.startswith(_IMPORT_TIME_PREFIXES)}
        return all(env.get(k) == cls.env.get(k) for k in keys)

    @classmethod
    def fork(cls, argv: list[str], env: dict[str, str], log: Path) -> int:
        assert cls.process is not None and cls.process.stdin is not None and cls.process.stdout is not None
        cls.process.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log), "code": _CHILD,
                                            "cwd": os.getcwd()}) + "\n")
        cls.process.stdin.flush()
        line = cls.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the launch zygote exited (status {cls.process.poll()}); rerun with "
                               "ZEROPP_TEST_FRESH_PROCESSES=1 to launch fresh interpreters")
        return int(line)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_forked(argvs: list[list[str]], env: dict[str, str], run_dir: Path, timeout: float) -> tuple[list[str], bool]:
    """Fork one rank per ``argvs`` entry from the zygote; wait until all have exited or ``timeout`` seconds passed
    (then kill them); return each rank's output and whether it timed out."""
    logs = [run_dir / f"output{r}.log" for r in range(len(argvs))]
    pids = [_Zygote.fork(argv, env, log) for argv, log in zip(argvs, logs)]
    deadline = time.monotonic() + timeout
    pause = 0.005
    while any(map(_alive, pids)):
        if time.monotonic() > deadline:
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        time.sleep(pause)
        pause = min(pause * 1.5, 0.1)
    timed_out = time.monotonic() > deadline
    return [log.read_text(errors="replace") if log.exists() else "" for log in logs], timed_out


def launch(
    target: str,
    world_size: int,
    tmp_path: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    worker_dirs: Sequence[Path] = (),
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world_size`` gloo ranks; return each rank's result. The target's
    module is looked up in ``worker_dirs``, then beside this file. ``pg_timeout``: the default group's timeout in
    seconds (default: torch's)."""
    run_dir = Path(tmp_path) / f"launch_{target.replace(':', '_')}_{world_size}_{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    with open(run_dir / "kwargs.pkl", "wb") as f:
        pickle.dump(kwargs, f)
    from conftest import worker_quant_backend  # here: the ranks import this module (run_cases) without tests/

    child_env = dict(os.environ)
    child_env.setdefault("ZEROPP_QUANT_BACKEND", worker_quant_backend())
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join([*map(str, worker_dirs), str(HERE), str(ROOT),
                                               child_env.get("PYTHONPATH", "")])
    child_env.setdefault("OMP_NUM_THREADS", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or var not in env:
            child_env.pop(var, None)
    argvs = [[str(r), str(world_size), str(run_dir), target, *([] if pg_timeout is None else [repr(pg_timeout)])]
             for r in range(world_size)]
    if _Zygote.serves(child_env):
        outputs, timed_out = _run_forked(argvs, child_env, run_dir, timeout)
    else:
        outputs, timed_out = _run_fresh(argvs, child_env, timeout)
    results, errors = [], []
    for r in range(world_size):
        path = run_dir / f"result{r}.pkl"
        if not path.exists():
            errors.append(f"rank {r}: no result{' (timed out)' if timed_out else ''}\n{outputs[r][-3000:]}")
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "ok":
            results.append(value)
        else:
            errors.append(f"rank {r}:\n{value}")
    if errors:
        raise AssertionError(f"{target} on {world_size} ranks failed:\n" + "\n".join(errors))
    return results


def _run_fresh(argvs: list[list[str]], env: dict[str, str], timeout: float) -> tuple[list[str], bool]:
    """One fresh interpreter per ``argvs`` entry; their outputs and whether they timed out."""
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for argv in argvs]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    timed_out = False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, _ = p.communicate()
        outputs.append(out.decode(errors="replace"))
    return outputs, timed_out


def run_cases(rank: int, world: int, *, worker: str, cases: dict[str, dict[str, Any]],
              common: dict[str, Any]) -> dict[str, Any]:
    """The worker side of ``launch_cases``: ``worker``'s function (``"module:function"``) called once per case, in
    order."""
    module, func = worker.split(":")
    function = getattr(importlib.import_module(module), func)
    return {name: function(rank, world, **common, **case) for name, case in cases.items()}


def launch_cases(
    target: str,
    world_size: int,
    tmp_path: Path,
    cases: dict[str, dict[str, Any]],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    worker_dirs: Sequence[Path] = (),
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> dict[str, list[Any]]:
    """Run ``target`` once per case of ``cases`` (name -> keyword arguments added to ``kwargs``) in one launch of
    ``world_size`` gloo ranks; return each case's per-rank results by name. Arguments as for ``launch``."""
    per_rank = launch("comm_launch:run_cases", world_size, tmp_path, env=env, timeout=timeout,
                      worker_dirs=worker_dirs, pg_timeout=pg_timeout, worker=target, cases=cases, common=kwargs)
    return {name: [r[name] for r in per_rank] for name in cases}
