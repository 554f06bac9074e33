"""The files of a checkpoint directory: atomic commit of a save, the manifest of checksums, validation at load and
the ``latest`` file. No collectives here: ``zeropp.engine.checkpoint`` runs this on the ranks it names and makes the
ranks agree.

Why: a save killed at any point must leave ``latest`` naming a complete checkpoint and no partial directory under a
name a load reads, and a load must never read a damaged file. A save is written into a hidden staging directory next
to its target, checksummed (sha256, listed in ``manifest.json``) and committed by atomic renames; a checkpoint of the
same tag is renamed away before it is deleted; the next save removes what a killed one left. A load checks every
file against the manifest before anything is unpickled.

docs/engine.md ("How a save is committed") has the directory names, the commit steps, what each kill point leaves
and the ``ZEROPP_CHECKPOINT_CRASH`` test hook.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

LATEST = "latest"
MANIFEST = "manifest.json"
METADATA = ".metadata"
STAGING = ".saving."
ASIDE = ".replaced."
RETIRED = ".deleting."
LATEST_TMP = f".{LATEST}.tmp"
MANIFEST_FORMAT = 1
CHUNK = 4 << 20  # bytes read at a time when checksumming
CRASH_ENV = "ZEROPP_CHECKPOINT_CRASH"
CRASH_POINTS = ("written", "manifest", "aside", "renamed", "latest", "retired", "deleting")
_SHARD = re.compile(r"__(\d+)_")
_TAG = re.compile(r"[^/\\\x00-\x1f\x7f]{1,255}")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded: a file of it is missing, truncated or corrupted, it is of another
    model (a parameter's name or shape), optimizer or parameter grouping, or the save failed on some rank."""


