"""Workers for test_checkpoint_faults.py (issue 12, section 2): damaged checkpoints and failed saves on world 2
(``damage_checks``, run on every rank by ``engine_launch.launch``), and saves killed with SIGKILL (``crash_main``,
a driver process that forks the two ranks of each scenario; see ``crash_main``).

The reference of every comparison is the engine's own exact state: ``consolidated_state_dict`` (an exact fp32
all-gather of the masters) taken right before the save.
"""

from __future__ import annotations

import datetime
import os
import pickle
import resource
import shutil
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from engine_workers import MODEL, text_batches

import zeropp
from zeropp.engine.checkpoint_files import CRASH_ENV
from zeropp.models import GPT

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "zero_optimization": {"stage": 3}}
SHARD = "__1_0.distcp"  # the shard file written by rank 1


def make_engine(seed: int = 0):
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=seed), config=CONFIG)
    return engine


def train(engine, rank: int, world: int, steps: int, seed: int) -> None:
    for inputs, targets in text_batches(steps, 2 * world, seed=seed):
        engine.backward(engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])[1])
        engine.step()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def attempt(fn) -> tuple[str, str] | None:
    """``(exception type, message)`` of what ``fn`` raised (any ``Exception``; a BaseException is not caught and
    fails the worker), ``None`` when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        return type(e).__name__, str(e)
    return None


def listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def damage(root: Path, case: str, good: Path, other: Path) -> Path:
    """A copy of the checkpoint directory ``good`` (``save_dir`` with tag ``t1``) damaged as ``case`` says (first
    rank only). Returns the ``save_dir`` to load from."""
    out = root / case
    shutil.copytree(good, out)
    tag = out / "t1"
    if case.startswith("legacy"):
        (tag / "manifest.json").unlink()
    if case == "flipped":  # 64 bytes in the middle of rank 1's shard
        data = bytearray((tag / SHARD).read_bytes())
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
        (tag / SHARD).write_bytes(bytes(data))
    elif case in ("truncated", "legacy_truncated"):
        os.truncate(tag / SHARD, (tag / SHARD).stat().st_size // 2)
    elif case == "missing":
        (tag / SHARD).unlink()
    elif case in ("metadata_truncated", "legacy_metadata_truncated"):
        os.truncate(tag / ".metadata", (tag / ".metadata").stat().st_size // 3)
    elif case == "mixed":  # rank 1's shard from another save of the same model and layout
        shutil.copy(other / "t1" / SHARD, tag / SHARD)
    elif case == "manifest_junk":
        (tag / "manifest.json").write_bytes(b"\x80\x81\x00junk")
    elif case == "latest_binary":
        (out / "latest").write_bytes(b"\xff\xfe\x00\x80junk")
    elif case == "latest_empty":
        (out / "latest").write_bytes(b"")
    elif case == "latest_missing_tag":
        (out / "latest").write_text("global_step77")
    elif case == "partial_aside":  # what zeropp before 2026-11-25 left when killed deleting the old t1 (then t1 gone)
        os.rename(tag, out / ".replaced.t1")
        (out / ".replaced.t1" / SHARD).unlink()
    return out


CASES = ["flipped", "truncated", "missing", "metadata_truncated", "mixed", "manifest_junk", "latest_binary",
         "latest_empty", "latest_missing_tag", "partial_aside", "legacy_truncated", "legacy_metadata_truncated",
         "legacy"]


def damage_checks(rank: int, world: int, root: str) -> dict:
    """Save a checkpoint (``good/t1``) and another of the same layout (``other/t1``); load damaged copies of it
    (``CASES``) into one fresh engine; then failed saves: ``save_dir`` under a file, a disk that fills on rank 1
    (``RLIMIT_FSIZE``) for a new and the same tag, an exception on rank 0 only (an unpicklable client state).
    Returns per case what was raised (or ``None``), and the state each successful load gave."""
    root_path = Path(root)
    engine = make_engine()
    train(engine, rank, world, 1, seed=1)
    engine.save_checkpoint(root_path / "good", tag="t1")
    reference = engine.consolidated_state_dict()
    train(engine, rank, world, 1, seed=2)
    engine.save_checkpoint(root_path / "other", tag="t1")
    out: dict = {"loads": {}, "errors": {}, "warnings": {}}

    fresh = make_engine(seed=3)
    for case in CASES:
        if rank == 0:
            damage(root_path, case, root_path / "good", root_path / "other")
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["errors"][case] = attempt(lambda case=case: fresh.load_checkpoint(root_path / case))
        out["warnings"][case] = [str(w.message) for w in caught if "manifest" in str(w.message)]
        if out["errors"][case] is None:
            out["loads"][case] = same(fresh.consolidated_state_dict(), reference)

    # a save where a partial .replaced.t1 was left: deleted, not renamed back to t1
    engine.save_checkpoint(root_path / "partial_aside", tag="t2")
    out["listing_partial_aside"] = listing(root_path / "partial_aside")

    # failed saves: every rank raises, the checkpoints already there are untouched
    before = listing(root_path / "good")
    (root_path / "afile").write_text("not a directory")
    out["errors"]["save_under_file"] = attempt(lambda: engine.save_checkpoint(root_path / "afile" / "ckpt"))
    for tag in ("t1", "t2"):
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
        try:
            out["errors"][f"disk_full_{tag}"] = attempt(lambda tag=tag: engine.save_checkpoint(root_path / "good",
                                                                                                 tag=tag))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, previous)
    client = {"fn": (lambda: None)} if rank == 0 else {}
    out["errors"]["exception_on_rank0"] = attempt(lambda: engine.save_checkpoint(root_path / "good", tag="t1",
                                                                                 client_state=client))
    dist.barrier()
    out["listing"] = (before, listing(root_path / "good"), (root_path / "good" / "latest").read_text())
    fresh.load_checkpoint(root_path / "good")
    out["loads"]["after_failed_saves"] = same(fresh.consolidated_state_dict(), reference)
    return out


# ---- saves killed with SIGKILL ------------------------------------------------------------------------------

# (scenario, tag of the second save, crash point, rank killed, the state `latest` must then load: "a" or "b")
SCENARIOS = [
    ("new-written-r0", "b", "written", 0, "a"),
    ("new-written-r1", "b", "written", 1, "a"),
    ("new-manifest", "b", "manifest", 0, "a"),
    ("new-renamed", "b", "renamed", 0, "a"),
    ("new-latest", "b", "latest", 0, "b"),
    ("same-written-r1", "a", "written", 1, "a"),
    ("same-manifest", "a", "manifest", 0, "a"),
    ("same-aside", "a", "aside", 0, "a"),
    ("same-renamed", "a", "renamed", 0, "b"),
    ("same-latest", "a", "latest", 0, "b"),
    ("same-retired", "a", "retired", 0, "b"),
    ("same-deleting", "a", "deleting", 0, "b"),  # the old checkpoint half deleted
    ("same-deleting-prepare", "a", "deleting", 0, "b"),  # and then a save killed while its prepare deletes the rest
]
KILLED_IN_PREPARE = "same-deleting-prepare"


def _child(rank: int, store: Path, fn, *args) -> None:
    """In a forked process: join the gloo group of 2 through ``store``, run ``fn(rank, *args)``, exit. Whatever
    happens is written to ``store.<rank>.out`` (a killed process writes nothing)."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        outcome = ("ok", fn(rank, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        outcome = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    with open(f"{store}.{rank}.out", "wb") as f:
        pickle.dump(outcome, f)
    os._exit(0)


