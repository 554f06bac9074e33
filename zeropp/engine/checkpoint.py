"""Checkpoints of a ``ZeroEngine`` with ``torch.distributed.checkpoint`` (DCP): sharded save, resharding load, and
the consolidated (whole, plain) fp32 state dict, online and offline.

Every rank writes only its own pieces of each parameter (fp32 masters, optimizer state, frozen parameters) as 1-D
tensors chunked by rank, through DCP's public planner API, so a checkpoint loads at any world size, stage and
alignment, and a run resumed at the same world size continues bit for bit. Failures are raised on every rank
(``CheckpointError``), never on some while others wait in a collective. The files (atomic save, manifest, ``latest``)
are ``zeropp.engine.checkpoint_files``.

docs/engine.md ("Checkpoints", "What a checkpoint holds") has the directory, every DCP key, what a load restores, how
errors are agreed and why the planners rather than DTensor. DCP itself is imported by the functions that save or
load (``dcp_planners`` says why).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..offload import SwapError
from .checkpoint_files import (
    METADATA,
    CheckpointError,
    check_tag,
    commit,
    crash_point,
    digest,
    prepare,
    read_manifest,
    resolve,
    share,
    verify,
    write_manifest,
)
from .unit import FrozenFlat, Unit

if TYPE_CHECKING:
    from .engine import ZeroEngine

try:
    import numpy
except ImportError:  # numpy is optional: its RNG is saved when it is there
    numpy = None

FORMAT_VERSION = 2  # 2: frozen parameters saved 1-D (sharded at stage 3)
_HINT = " (a file of it is missing, truncated or not DCP's)"


@dataclass(frozen=True)
class Slice:
    """This rank's elements ``[offset, offset + values.numel())`` of a 1-D tensor of ``numel`` elements in the
    checkpoint: one DCP chunk of it. ``values`` views the engine's storage (a save writes it, a load reads into
    it in place); for a save of a unit swapped out to NVMe it is a meta tensor of the piece's shape, and ``read``
    returns the values (read from the swap file when DCP writes the piece, so a save holds one piece at a time)."""

    values: torch.Tensor
    offset: int
    numel: int
    read: Callable[[], torch.Tensor] | None = None


def _params(engine: ZeroEngine) -> Iterator[tuple[str, Unit, int]]:
    """``(name, unit, index in the unit)`` of every trainable parameter, tied ones once."""
    for unit in engine.units:
        for i, name in enumerate(unit.param_names):
            yield name, unit, i


def _slice(unit: Unit | FrozenFlat, index: int, local: torch.Tensor,
           read: Callable[[int, int], torch.Tensor] | None = None) -> Slice | None:
    """This rank's piece of parameter ``index`` of ``unit`` (a ``Unit`` or its ``FrozenFlat``), a view of
    ``local`` (a tensor in the layout of this rank's shard); ``None`` when the shard holds no element of it. A
    shard is one contiguous run of the unit's flat buffer, so it holds one piece of a parameter at most. With
    ``read`` (``local`` is swapped out), the piece is read when needed: ``read(start, numel)`` in the shard."""
    off, numel = unit.offsets[index], unit.shapes[index].numel()
    a, b = max(off, unit.start), min(off + numel, unit.start + unit.shard_numel)
    if a >= b:
        return None
    if read is not None:
        start, count = a - unit.start, b - a
        return Slice(torch.empty(count, dtype=local.dtype, device="meta"), a - off, numel,
                      lambda: read(start, count))
    return Slice(local[a - unit.start : b - unit.start], a - off, numel)


def _split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Slice]]:
    """``state`` as DCP's default planners take it (tensors, pickled bytes) and its ``Slice`` entries."""
    slices = {key: value for key, value in state.items() if isinstance(value, Slice)}
    return {key: value for key, value in state.items() if key not in slices}, slices


def _module_state(engine: ZeroEngine) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)`` as the module holds it (the stage-3 gathering hooks suspended)."""
    gathering = engine.state_dict_gathering
    with gathering.suspended() if gathering is not None else contextlib.nullcontext():
        return engine.module.state_dict(keep_vars=True)


def state_dict_sources(engine: ZeroEngine) -> dict[str, str]:
    """Every key of ``module.state_dict()`` -> the key its value is saved under: a trainable parameter's unit name,
    else the first key holding the same tensor."""
    canonical = {id(unit.params[i]): name for name, unit, i in _params(engine)}
    out = {}
    for key, value in _module_state(engine).items():
        out[key] = canonical.setdefault(id(value), key)
    return out


def _frozen(engine: ZeroEngine) -> dict[str, tuple[nn.Parameter, FrozenFlat | None, int]]:
    """Every frozen parameter by the key it is saved under: ``(parameter, its FrozenFlat, index)`` when sharded
    (stage 3), ``(parameter, None, 0)`` when whole."""
    sharded = {id(p): (flat, i) for unit in engine.units if (flat := unit.frozen) is not None
               for i, p in enumerate(flat.params)}
    values = _module_state(engine)
    out = {}
    for key in dict.fromkeys(state_dict_sources(engine).values()):
        value = values[key]
        if isinstance(value, nn.Parameter) and not value.requires_grad:
            flat, i = sharded.get(id(value), (None, 0))
            out[key] = (value, flat, i)
    return out


def _frozen_shape(param: nn.Parameter, flat: FrozenFlat | None, index: int) -> torch.Size:
    return flat.shapes[index] if flat is not None else param.shape


def _others(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The persistent buffers (and other non-parameter entries), by the key they are saved under."""
    skip = {name for name, _, _ in _params(engine)} | set(_frozen(engine))
    values = _module_state(engine)
    return {key: values[key].detach() for key in dict.fromkeys(state_dict_sources(engine).values()) if key not in skip}


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def _engine_state(engine: ZeroEngine) -> dict[str, Any]:
    opt = engine.optimizer
    scaler = engine.loss_scaler
    return {
        "format_version": FORMAT_VERSION,
        "optimizer": opt.type,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "group_steps": list(opt.steps),
        "micro_steps": engine.micro_steps,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "overflow": engine.overflow,
        "global_grad_norm": engine.get_global_grad_norm(),
        "global_samples": engine.global_samples,
        "lr_scheduler": _scheduler_state(engine),
        "loss_scaler": None if scaler is None else {
            "scale": scaler.scale, "hysteresis": scaler.hysteresis, "iteration": scaler.iteration,
            "last_overflow_iteration": scaler.last_overflow_iteration},
        "shapes": {name: tuple(unit.shapes[i]) for name, unit, i in _params(engine)},
        "frozen_shapes": {key: tuple(_frozen_shape(*entry)) for key, entry in _frozen(engine).items()},
        "aliases": state_dict_sources(engine),
        "world_size": engine.comm.world_size,
    }