def crash_point(point: str, global_rank: int) -> None:
    """Test hook (module docstring): SIGKILL this process at ``point`` when ``ZEROPP_CHECKPOINT_CRASH`` asks."""
    if os.environ.get(CRASH_ENV) == f"{point}:{global_rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def check_tag(tag: str) -> str:
    """``tag`` if it can name a checkpoint directory: 1 to 255 printable characters, no path separator, not
    starting with a dot (those names are the save's own), not ``latest``."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r} is not a valid directory name: use 1 to 255 printable "
                              f"characters without '/', not starting with '.' and not {LATEST!r}")
    return tag


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tags(root: Path) -> list[str]:
    """The complete checkpoints in ``root`` (directories with a ``.metadata``; not the save's dot-named ones)."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and (p / METADATA).is_file())


def read_latest(root: Path) -> str:
    """The tag in ``root/latest``. Raises ``FileNotFoundError`` when it is missing, ``CheckpointError`` when it
    holds no tag (empty, binary, a path)."""
    latest = root / LATEST
    if not latest.is_file():
        raise FileNotFoundError(f"no tag given and no {str(latest)!r} file: pass tag= (one of {tags(root)})")
    data = latest.read_bytes()
    try:
        tag = check_tag(data.decode("utf-8").strip())
    except (UnicodeDecodeError, CheckpointError):
        raise CheckpointError(f"{str(latest)!r} holds no checkpoint tag ({len(data)} bytes: {data[:40]!r}); pass "
                              f"tag= (one of {tags(root)}) or write the tag into it") from None
    return tag


def complete(path: Path) -> bool:
    """Whether the directory ``path`` holds a whole checkpoint: its ``.metadata``, and every file its manifest lists
    at the listed size (no checksums: that is for a load to do)."""
    if not (path / METADATA).is_file():
        return False
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


def resolve(save_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The directory of checkpoint ``tag`` of ``save_dir`` (the tag read from ``latest`` when ``None``):
    ``save_dir/tag``, or ``save_dir/.replaced.<tag>`` when a save of the same tag was killed between its two
    renames (and it is complete). Raises ``FileNotFoundError`` naming the path when the directory, ``latest`` or
    the tag is missing."""
    root = Path(save_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    tag = read_latest(root) if tag is None else check_tag(tag)
    if (root / tag / METADATA).is_file():
        return root / tag
    if complete(aside := root / f"{ASIDE}{tag}"):
        return aside
    raise FileNotFoundError(f"no checkpoint {tag!r} in {str(root)!r} ({str(root / tag / METADATA)!r} is missing; "
                            f"the checkpoints there: {tags(root)})")


def _delete(path: Path, global_rank: int) -> None:
    """Delete the directory ``path`` (already under a name no load reads), file by file."""
    for child in sorted(path.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
        crash_point("deleting", global_rank)
    path.rmdir()


def _retire(root: Path, aside: Path, global_rank: int) -> None:
    """Delete the old checkpoint ``aside`` (``root/.replaced.<tag>``): renamed to ``.deleting.<tag>.<nonce>``
    first, durably, so that no partial directory is ever left under a name ``resolve`` or ``prepare`` reads."""
    retired = root / f"{RETIRED}{aside.name[len(ASIDE):]}.{uuid.uuid4().hex[:12]}"
    os.rename(aside, retired)
    _fsync_dir(root)
    crash_point("retired", global_rank)
    _delete(retired, global_rank)


def prepare(root: Path, tag: str, global_rank: int) -> Path:
    """Before a save (first rank only, global rank ``global_rank``): create ``root``, undo what a killed save left
    (module docstring: a complete ``.replaced.<t>`` whose ``<t>`` is missing is renamed back, every other
    ``.replaced.*`` is retired, every ``.saving.*`` and ``.deleting.*`` deleted, ``.latest.tmp`` removed) and create
    an empty staging directory for ``tag``. Returns it."""
    root.mkdir(parents=True, exist_ok=True)
    for path in sorted(root.iterdir()):
        if path.name.startswith(ASIDE):
            kept = root / path.name[len(ASIDE):]
            if not kept.exists() and complete(path):
                os.rename(path, kept)
            else:
                _retire(root, path, global_rank)
        elif path.name.startswith((STAGING, RETIRED)):
            _delete(path, global_rank)
        elif path.name == LATEST_TMP:
            path.unlink()
    _fsync_dir(root)
    staging = root / f"{STAGING}{tag}.{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def digest(path: Path, sync: bool = False) -> dict[str, Any]:
    """``{"bytes", "sha256"}`` of the file ``path``, read 4 MiB at a time; with ``sync`` the file is fsynced first
    (its data is on disk before the checkpoint is committed)."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files of ``names`` that ``rank`` (of ``world_size``) checksums: DCP's ``__<r>_<n>.distcp`` to rank
    ``r % world_size`` (at a save, the rank that wrote it, so it reads its page cache), every other file to rank 0."""
    def owner(name: str) -> int:
        m = _SHARD.match(name)
        return int(m.group(1)) % world_size if m is not None else 0

    return [name for name in sorted(names) if owner(name) == rank]


def write_manifest(staging: Path, tag: str, world_size: int, files: dict[str, dict[str, Any]]) -> None:
    """Write and fsync ``staging/manifest.json`` listing ``files`` (name -> ``digest``), then fsync ``staging``."""
    body = {"format": MANIFEST_FORMAT, "tag": tag, "world_size": world_size, "files": dict(sorted(files.items()))}
    with open(staging / MANIFEST, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)


def commit(root: Path, tag: str, staging: Path, global_rank: int) -> Path:
    """Put the complete ``staging`` in place as ``root/tag``, point ``latest`` at it and retire a checkpoint it
    replaces (module docstring, steps 2 to 4). Returns ``root/tag``. When the second rename fails, the old
    checkpoint is renamed back before the error propagates."""
    target, aside = root / tag, root / f"{ASIDE}{tag}"
    replacing = target.exists()
    if replacing:
        os.rename(target, aside)
        crash_point("aside", global_rank)
    try:
        os.rename(staging, target)
    except OSError:
        if replacing:
            os.rename(aside, target)
        raise
    _fsync_dir(root)
    crash_point("renamed", global_rank)
    tmp = root / LATEST_TMP
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)
    crash_point("latest", global_rank)
    if replacing:
        _retire(root, aside, global_rank)
    return target


def read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files listed in ``path/manifest.json`` (name -> ``{"bytes", "sha256"}``), ``None`` when there is no
    manifest. Checks that each is there with its size. Raises ``CheckpointError`` naming the file."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        body = json.loads(manifest.read_bytes())
        files = body["files"]
        if body["format"] != MANIFEST_FORMAT or not isinstance(files, dict) or METADATA not in files:
            raise ValueError(f"format {body['format']!r} or no {METADATA!r} entry")
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{str(manifest)!r} is not a zeropp checkpoint manifest ({type(e).__name__}: {e}); "
                              "the checkpoint cannot be verified: restore it or load another tag") from None
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {str(file)!r} is missing (listed in "
                                  f"{MANIFEST}); restore it or load another tag")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {str(file)!r} has {file.stat().st_size} bytes, {size} when it "
                                  "was saved (truncated or overwritten); restore it or load another tag")
    return files


def verify(path: Path, files: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Check the sha256 of each of ``names`` in ``path`` against ``files`` (``read_manifest``). Raises
    ``CheckpointError`` naming the first file that differs."""
    for name in names:
        file = path / name
        try:
            got = digest(file)
        except OSError as e:
            raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read: {e}") from None
        if got != files[name]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupted: its sha256 is {got['sha256'][:16]}... "
                                  f"({got['bytes']} bytes), {files[name]['sha256'][:16]}... ({files[name]['bytes']} "
                                  "bytes) when it was saved; restore it or load another tag")