def _fork_pair(store: Path, timeout: float, fn, *args) -> list[tuple[int, tuple | None]]:
    """Fork ranks 0 and 1 running ``fn``; wait (``timeout`` seconds at most, then kill them). Returns each rank's
    ``(wait status, outcome)``."""
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _child(rank, store, fn, *args)
        pids.append(pid)
    deadline, statuses = time.monotonic() + timeout, {}
    while len(statuses) < 2:
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1]
        time.sleep(0.02)
    out = []
    for rank, pid in enumerate(pids):
        path = Path(f"{store}.{rank}.out")
        out.append((statuses[pid], pickle.loads(path.read_bytes()) if path.exists() else None))
    return out


def _crashing_save(rank: int, root: str, tag: str, point: str, victim: int) -> None:
    """Save ``a`` after one step, take another step, save ``tag`` with the crash hook armed for ``victim``; rank
    0 keeps both states (``state_a.pt``, ``state_b.pt``)."""
    engine = make_engine()
    train(engine, rank, 2, 1, seed=1)
    engine.save_checkpoint(root, tag="a")
    state_a = engine.consolidated_state_dict()
    train(engine, rank, 2, 1, seed=2)
    state_b = engine.consolidated_state_dict()
    if rank == 0:
        torch.save({"a": state_a, "b": state_b}, Path(root).parent / f"{Path(root).name}.states.pt")
    os.environ[CRASH_ENV] = f"{point}:{victim}"
    engine.save_checkpoint(root, tag=tag)


