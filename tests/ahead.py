"""Work a fixture needs, started in the background as soon as the session's tests are collected.

The sm_90 compilations of ``tests/quant`` (``test_cost_model``'s ``measured``, ``test_triton_compile``'s
``compiled``: 140-160 and 40-55 CPU-seconds of LLVM, ``ptxas`` and ``nvdisasm``) depend on nothing the session
does, and their fixtures come late in the suite. Started when collection ends, at nice 19 (they take what CPU the
tests before them leave idle: single-process tests, launches that wait on a peer or a timeout), they are done or
nearly done when the fixture asks, instead of costing their whole time on the critical path then. A fixture that
asks before its job is done waits for it (then nothing else competes for the CPU; where the process may, the job's
priority is raised back to normal first).

A test module registers its job at import (``register``: a side-effect-free entry), ``conftest.py`` starts the jobs
whose fixture some collected test of that module uses (``start_needed``) and stops what still runs at the end of the
session (``stop_all``), and the fixture takes the result (``result``), starting the job itself if nothing did (a test
run on its own). A job runs ``target(out_dir)`` (``"path/to/file.py:function"``, imported by path) in a fresh Python
process, with this process's environment; the function returns something JSON can write, which ``result`` returns.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NICE = 19
"""Niceness of a job started ahead: it runs on CPU the tests leave idle."""

TIMEOUT_S = 1800
"""Longest a fixture waits for its job, seconds."""

_RUNNER = """
import importlib.util, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
path, function = sys.argv[1].rsplit(":", 1)
spec = importlib.util.spec_from_file_location(Path(path).stem + "_ahead", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
out = Path(sys.argv[2])
(out / "ahead-result.json").write_text(json.dumps(getattr(module, function)(out)))
"""


class AheadError(RuntimeError):
    """A job failed as a whole: its exit status and the end of its output."""


@dataclass
class Job:
    """One registered job: ``target`` run for the tests of ``test_file`` that use ``fixture``."""

    test_file: str
    fixture: str
    target: str
    out_dir: Path | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0


_JOBS: dict[tuple[str, str], Job] = {}


def register(test_file: str, fixture: str, function: str) -> None:
    """Register ``test_file``'s (its ``__file__``) job for ``fixture``: that file's ``function(out_dir: Path)``."""
    test_file = str(Path(test_file).resolve())
    _JOBS.setdefault((test_file, fixture), Job(test_file, fixture, f"{test_file}:{function}"))


def _detach(nice: int) -> None:
    """In the job's process before it runs: a process group of its own (``_kill`` ends it whole; a terminal's
    Ctrl-C does not reach it, and its standard input is empty, so it never reads the terminal) in the session's
    scheduling group, then ``nice``. Not a session of its own: with the kernel's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default) a new session is a new group that gets as much CPU
    as the whole test session, whatever its nice value (measured: a CPU-bound job beside two CPU-bound processes of
    the test session took 57-60% of the CPU in a session of its own, 0-2% here)."""
    os.setpgid(0, 0)
    if nice:
        os.nice(nice)


def _start(job: Job, nice: int) -> None:
    job.out_dir = Path(tempfile.mkdtemp(prefix=f"zeropp-ahead-{job.fixture}-"))
    argv = [sys.executable, "-c", _RUNNER, job.target, str(job.out_dir), str(Path(__file__).resolve().parent)]
    with open(job.out_dir / "ahead-log.txt", "w") as log:
        job.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: _detach(nice))
    job.started = time.monotonic()


def start_needed(items: list) -> None:
    """Start the registered jobs whose fixture a collected test of the registering file uses."""
    for item in items:
        path = str(Path(str(item.path)).resolve())
        for name in getattr(item, "fixturenames", ()):
            job = _JOBS.get((path, name))
            if job is not None and job.proc is None:
                _start(job, NICE)


def registered_first(items: list) -> None:
    """Reorder ``items`` in place (stably) so that the tests of the files that registered a job come first. Under
    pytest-xdist, where no job starts ahead, the worker that takes such a file then runs its job at the start, beside
    the other worker's tests, instead of at the end of the session where nothing else would run beside it."""
    files = {job.test_file for job in _JOBS.values()}
    items.sort(key=lambda item: str(Path(str(item.path)).resolve()) not in files)


def result(test_file: str, fixture: str) -> tuple[Path, Any]:
    """The job's folder and what its function returned, waiting for it (started here if nothing started it).
    Raises ``AheadError`` if the job failed or ran past ``TIMEOUT_S``."""
    job = _JOBS[(str(Path(test_file).resolve()), fixture)]
    if job.proc is None:
        _start(job, 0)
    else:
        try:  # nothing else runs while the fixture waits: back to normal priority, where this process may raise it
            os.setpriority(os.PRIO_PGRP, job.proc.pid, 0)
        except OSError:
            pass
    try:
        job.proc.wait(timeout=max(0.0, job.started + TIMEOUT_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(job)
    found = job.out_dir / "ahead-result.json"
    if job.proc.returncode != 0 or not found.exists():
        log = (job.out_dir / "ahead-log.txt").read_text()[-8000:]
        raise AheadError(f"{job.target} failed (exit {job.proc.returncode}, {TIMEOUT_S} s allowed):\n{log}")
    return job.out_dir, json.loads(found.read_text())


def _kill(job: Job) -> None:
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.proc.wait()


def stop_all() -> None:
    """Kill the jobs still running (and their children) and remove every job's folder."""
    for job in _JOBS.values():
        if job.proc is not None:
            if job.proc.poll() is None:
                _kill(job)
            shutil.rmtree(job.out_dir, ignore_errors=True)
            job.proc = None
