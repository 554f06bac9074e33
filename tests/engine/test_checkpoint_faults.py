"""Checkpoints that survive a crash and say what is wrong (issue 12, section 2), world 2, tiny GPT, stage 3.

* Damaged checkpoints (one launch of 2 gloo processes, ``checkpoint_fault_workers.damage_checks``): 64 flipped
  bytes in a shard, a truncated or missing shard, a truncated ``.metadata``, a shard from another save, a junk
  manifest, ``latest`` binary, empty or naming a missing tag, a partial ``.replaced.<tag>`` where ``<tag>`` is
  missing (left by the delete-in-place of zeropp before 2026-11-25), and the same damage in a checkpoint without a
  manifest (written before checksums): each gives ``CheckpointError`` (or ``FileNotFoundError`` for the missing
  tag), an ``Exception``, with the same message on both ranks naming the file; no rank is left waiting (the launch
  would time out). An undamaged checkpoint without a manifest loads exactly, with a warning; the next save deletes
  the partial ``.replaced.<tag>`` instead of restoring it.
* Failed saves: ``save_dir`` under a regular file (fails as root too), a disk that fills on rank 1 only
  (``RLIMIT_FSIZE``) with a new and with the same tag, an exception on rank 0 only: ``CheckpointError`` on both
  ranks, the directory listing and ``latest`` as before, and the previous checkpoint loads exactly.
* Killed saves (``checkpoint_fault_workers.crash_main``, forked ranks): a save of a new tag and of the same tag is
  killed with SIGKILL at each point of the commit (``checkpoint_files.CRASH_POINTS``, the test hook: while
  writing, after the manifest, between the two renames, after them, after ``latest``, after the old checkpoint is
  renamed away and after one of its files is deleted, then once more in the next save's own cleanup), on rank 0
  or rank 1; then ``latest``, tag ``a`` and the killed save's tag load at world 2 and give exactly the state of
  the first or the second save (the one the point implies) or, for a new tag not yet in place,
  ``FileNotFoundError``; a later save of another tag (on a copy) and one of the killed save's tag each leave only
  complete checkpoints and ``latest``.
* In this process: ``checkpoint_files.commit`` puts the old checkpoint back when the new one cannot be renamed
  into place, and the load planner names a sharded entry the checkpoint lacks or holds in another shape.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_fault_workers import CASES, KILLED_IN_PREPARE, SCENARIOS
from engine_launch import launch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from zeropp.engine import checkpoint, checkpoint_files, dcp_planners
from zeropp.engine.checkpoint_files import CheckpointError

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
    "partial_aside": ("FileNotFoundError", ["no checkpoint 't1'"]),  # the partial .replaced.t1 is not offered
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


def test_partial_replaced_directory_is_deleted_not_restored(damage):
    for r in damage:
        assert r["listing_partial_aside"] == ["latest", "t2"], r["listing_partial_aside"]


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
        committed = point in ("renamed", "latest", "retired", "deleting")  # the new checkpoint is <tag>
        assert v["loads"]["latest"] == [want], (name, v)  # exactly the state of one complete save
        assert v["latest"] == ("b" if want == "b" and tag == "b" else "a"), (name, v)
        # by explicit tag: the checkpoint of that tag the crash left, never a partial one
        assert v["loads"]["a"] == (["b"] if tag == "a" and committed else ["a"]), (name, v)
        if tag == "b":
            if committed:
                assert v["loads"]["b"] == ["b"], (name, v)
            else:
                kind, message = v["loads"]["b"]
                assert kind == "FileNotFoundError" and "no checkpoint 'b'" in message, (name, v)
        # the next save, of another tag or of the killed save's, removes every leftover
        assert set(v["after"]) == {"a", "after", "latest"} | ({"b"} if tag == "b" and committed else set()), (name, v)
        assert set(v["again"]) == {"a", "latest"} | {tag}, (name, v)
    left = {name: verified[name]["left"] for name, *_ in SCENARIOS}
    assert any(n.startswith(".saving.") for n in left["new-manifest"]), left  # what the crash left is hidden
    assert ".replaced.a" in left["same-aside"] and "a" not in left["same-aside"], left
    for name in ("same-renamed", "same-latest"):
        assert {"a", ".replaced.a"} <= set(left[name]), left
    for name in ("same-retired", "same-deleting", KILLED_IN_PREPARE):  # the old checkpoint: renamed, then deleted
        assert "a" in left[name] and ".replaced.a" not in left[name], left
        assert [n for n in left[name] if n.startswith(".deleting.a.")], left
    # killed after deleting one file of the old checkpoint; then once more, in the next save's prepare
    status, outcome = crashes["runs"][f"{KILLED_IN_PREPARE}.again"][0]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and outcome is None
    assert crashes["partial"] == {"same-deleting": (4, 3), KILLED_IN_PREPARE: (4, 2)}, crashes["partial"]


def test_commit_puts_the_old_checkpoint_back_when_the_new_one_cannot_be_renamed(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    (root / "t").mkdir(parents=True)
    (root / "t" / ".metadata").write_bytes(b"old")
    staging = root / ".saving.t.0"
    staging.mkdir()
    rename = os.rename

    def rename_but_not_staging(src, dst):
        if Path(src) == staging:
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(checkpoint_files.os, "rename", rename_but_not_staging)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_files.commit(root, "t", staging, global_rank=0)
    assert sorted(p.name for p in root.iterdir()) == [".saving.t.0", "t"]
    assert (root / "t" / ".metadata").read_bytes() == b"old"


def test_load_planner_names_a_piece_the_checkpoint_lacks_or_shapes_otherwise():
    saved = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                  [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
    planner = dcp_planners.LoadPlanner({"model.w": checkpoint.Slice(torch.zeros(3), 2, 5)})
    planner.set_up_planner({}, Metadata(state_dict_metadata={"model.w": saved}), is_coordinator=True)
    with pytest.raises(CheckpointError, match=r"'model.w' is a tensor of shape \(4,\) in the checkpoint; this "
                                              r"engine needs a 1-D tensor of 5 elements"):
        planner.create_local_plan()
    planner = dcp_planners.LoadPlanner({"model.v": checkpoint.Slice(torch.zeros(1), 0, 1)})
    planner.set_up_planner({}, Metadata(state_dict_metadata={"model.w": saved}), is_coordinator=True)
    with pytest.raises(CheckpointError, match="'model.v' is missing in the checkpoint"):
        planner.create_local_plan()
