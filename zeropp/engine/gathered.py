"""Whole parameters outside the engine's forward and backward: ``gathered_parameters`` (DeepSpeed's
``GatheredParameters``; ``GatheredParameters`` below takes the parameters instead, as DeepSpeed's, and finds their
engine) and ``model.state_dict()`` at stage 3.

Why: at stage 3 on more than one rank a unit's parameters are empty tensors except while the engine's hooks hold it
gathered, so saving them from one rank (a PEFT adapter, a Hugging Face model) needs them whole on every rank::

    with engine.gathered_parameters():          # every rank: each unit gathered once, whole until the block ends
        if rank == 0:
            model.save_pretrained(save_dir)      # PEFT / transformers: model.state_dict() inside, no communication

Both gather exactly (under qwZ the shards' values, not the dequantized ones); ``gathered_parameters`` is a collective,
and so is ``model.state_dict()`` outside such a block.

docs/engine.md ("Fine-tuning and whole parameters", "Whole parameters in detail") has ``modifier_rank``, pinning,
the state-dict hooks, the memory each needs and the entry check.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .collectives import Collectives
from .entry_check import EntryCheck
from .offload import OptimizerOffload
from .param_offload import ParamOffload
from .unit import Unit


_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()  # the live ZeroEngines (registered by their __init__)


def register(engine: Any) -> None:
    """Make ``engine`` (a ``ZeroEngine``) findable from its module's parameters by ``GatheredParameters``."""
    _ENGINES.add(engine)


def unregister(engine: Any) -> None:
    """``engine.destroy()``: its parameters are plain parameters for ``GatheredParameters`` from now on."""
    _ENGINES.discard(engine)


def engine_of(params: Iterable[torch.Tensor]) -> Any:
    """The live ``ZeroEngine`` whose module holds some of ``params``, or ``None`` when none does. Raises
    ``ValueError`` when they belong to two engines."""
    found = {id(e): e for p in params for e in list(_ENGINES) if e.owns(p)}
    if len(found) > 1:
        raise ValueError(f"GatheredParameters got parameters of {len(found)} different engines; gather each "
                         "engine's parameters in a block of its own")
    return next(iter(found.values()), None)


class GatheredParameters:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters`` (also ``zeropp.zero.GatheredParameters``), for scripts that
    pass parameters rather than the engine: ``engine.gathered_parameters`` over the units owning any of ``params``
    (every stage; see the module docstring), the engine found from the parameters (the live engine whose module
    holds them). Parameters of no engine (a plain model, an engine after ``destroy()``) are already whole: then, or
    with ``enabled=False``, the block is a no-op, as DeepSpeed's for parameters that ``zero.Init`` did not
    partition.

    Args:
        params: one parameter, or an iterable of them (a generator is fine), of one engine's module.
        modifier_rank: the rank in the engine's data-parallel group (the global rank when it is the world, as
            DeepSpeed) whose in-place changes inside the block are broadcast on exit and become the weights.
            Under MiCS (``zeropp.engine.partition``) its position in every shard group: each group takes the
            changes of its rank at that position.
        fwd_module: DeepSpeed's external-parameter registration for use inside a forward; not supported (a
            ``ValueError``): the engine gathers a unit when one of its modules is called.
        enabled: ``False``: a no-op.

    A collective, like ``engine.gathered_parameters``: every rank enters it with the same parameters. Raises
    ``ValueError`` for parameters still on the meta device (a model built under ``zeropp.Init`` before
    ``zeropp.initialize`` materialised it: there are no values to gather or change yet).
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True) -> None:
        self._engine: Any = None
        self._context: contextlib.AbstractContextManager[None] | None = None
        if not enabled:
            return
        if fwd_module is not None:
            raise ValueError("GatheredParameters(fwd_module=...) (another module's parameters used inside a forward) "
                             "is not supported: the engine gathers a unit when one of its modules is called, so call "
                             "the module that owns the parameter")
        self._params = [params] if isinstance(params, torch.Tensor) else list(params)
        meta = [tuple(p.shape) for p in self._params if p.is_meta]
        if meta:
            raise ValueError(f"GatheredParameters got {len(meta)} parameter(s) on the meta device (shapes {meta[:3]}): "
                             "a model built under zeropp.Init has no values until zeropp.initialize materialises it; "
                             "set initial values with initialize(param_init_fn=...), or change them after initialize "
                             "inside GatheredParameters(params, modifier_rank=0)")
        self._engine = engine_of(self._params)
        if self._engine is None:
            return
        ranks = list(self._engine.comm.topology.ranks)  # MiCS: the shard group, a position in every group
        if modifier_rank is not None and not 0 <= modifier_rank < len(ranks):
            raise ValueError(f"modifier_rank={modifier_rank} is not a rank of the engine's data-parallel group of "
                             f"{len(ranks)} ranks")
        self._modifier = None if modifier_rank is None else ranks[modifier_rank]

    def __enter__(self) -> None:
        if self._engine is not None:
            self._context = self._engine._gathered_params(self._params, modifier_rank=self._modifier)
            self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(*exc)


