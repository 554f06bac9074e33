"""Checkpoints that survive a crash and say what is wrong (issue 12, section 2), world 2, tiny GPT, stage 3.

* Damaged checkpoints (one launch of 2 gloo processes, ``checkpoint_fault_workers.damage_checks``): 64 flipped
  bytes in a shard, a truncated or missing shard, a truncated ``.metadata``, a shard from another save, a junk
  manifest, ``latest`` binary, empty or naming a missing tag, and the same damage in a checkpoint without a
  manifest (written before checksums): each gives ``CheckpointError`` (or ``FileNotFoundError`` for the missing
  tag), an ``Exception``, with the same message on both ranks naming the file; no rank is left waiting (the launch
  would time out). An undamaged checkpoint without a manifest loads exactly, with a warning.
* Failed saves: ``save_dir`` under a regular file (fails as root too), a disk that fills on rank 1 only
  (``RLIMIT_FSIZE``) with a new and with the same tag, an exception on rank 0 only: ``CheckpointError`` on both
  ranks, the directory listing and ``latest`` as before, and the previous checkpoint loads exactly.
* Killed saves (``checkpoint_fault_workers.crash_main``, forked ranks): a save of a new tag and of the same tag is
  killed with SIGKILL at each point of the commit (``checkpoint_files.CRASH_POINTS``, the test hook), on rank 0 or
  rank 1; then ``latest`` loads at world 2 and gives exactly the state of the first or the second save (the
  one the point implies), and the next save leaves no temporary directory.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_fault_workers import CASES, SCENARIOS
from engine_launch import launch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def damage(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("damage")
    return launch("checkpoint_fault_workers:damage_checks", 2, tmp, timeout=120, root=str(tmp / "ckpt"))


EXPECTED = {  # case -> (exception type, words its message must hold)
    "flipped": ("CheckpointError", ["__1_0.distcp", "corrupted", "sha256"]),
    "truncated": ("CheckpointError", ["__1_0.distcp", "bytes", "truncated"]),
    "missing": ("CheckpointError", ["__1_0.distcp", "missing"]),
    "metadata_truncated": ("CheckpointError", [".metadata", "truncated"]),
    "mixed": ("CheckpointError", ["__1_0.distcp", "corrupted"]),
    "manifest_junk": ("CheckpointError", ["manifest.json", "not a zeropp checkpoint manifest"]),
    "latest_binary": ("CheckpointError", ["latest", "holds no checkpoint tag", "t1"]),
    "latest_empty": ("CheckpointError", ["latest", "holds no checkpoint tag", "0 bytes"]),
    "latest_missing_tag": ("FileNotFoundError", ["global_step77", "t1"]),
    "legacy_truncated": ("CheckpointError", ["reading checkpoint", "t1"]),
    "legacy_metadata_truncated": ("CheckpointError", [".metadata", "cannot be read"]),
    "save_under_file": ("CheckpointError", ["afile", "save_checkpoint", "nothing was changed"]),
    "disk_full_t1": ("CheckpointError", ["File too large", "nothing was changed"]),
    "disk_full_t2": ("CheckpointError", ["File too large", "nothing was changed"]),
    "exception_on_rank0": ("CheckpointError", ["rank 0", "nothing was changed"]),
}


def test_damaged_checkpoints_and_failed_saves_raise_on_every_rank(damage):
    assert {k for k in EXPECTED if not k.startswith(("save_", "disk_", "exception_"))} | {"legacy"} == set(CASES)
    for case, (kind, words) in EXPECTED.items():
        got = [r["errors"][case] for r in damage]
        assert got[0] is not None, f"{case}: loaded or saved without an error"
        assert got[0] == got[1], (case, got)  # the same error on both ranks
        assert got[0][0] == kind, (case, got[0])
        for word in words:
            assert word in got[0][1], (case, word, got[0][1])
        assert "Traceback" not in got[0][1], case


def test_checkpoint_without_manifest_loads_with_a_warning(damage):
    for r in damage:
        assert r["errors"]["legacy"] is None
        assert r["loads"]["legacy"]  # exactly the saved state
    assert any("cannot be verified" in w for w in damage[0]["warnings"]["legacy"])
    assert damage[0]["warnings"]["flipped"] == []


def test_failed_saves_leave_the_previous_checkpoint(damage):
    for r in damage:
        before, after, latest = r["listing"]
        assert before == after == ["latest", "t1"], r["listing"]  # no partial tag, no temporary directory left
        assert latest == "t1"
        assert r["loads"]["after_failed_saves"]


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    work = tmp_path_factory.mktemp("crash")
    env = dict(os.environ, OMP_NUM_THREADS="1", ZEROPP_QUANT_BACKEND="torch",
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent / "comm"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "checkpoint_fault_workers.py"), str(work)], check=False, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return pickle.loads((work / "crash.pkl").read_bytes())


def test_killed_saves_leave_latest_complete(crashes):
    (_, status0), (_, status1) = crashes["verify"]
    assert status0[0] == "ok" and status1[0] == "ok", (status0, status1)
    verified = status0[1]
    assert status1[1] == verified  # both ranks saw the same
    for name, tag, point, victim, want in SCENARIOS:
        runs = crashes["runs"][name]
        status, outcome = runs[victim]
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and outcome is None, (name, runs)
        v = verified[name]
        assert v["matches"] == [want], (name, v)  # exactly the state of one complete save
        assert v["latest"] == ("b" if want == "b" and tag == "b" else "a"), (name, v)
        assert not any(n.startswith(".") for n in v["after"]), (name, v)  # the next save cleaned up
        assert set(v["after"]) == {"a", "after", "latest"} | ({"b"} if point in ("renamed", "latest") and tag == "b"
                                                                else set()), (name, v)
    left = {name: verified[name]["left"] for name, *_ in SCENARIOS}
    assert any(n.startswith(".saving.") for n in left["new-manifest"]), left  # what the crash left is hidden
    assert ".replaced.a" in left["same-aside"] and "a" not in left["same-aside"], left