def _load(engine, root: Path, tag: str | None, states: dict) -> list[str] | tuple[str, str]:
    """Load ``tag`` of ``root``: which of the states ``a``/``b`` it gave exactly, or ``(error type, message)``."""
    error = attempt(lambda: engine.load_checkpoint(root, tag=tag))
    if error is not None:
        return error
    got = engine.consolidated_state_dict()
    return [k for k in ("a", "b") if same(got, states[k])]


def _killed_in_prepare(rank: int, root: str) -> None:
    """A save of tag ``c`` with the crash hook armed for rank 0 after each file it deletes: killed while
    ``prepare`` deletes what an earlier killed save left."""
    engine = make_engine()
    os.environ[CRASH_ENV] = "deleting:0"
    engine.save_checkpoint(root, tag="c")


def _verify(rank: int, work: str, scenarios: list[tuple[str, str]]) -> dict:
    """For each scenario's ``save_dir`` (``(name, tag of the killed save)``): the listing the crash left and what
    ``latest`` holds; what the load of ``latest``, of tag ``a`` and of the killed save's tag gives (state ``a`` or
    ``b`` exactly, or the error); then, on a copy, a save of another tag (``after``), and a save of the killed
    save's tag in place, each with the listing it leaves."""
    engine = make_engine(seed=5)
    out = {}
    for name, tag in scenarios:
        root = Path(work) / name
        states = torch.load(Path(work) / f"{name}.states.pt")
        left = listing(root)
        latest = (root / "latest").read_text()
        if rank == 0:
            shutil.copytree(root, Path(work) / f"{name}.other", symlinks=True)
        dist.barrier()
        loads = {"latest": _load(engine, root, None, states), "a": _load(engine, root, "a", states),
                 tag: _load(engine, root, tag, states)}
        engine.save_checkpoint(Path(work) / f"{name}.other", tag="after")
        engine.save_checkpoint(root, tag=tag)
        out[name] = {"left": left, "latest": latest, "loads": loads, "after": listing(Path(work) / f"{name}.other"),
                     "again": listing(root)}
    return out


def crash_main(work: str) -> None:
    """The driver (``python checkpoint_fault_workers.py WORK``): torch and zeropp imported once, no torch op run
    in this process (so forking is safe); per scenario a pair of forked ranks saves with the crash hook armed
    (for ``KILLED_IN_PREPARE`` another pair then saves and is killed in ``prepare``), then one pair loads every
    scenario's checkpoint. Writes ``WORK/crash.pkl``: per scenario (and ``<scenario>.again``) the wait statuses and
    outcomes of its ranks; for the kills while deleting, the number of files of a checkpoint and of those left in
    the ``.deleting.*`` directory (``partial``); ``_verify``'s result."""
    work_path = Path(work)
    result: dict = {"runs": {}}
    for name, tag, point, victim, _ in SCENARIOS:
        result["runs"][name] = _fork_pair(work_path / f"{name}.store", 60, _crashing_save, str(work_path / name), tag,
                                          point, victim)
    result["partial"] = {}
    for name in ("same-deleting", KILLED_IN_PREPARE):
        if name == KILLED_IN_PREPARE:
            result["runs"][f"{name}.again"] = _fork_pair(work_path / f"{name}.again.store", 60, _killed_in_prepare,
                                                         str(work_path / name))
        (retired,) = (work_path / name).glob(".deleting.a.*")
        result["partial"][name] = (len(listing(work_path / name / "a")), len(listing(retired)))
    result["verify"] = _fork_pair(work_path / "verify.store", 180, _verify, work, [s[:2] for s in SCENARIOS])
    (work_path / "crash.pkl").write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    crash_main(sys.argv[1])