def _param_owners(units: list[Unit]) -> dict[int, Unit]:
    """``id`` of every parameter held by a unit (trainable and frozen) -> its unit."""
    owners = {id(p): unit for unit in units for p in unit.params}
    owners.update({id(p): unit for unit in units if unit.frozen is not None for p in unit.frozen.params})
    return owners


@contextlib.contextmanager
def gathered_parameters(units: list[Unit], chosen: Iterable[torch.Tensor], modifier_rank: int | None,
                        comm: Collectives, entry_check: EntryCheck, offload: OptimizerOffload,
                        param_offload: ParamOffload) -> Iterator[None]:
    """The context of ``ZeroEngine.gathered_parameters`` (see the module docstring) over the parameters ``chosen``
    (the engine's module's); ``units``, ``comm``, ``entry_check``, ``offload`` (where the masters live) and
    ``param_offload`` (the compute shards) are the engine's."""
    ranks = list(comm.topology.ranks)
    if modifier_rank is not None and modifier_rank not in ranks:
        raise ValueError(f"modifier_rank={modifier_rank} is not a global rank of the data-parallel group {ranks}")
    params = {id(p): p for p in chosen}
    owners = _param_owners(units)
    needed = {id(owners[key]) for key in params if key in owners}
    picked = [u for u in units if id(u) in needed]  # the engine's order: the same collectives on every rank
    loose = [p for key, p in params.items() if key not in owners]  # whole on every rank (stages 1/2 frozen, ...)
    if modifier_rank is not None or any(unit.gather_exact_communicates for unit in picked):  # a collective
        entry_check.check("engine.gathered_parameters()")
    for unit in picked:
        unit.gather_exact()
        unit.pinned += 1
    failed = False
    try:
        if picked and picked[0].sharded:
            param_offload.check(comm, "engine.gathered_parameters()")  # NVMe: a shard read failed on some rank
        yield
    except BaseException:
        failed = True  # no write-back (the other ranks would wait in it); just release
        raise
    finally:
        if modifier_rank is not None and not failed:
            with torch.no_grad():
                for unit in picked:
                    with offload.resident(units, [units.index(unit)], write=True):
                        unit.write_back(modifier_rank)
                param_offload.drain()
                for p in loose:
                    comm.broadcast(p.data, modifier_rank)
        for unit in picked:
            unit.pinned -= 1
            unit.end_exact()


class StateDictGathering:
    """The stage-3 state-dict hooks on every module of ``model`` (see the module docstring).

    A pre-hook counts the ``state_dict`` calls in progress; each module's post-hook replaces the entries of its own
    parameters held by ``units`` with whole values (``Unit.exact_values``, read or gathered once per unit per
    outermost call; before the call's first gather, ``entry_check`` checks that every rank made it); when the
    outermost call ends the cache is dropped and, when it read some unit, ``after()`` runs (the engine's agreement
    on a failed NVMe shard read, ``ParamOffload.check``).
    """

    def __init__(self, model: nn.Module, units: list[Unit], entry_check: EntryCheck,
                 after: Callable[[], None] | None = None) -> None:
        self.owners = _param_owners(units)
        self.entry_check = entry_check
        self.after = after
        self._checked = False  # the outermost call in progress has had its arrival check
        self._depth = 0
        self._cache: dict[int, dict[int, torch.Tensor]] = {}  # id(unit) -> its whole values by id(param)
        self._suspended = 0
        self.handles: list[RemovableHandle] = []
        def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:  # the public API wants a function
            self._pre(module, prefix, keep_vars)

        def post(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            self._post(module, state_dict, prefix, local_metadata)

        for m in model.modules():
            self.handles.append(m.register_state_dict_pre_hook(pre))
            self.handles.append(m.register_state_dict_post_hook(post))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """``state_dict()`` calls inside return what the module holds (the engine's own bookkeeping, no
        communication)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _pre(self, _module: nn.Module, _prefix: str, _keep_vars: bool) -> None:
        self._depth += 1

    def _post(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _local_metadata: Any) -> None:
        self._depth -= 1
        read = False
        try:
            if not self._suspended:
                self._replace(module, state_dict, prefix)
        except BaseException:
            self._depth = 0  # the error ends the outermost call: the enclosing modules' post-hooks will not run
            raise
        finally:
            if self._depth == 0:
                read = bool(self._cache)
                self._cache.clear()
                self._checked = False
        if read and self.after is not None:
            self.after()

    def _replace(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        for name, p in module.named_parameters(recurse=False):
            unit = self.owners.get(id(p))
            key = prefix + name
            if unit is None or key not in state_dict:
                continue
            if id(unit) not in self._cache:
                if not unit.pinned and not self._checked:
                    self.entry_check.check("model.state_dict() at stage 3")
                    self._checked = True
                self._cache[id(unit)] = unit.exact_values()
            state_dict[key] = self._cache[id(unit)][id(p)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
