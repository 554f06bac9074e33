"""Processes that ran quantized collectives exit cleanly: gloo's worker threads must not release tensors after
the interpreter began to finalize (before the fix, 1 to 4 of 8 such runs aborted; see zeropp.comm.topology).

Many short 2-rank jobs (exit_job.py), half of them calling destroy_process_group and half not; every process must
exit 0 with no abort message. The race is timing-dependent, so the runs are many and short."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUNS = 12


@pytest.mark.parametrize("mode", ["destroy", "keep"])
def test_quantized_jobs_exit_cleanly(tmp_path, mode):
    env = dict(os.environ)
    env.update(ZEROPP_QUANT_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ZEROPP_RANKS_PER_NODE", "ZEROPP_DEBUG"):
        env.pop(var, None)
    failures = []
    for run in range(RUNS // 2):
        store = tmp_path / f"store{run}"
        procs = [
            subprocess.Popen([sys.executable, str(HERE / "exit_job.py"), str(r), "2", str(store), mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in range(2)
        ]
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=60)
            text = err.decode(errors="replace")
            if p.returncode != 0 or "terminate called" in text or "Fatal Python error" in text:
                failures.append(f"run {run} rank {r}: exit code {p.returncode}\n{text[-2000:]}")
    assert not failures, "\n".join(failures)