def _scheduler_state(engine: ZeroEngine) -> Any:
    """The learning-rate scheduler's ``state_dict()`` (``None`` without a scheduler or without that method)."""
    state_dict = getattr(engine.lr_scheduler, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def _layout_of_nodes(engine: ZeroEngine) -> list[int]:
    topo = engine.comm.topology
    return [topo.node_of(g) for g in topo.ranks]


def _error_feedback_key(engine: ZeroEngine) -> str:
    return f"rank{engine.topology.global_rank}.error_feedback"


def _onebit_key(engine: ZeroEngine) -> str:
    return f"rank{engine.topology.global_rank}.onebit"


def _onebit_targets(engine: ZeroEngine, info: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """OneBitAdam: drop this rank's local momenta and worker errors; when ``info`` (this rank's saved description)
    says they were saved at this world size with these units' sizes, allocate them and return them by DCP key, to be
    read in place. Otherwise the next compressed step starts them afresh from the loaded ``exp_avg``
    (``OneBitAdam.begin``)."""
    onebit = engine.onebit
    if onebit is None:
        return {}
    onebit.momentum = [None] * len(engine.units)
    onebit.error = [None] * len(engine.units)
    sizes = [unit.full.numel() for unit in engine.units]
    if (info is None or info["world_size"] != engine.comm.world_size
            or any(u >= len(sizes) or sizes[u] != numel for u, numel in info["units"].items())):
        return {}
    out = {}
    for u in info["units"]:
        onebit.momentum[u] = torch.empty(sizes[u], device=engine.units[u].full.device)
        onebit.error[u] = torch.empty_like(onebit.momentum[u])
        out[f"{_onebit_key(engine)}.{u}.momentum"] = onebit.momentum[u]
        out[f"{_onebit_key(engine)}.{u}.error"] = onebit.error[u]
    return out


def checkpoint_path(save_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """``save_dir/tag``, the tag read from ``save_dir/latest`` when ``None`` (``checkpoint_files.resolve``). Raises
    ``FileNotFoundError`` with the path when the directory, ``latest`` or the tag's checkpoint is missing, and
    ``CheckpointError`` when ``latest`` holds no tag."""
    return resolve(save_dir, tag)


def _describe(error: BaseException) -> str:
    """``error`` in one line for a message: its text when it is ours, else its type and text; for DCP's
    ``CheckpointException`` the first failing rank's exception (not DCP's tracebacks)."""
    import torch.distributed.checkpoint as dcp
    if isinstance(error, dcp.CheckpointException) and error.failures:
        ranks = sorted(error.failures)
        return f"torch.distributed.checkpoint failed on rank(s) {ranks}: {_describe(error.failures[ranks[0]][0])}"
    if isinstance(error, (CheckpointError, FileNotFoundError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _agree(engine: ZeroEngine, error: BaseException | None, payload: Any = None, context: str = "",
           first_alone: bool = False) -> list[Any]:
    """Exchange ``(error, payload)`` over the data-parallel group. When any rank has an error every rank raises
    the same one: ``FileNotFoundError`` when each failing rank's is one, else ``CheckpointError``, its message
    ``context`` then the failing ranks' messages (the failing ranks named unless all failed alike; a rank's message
    is its exception's, DCP's ``CheckpointException`` reduced to its cause; with ``first_alone``, work only the
    first rank did, no rank is named). Returns every rank's payload (by position in the group)."""
    mine = None if error is None else (isinstance(error, FileNotFoundError), _describe(error))
    gathered: list[Any] = [None] * engine.comm.world_size
    dist.all_gather_object(gathered, (mine, payload), group=engine.comm.topology.group)
    failed = [(engine.comm.topology.ranks[q], entry) for q, (entry, _) in enumerate(gathered) if entry is not None]
    if not failed:
        return [p for _, p in gathered]
    texts = dict.fromkeys(text for _, (_, text) in failed)
    if len(texts) > 1:
        body = "; ".join(f"rank {r}: {text}" for r, (_, text) in failed)
    elif len(failed) < len(gathered) and not first_alone:
        body = f"on rank {', '.join(str(r) for r, _ in failed)}: {next(iter(texts))}"
    else:  # the same on every rank
        body = next(iter(texts))
    kind = FileNotFoundError if all(missing for _, (missing, _) in failed) else CheckpointError
    raise kind(context + body) from error


def _frozen_flats(engine: ZeroEngine) -> list[FrozenFlat]:
    """The units' frozen buffers (stage 3)."""
    return [unit.frozen for unit in engine.units if unit.frozen is not None]


def _unit_tensors(engine: ZeroEngine, u: int) -> dict[str, Slice]:
    """The ``model.*`` and ``optim.*`` entries of unit ``u``'s trainable parameters, this rank's pieces (module
    docstring): views of the master and state shards, or, of a unit swapped out by the NVMe tier, pieces read from
    the swap files when written (``Slice.read``)."""
    state: dict[str, Slice] = {}
    unit, offload = engine.units[u], engine.offload
    swapped = offload.swapped(u)
    for i, name in enumerate(unit.param_names):
        kinds = {"model": ("master", unit.master)}
        kinds.update({f"optim.{kind}": (kind, shards[u]) for kind, shards in engine.optimizer.state.items()})
        for prefix, (kind, local) in kinds.items():
            read = (lambda start, count, kind=kind: offload.read_range(u, kind, start, count)) if swapped else None
            piece = _slice(unit, i, local, read)
            if piece is None:  # no element of this parameter on this rank
                break
            state[f"{prefix}.{name}"] = piece
    return state


def _tensors(engine: ZeroEngine, units: Iterator[int] | list[int] | None = None, *,
             others: bool = True) -> dict[str, Any]:
    """The ``model.*`` and ``optim.*`` entries (module docstring) of ``units`` (indices; all by default) and, with
    ``others``, of the frozen parameters and buffers, viewing this rank's tensors (sharded ones as ``Slice``):
    what ``save`` writes and what ``load`` reads into in place."""
    state: dict[str, Any] = {}
    for u in range(len(engine.units)) if units is None else units:
        state.update(_unit_tensors(engine, u))
    if not others:
        return state
    for key, (param, flat, i) in _frozen(engine).items():
        if flat is None:
            state[f"model.{key}"] = param.detach().view(-1)
        elif (piece := _slice(flat, i, flat.shard)) is not None:
            state[f"model.{key}"] = piece
    for key, value in _others(engine).items():
        state[f"model.{key}"] = value
    return state


# ---- save ---------------------------------------------------------------------------------------------------


def _state_to_save(engine: ZeroEngine, client_state: dict[str, Any] | None) -> dict[str, Any]:
    """This rank's DCP state dict (module docstring)."""
    state: dict[str, Any] = _tensors(engine)
    state["engine"] = _pack(_engine_state(engine))
    rank = engine.topology.global_rank
    state[f"rank{rank}.rng"] = _pack(_rng_state())
    described = []
    for u, unit in enumerate(engine.units):
        ef = unit.error_feedback
        if ef is None or ef.residual is None:
            continue
        state[f"{_error_feedback_key(engine)}.{u}.residual"] = ef.residual
        state[f"{_error_feedback_key(engine)}.{u}.partial_residual"] = ef.partial_residual
        numel, partial = ef.numels
        described.append({"unit": u, "key": ef.key, "numel": numel, "partial_numel": partial,
                          "slices": [engine.comm.world_size, engine.comm.topology.num_nodes]})
    if described:
        state[_error_feedback_key(engine)] = _pack({"world_size": engine.comm.world_size,
                                                    "nodes": _layout_of_nodes(engine), "units": described})
    onebit = engine.onebit
    held = [] if onebit is None else [u for u, m in enumerate(onebit.momentum) if m is not None]
    if held:
        assert onebit is not None
        for u in held:
            state[f"{_onebit_key(engine)}.{u}.momentum"] = onebit.momentum[u]
            state[f"{_onebit_key(engine)}.{u}.error"] = onebit.error[u]
        state[_onebit_key(engine)] = _pack({"world_size": engine.comm.world_size,
                                            "units": {u: onebit.momentum[u].numel() for u in held}})
    if engine.comm.rank == 0:
        state["client_state"] = _pack(dict(client_state or {}))
    return state


def save(engine: ZeroEngine, save_dir: str | os.PathLike[str], tag: str | None = None,
         client_state: dict[str, Any] | None = None) -> Path:
    """Write ``engine``'s state (see the module docstring) to ``save_dir/tag`` and ``tag`` to ``save_dir/latest``,
    atomically (``checkpoint_files``): the files go to a staging directory, every rank checksums and fsyncs what
    it wrote, and only when every rank succeeded does the first rank rename the checkpoint into place (replacing
    one of the same tag) and update ``latest``. ``save_dir`` must be one filesystem that every rank sees. A
    collective over the data-parallel group; call it at an accumulation boundary (``ZeroEngine.save_checkpoint``
    checks). Returns the checkpoint's directory.

    Raises:
        CheckpointError: on every rank, when the save failed on any (``save_dir`` not writable or not shared, a
            full disk, an exception while gathering the state); ``save_dir`` is then as it was before.
    """
    import torch.distributed.checkpoint as dcp

    from .dcp_planners import SavePlanner
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    root = Path(save_dir)
    first, rank, world = engine.comm.rank == 0, engine.topology.global_rank, engine.comm.world_size
    context = f"save_checkpoint to {str(root / tag)!r} failed, nothing was changed: "
    staging, error = None, None
    if first:
        try:
            staging = prepare(root, tag, rank)
        except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
            error = e
    staging = _agree(engine, error, staging, context, first_alone=True)[0]
    held = contextlib.ExitStack()  # swapped frozen shards (NVMe offload_param), in memory until written
    try:
        error, state = None, {}
        try:
            held.enter_context(engine.param_offload.resident(_frozen_flats(engine)))
            if engine.param_offload.failure is not None:
                raise engine.param_offload.failure
            if not staging.is_dir():
                raise CheckpointError(f"rank {rank} does not see the directory {str(staging)!r} that the first rank "
                                      "created: save_dir must be one filesystem shared by every rank")
            state = _state_to_save(engine, client_state)
        except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
            error = e
        _agree(engine, error, None, context)
        digests: dict[str, Any] = {}
        try:
            plain, slices = _split(state)
            planner = SavePlanner(slices)
            writer = dcp.FileSystemWriter(staging, per_thread_copy_ahead=0) if planner.lazy else None
            dcp.save(plain, checkpoint_id=staging, storage_writer=writer, process_group=engine.comm.topology.group,
                     planner=planner)
            crash_point("written", rank)
            names = [p.name for p in staging.iterdir()]
            digests = {name: digest(staging / name, sync=True) for name in share(names, engine.comm.rank, world)}
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - raised on every rank by _agree
            error = e
        gathered = _agree(engine, error, digests, context)
        if first:
            try:
                write_manifest(staging, tag, world, {k: v for files in gathered for k, v in files.items()})
                crash_point("manifest", rank)
                commit(root, tag, staging, rank)
            except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
                error = e
        _agree(engine, error, None, context)
    except BaseException:
        if first:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        held.close()
    return root / tag


# ---- load ---------------------------------------------------------------------------------------------------


def _load_alone(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` in this process alone (no collective), without DCP's warning that this is what it does.
    Raises ``CheckpointError`` when DCP fails (a shard file missing or unreadable)."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=path, no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - any DCP failure, named in ours
            raise CheckpointError(f"reading checkpoint {str(path)!r} failed{_HINT}: {_describe(e)}") from None


def _metadata(path: Path) -> dict[str, Any]:
    """DCP's metadata of the checkpoint ``path`` by key. Raises ``CheckpointError`` when ``.metadata`` cannot be
    read (truncated, not DCP's)."""
    import torch.distributed.checkpoint as dcp
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise CheckpointError(f"checkpoint file {str(path / METADATA)!r} cannot be read ({type(e).__name__}: {e}): "
                              "truncated, or not a torch.distributed.checkpoint; load another tag") from None


def _verified(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """The checkpoint directory ``path`` and its manifest's files, its ``.metadata`` verified; ``None`` and a
    warning for a checkpoint saved without a manifest."""
    files = read_manifest(path)
    if files is None:
        warnings.warn(f"checkpoint {str(path)!r} has no manifest.json (saved before zeropp kept checksums): its "
                      "files cannot be verified; save it again to get one", stacklevel=3)
    else:
        verify(path, files, [METADATA])
    return path, files


def _read_own(path: Path, keys: list[str]) -> dict[str, Any]:
    """The pickled entries ``keys`` of the checkpoint (all must exist), read by this process alone."""
    holder: dict[str, Any] = {key: b"" for key in keys}
    _load_alone(holder, path)
    return {key: _unpack(value) for key, value in holder.items()}


def _check_compatible(engine: ZeroEngine, metadata: dict[str, Any], saved: dict[str, Any], path: Path) -> None:
    """Raise ``CheckpointError`` naming the first difference between the checkpoint and the engine."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    version = saved["format_version"]
    frozen = _frozen(engine)
    if version not in (1, FORMAT_VERSION) or (version == 1 and frozen):
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {version}, this zeropp reads "
                              f"{FORMAT_VERSION} (and version 1 for models without frozen parameters, which version 1 "
                              "saved whole)")
    shapes = {name: tuple(unit.shapes[i]) for name, unit, i in _params(engine)}
    for name, shape in shapes.items():
        if name not in saved["shapes"]:
            raise CheckpointError(f"checkpoint {str(path)!r} has no parameter {name!r} (another model?)")
        if tuple(saved["shapes"][name]) != shape:
            raise CheckpointError(f"parameter {name!r} has shape {shape} here but {tuple(saved['shapes'][name])} in "
                                  f"checkpoint {str(path)!r} (another model?)")
    extra = sorted(set(saved["shapes"]) - set(shapes))
    if extra:
        raise CheckpointError(f"checkpoint {str(path)!r} has trainable parameters this model lacks (or holds "
                              f"frozen): {extra}")
    for key, entry in frozen.items():
        shape = tuple(_frozen_shape(*entry))
        if tuple(saved["frozen_shapes"].get(key, ())) != shape:
            raise CheckpointError(f"frozen parameter {key!r} (shape {shape}) is not in checkpoint {str(path)!r} with "
                                  "that shape (another model, or one trained with other parameters frozen?)")
    for key, value in _others(engine).items():
        md = metadata.get(f"model.{key}")
        if not isinstance(md, TensorStorageMetadata) or md.size != value.shape:
            raise CheckpointError(f"buffer {key!r} (shape {tuple(value.shape)}) is not in checkpoint {str(path)!r} "
                                  "with that shape (another model?)")
    if saved["optimizer"] != engine.optimizer.type:
        raise CheckpointError(f"checkpoint {str(path)!r} was saved with optimizer {saved['optimizer']}, this engine "
                              f"runs {engine.optimizer.type}")
    if len(saved["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {str(path)!r} has {len(saved['param_groups'])} parameter groups, this "
                              f"engine {len(engine.optimizer.param_groups)}")


def _error_feedback_targets(engine: ZeroEngine, info: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """Reset every unit's qgZ residuals; when ``info`` (this rank's saved description) says they were saved in this
    engine's layout (world size, node of every rank, each unit's padded size, bits of both hops, block size,
    gradient rotation and store, float32 or LoCo's 8 bits: residuals of one rotation or store are never reused under
    another), allocate them
    in that layout and return them by DCP key, to be read in place."""
    for unit in engine.units:
        if unit.error_feedback is not None:
            unit.error_feedback.reset()
    if info is None or info["world_size"] != engine.comm.world_size or info["nodes"] != _layout_of_nodes(engine):
        return {}
    keys = []
    for entry in info["units"]:
        key = tuple(entry["key"])
        key += (0,) * (len(key) < 5)  # saved before the rotation (4 fields): no rotation
        key += (key[1],) * (len(key) < 6)  # saved before intra_bits (5 fields): both hops in the same bits
        key += (0,) * (len(key) < 7)  # saved before LoCo's 8-bit store (6 fields): float32 residuals
        u, (numel, bits, block, _, rotation, intra, store) = entry["unit"], key
        if u >= len(engine.units) or engine.units[u].error_feedback is None:
            return {}
        comm = engine.units[u].comm
        if (numel != engine.units[u].full.numel()
                or (bits, block, rotation, intra, store) != (comm.gradient_bits, engine.comm.block_size,
                                                             comm.gradient_rotation or 0, comm.hop1_bits,
                                                             8 if comm.error_feedback == "loco" else 0)):
            return {}
        keys.append(key)
    prefix = _error_feedback_key(engine)
    out = {}
    for entry, key in zip(info["units"], keys):
        u, unit = entry["unit"], engine.units[entry["unit"]]
        ef = unit.error_feedback
        slices = tuple(entry.get("slices", (1, 1)))  # saved before LoCo: float32 residuals, which have no packs
        ef.allocate(key, entry["numel"], entry["partial_numel"], unit.full.device, slices)
        out[f"{prefix}.{u}.residual"] = ef.residual
        out[f"{prefix}.{u}.partial_residual"] = ef.partial_residual
    return out


def load(engine: ZeroEngine, load_dir: str | os.PathLike[str], tag: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Restore ``engine`` from ``load_dir/tag`` (``tag`` from ``load_dir/latest`` when ``None``), saved at any world
    size and unit layout. A collective over the data-parallel group. Returns the checkpoint's directory and the
    ``client_state`` given to ``save``.

    The first rank finds the checkpoint and checks its manifest (every file there with its size, ``.metadata``'s
    sha256); then each rank checks the sha256 of a share of the shard files (``checkpoint_files.share``), and every
    rank its compatibility; nothing is read into the engine unless every check passed on every rank.

    Raises (on every rank):
        FileNotFoundError: the directory, ``latest`` or the tag is missing.
        CheckpointError: ``latest`` holds no tag; a file of the checkpoint is missing, truncated or corrupted (the
            file named); another model (a parameter's name or shape), optimizer type or number of groups.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from .dcp_planners import LoadPlanner
    first, rank = engine.comm.rank == 0, engine.topology.global_rank
    found, error = None, None
    if first:
        try:
            found = _verified(resolve(load_dir, tag))
        except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
            error = e
    path, files = _agree(engine, error, found, first_alone=True)[0]
    saved: dict[str, Any] = {}
    try:
        if files is not None:
            verify(path, files, [n for n in share(list(files), engine.comm.rank, engine.comm.world_size)
                                 if n != METADATA])
        metadata = _metadata(path)
        if not isinstance(metadata.get("engine"), BytesStorageMetadata):
            raise CheckpointError(f"{str(path)!r} is a DCP checkpoint but not one of ZeroEngine.save_checkpoint")
        own = [key for key in ("engine", "client_state", f"rank{rank}.rng", _error_feedback_key(engine),
                               _onebit_key(engine))
               if isinstance(metadata.get(key), BytesStorageMetadata)]
        saved = _read_own(path, own)
        _check_compatible(engine, metadata, saved["engine"], path)
    except Exception as e:  # noqa: BLE001 - raised on every rank by _agree
        error = e
    _agree(engine, error)

    # every tensor is read in place: masters, optimizer state, frozen parameters (shards), buffers, qgZ residuals;
    # an NVMe offload tier's units, a group of buffer_count at a time, are read from its swap files, loaded, and
    # written back (one dcp.load per group); swapped frozen shards (offload_param nvme) are loaded with the first
    # group (zeroed, then filled: no read); the compute shards are written by publish
    for n, group in enumerate(engine.offload.batches(len(engine.units))):
        frozen = engine.param_offload.resident(_frozen_flats(engine), read=False, write=True) if n == 0 else None
        with _held(engine, group, path), frozen or contextlib.nullcontext():
            state = _tensors(engine, group, others=n == 0)
            if n == 0:
                state.update(_error_feedback_targets(engine, saved.get(_error_feedback_key(engine))))
                state.update(_onebit_targets(engine, saved.get(_onebit_key(engine))))
            try:
                plain, slices = _split(state)
                dcp.load(plain, checkpoint_id=path, process_group=engine.comm.topology.group,
                         planner=LoadPlanner(slices))
            except dcp.CheckpointException as e:  # raised on every rank by DCP
                raise CheckpointError(f"reading checkpoint {str(path)!r} failed{_HINT}: {_describe(e)}") from None
            for u in group:
                unit = engine.units[u]
                unit.publish()  # compute shard (and stages 1/2: whole parameters) from the masters; stage 3: freed
                if unit.frozen is not None:
                    unit.frozen.secondary = None  # hpZ: held the values before the load
        engine.param_offload.drain()
    engine.param_offload.check(engine.comm, f"loading checkpoint {str(path)!r}")
    values = saved["engine"]
    opt = engine.optimizer
    for group, hyper in zip(opt.param_groups, values["param_groups"]):
        group.update(hyper)
    opt.steps = list(values["group_steps"])
    engine.micro_steps = values["micro_steps"]
    engine.global_steps = values["global_steps"]
    engine.skipped_steps = values["skipped_steps"]
    engine.overflow = values["overflow"]
    engine._global_grad_norm = values["global_grad_norm"]
    engine.global_samples = values.get("global_samples", engine.global_steps * engine.train_batch_size())
    if engine.lr_scheduler is not None and values.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(values["lr_scheduler"])
    if engine.loss_scaler is not None and values["loss_scaler"] is not None:
        for attr, value in values["loss_scaler"].items():
            setattr(engine.loss_scaler, attr, value)
    if f"rank{rank}.rng" in saved:
        _set_rng_state(saved[f"rank{rank}.rng"])
    return path, saved["client_state"]


@contextlib.contextmanager
def _held(engine: ZeroEngine, group: list[int], path: Path) -> Iterator[None]:
    """The NVMe offload tier's units ``group`` in memory for a load into them, written back to the swap files at the
    end; a swap failure on any rank raises on every rank (``_agree``) before the next collective, and leaves the
    engine unusable (``OffloadError`` at its next use: some units hold the checkpoint, some not)."""
    context = f"loading checkpoint {str(path)!r} failed: "
    held, error = contextlib.ExitStack(), None
    try:
        held.enter_context(engine.offload.resident(engine.units, group, write=True))
    except SwapError as e:
        error = e
    try:
        _agree_swap(engine, error, context)
        yield
    except BaseException:
        held.__exit__(*sys.exc_info())  # the group is released unwritten
        raise
    error = None
    try:
        held.close()
    except SwapError as e:
        error = e
    _agree_swap(engine, error, context)


def _agree_swap(engine: ZeroEngine, error: SwapError | None, context: str) -> None:
    try:
        _agree(engine, error, None, context)
    except CheckpointError as e:
        engine._failure = (f"{e}; the engine's weights are no longer consistent: build a new engine and load a "
                           "checkpoint")
        raise


# ---- consolidated state dict --------------------------------------------------------------------------------


@torch.no_grad()
def consolidated_state_dict(engine: ZeroEngine, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict with every trainable parameter whole, from the fp32 master weights (exact: not the
    qwZ-dequantized compute copy), shaped as the parameter, fp32; frozen parameters whole in the compute dtype (an
    exact all-gather of their shards at stage 3); buffers as the module holds them. Keys and tied aliases are the
    module's ``state_dict()``'s, so the unwrapped model's ``load_state_dict`` takes it. A collective: one exact fp32
    all-gather of each unit's master shards in turn (``N`` elements of transient memory for a unit of ``N``). With
    ``rank0_only`` only the data-parallel group's first rank returns it (the others get ``{}``)."""
    keep = not rank0_only or engine.comm.rank == 0
    whole: dict[str, torch.Tensor] = {}
    by_param: dict[int, torch.Tensor] = {}  # sharded frozen parameters
    for u, unit in enumerate(engine.units):
        full = torch.empty(unit.full.numel(), dtype=torch.float32, device=unit.full.device)
        with engine.offload.resident(engine.units, [u], write=False):  # an offloaded master: gathered on the device
            engine.comm.gather_exact(unit.master.to(unit.full.device), full)
        if keep:
            for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
                whole[name] = full[off : off + shape.numel()].view(shape).clone()
        if unit.frozen is not None:
            values = unit.frozen.full.new_empty(unit.comm.world_size * unit.frozen.shard_numel)
            engine.comm.gather_exact(unit.frozen.device_shard(), values)
            unit.frozen.release_shard()
            if keep:
                for p, off, shape in zip(unit.frozen.params, unit.frozen.offsets, unit.frozen.shapes):
                    by_param[id(p)] = values[off : off + shape.numel()].view(shape).clone()
    if not keep:
        return {}
    others = {key: value.clone() for key, value in _others(engine).items()}
    for key, (param, flat, _) in _frozen(engine).items():
        others[key] = by_param[id(param)] if flat is not None else param.detach().clone()
    return {key: whole[src] if src in whole else others[src] for key, src in state_dict_sources(engine).items()}


@torch.no_grad()
def load_whole_state_dict(engine: ZeroEngine, state_dict: Mapping[str, torch.Tensor],
                          strict: bool) -> tuple[list[str], list[str]]:
    """Load a whole state dict of the module (``ZeroEngine.load_state_dict``): each trainable parameter's elements
    in this rank's master shard are copied from it (any dtype, converted to fp32), then every unit is published
    (stages 1 and 2: an all-gather); buffers and whole frozen parameters are copied into the module, sharded frozen
    parameters (stage 3) into this rank's frozen shard. Returns ``(missing keys, unexpected keys)``; with ``strict``
    either raises ``KeyError`` before anything is loaded."""
    sources = state_dict_sources(engine)
    missing = [key for key in sources if key not in state_dict]
    unexpected = [key for key in state_dict if key not in sources]
    if strict and (missing or unexpected):
        raise KeyError(f"load_state_dict(strict=True): missing keys {missing}, unexpected keys {unexpected}; pass "
                       "the module's whole state dict, or strict=False")
    values: dict[str, torch.Tensor] = {}
    for key, src in sources.items():
        if key in state_dict:
            values.setdefault(src, state_dict[key])
    for name, unit, i in _params(engine):
        if name in values and tuple(values[name].shape) != tuple(unit.shapes[i]):
            raise ValueError(f"load_state_dict: {name!r} has shape {tuple(values[name].shape)}, the model's is "
                             f"{tuple(unit.shapes[i])}")
    for u, unit in enumerate(engine.units):
        with engine.offload.resident(engine.units, [u], write=True):
            for i, a, b in unit.param_ranges():
                value = values.get(unit.param_names[i])
                if value is not None:
                    flat = value.detach().reshape(-1).to(device=unit.master.device, dtype=torch.float32)
                    lo = unit.start + a - unit.offsets[i]
                    unit.master[a:b].copy_(flat[lo : lo + b - a])
            unit.publish()
    engine.param_offload.drain()
    for key, tensor in _others(engine).items():
        if key in values:
            tensor.copy_(values[key])
    for key, (param, flat, i) in _frozen(engine).items():
        if key not in values:
            continue
        if flat is None:
            param.copy_(values[key])
            continue
        # this rank's piece of the sharded frozen parameter; the hpZ secondary no longer holds its values
        whole = values[key].detach().reshape(-1).to(device=flat.shard.device, dtype=flat.shard.dtype)
        lo, hi = flat.offsets[i], flat.offsets[i] + flat.shapes[i].numel()
        a, b = max(lo, flat.start), min(hi, flat.start + flat.shard_numel)
        if a < b:
            with engine.param_offload.resident([flat], write=True):  # a swapped shard: read, changed, written
                flat.shard[a - flat.start : b - flat.start].copy_(whole[a - lo : b - lo])
        flat.secondary = None
    return missing, unexpected


def consolidate(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """Read a checkpoint written by ``ZeroEngine.save_checkpoint`` in this process alone (no process group needed)
    into the plain state dict ``consolidated_state_dict`` gives: fp32 master weights whole and shaped, buffers and
    frozen parameters, tied aliases. ``checkpoint_dir`` is a checkpoint (``save_dir/tag``) or a ``save_dir`` (the
    tag given or read from ``latest``). Memory: the whole model once."""
    root = Path(checkpoint_dir)
    path, files = _verified(root if tag is None and (root / METADATA).is_file() else resolve(root, tag))
    if files is not None:
        verify(path, files, sorted(set(files) - {METADATA}))
    metadata = _metadata(path)
    saved = _read_own(path, ["engine"])["engine"]
    state = {f"model.{key}": torch.empty(metadata[f"model.{key}"].size,
                                         dtype=metadata[f"model.{key}"].properties.dtype)
             for key in dict.fromkeys(saved["aliases"].values())}
    _load_alone(state, path)
    values = {key[len("model."):]: value for key, value in state.items()}
    for name, shape in {**saved["shapes"], **saved.get("frozen_shapes", {})}.items():
        values[name] = values[name].view(shape)
    return {key: values[src] for key, src in saved["aliases"].items()}
