"""Models built without their weights: ``zeropp.Init`` (or ``torch.device("meta")``) and their materialisation, unit by
unit, by ``zeropp.initialize``, so that no rank ever holds the whole model.

    with zeropp.Init():                     # the same as ``with torch.device("meta"):``
        model = MyModel(cfg)
    engine, *_ = zeropp.initialize(model=model, config=cfg, init_seed=0)   # param_init_fn=... optional

Each unit's parameters are allocated, initialised by ``reset_parameters()`` (or ``param_init_fn``) with torch's RNG
seeded from ``init_seed`` and the unit's name, cast, sharded and (stage 3) freed before the next unit. Nothing is
broadcast, and the weights are bit-identical at every world size (equal to ``reset_parameters_by_unit``'s).

docs/engine.md ("Models bigger than one rank") has the steps, the equality rule and the limits.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import swap_tensors

from .policy import UnitPlan, UnitPolicy, plan_units

if TYPE_CHECKING:
    from typing_extensions import Self

ParamInitFn = Callable[[nn.Module], None]
"""Initialises one module's own (not its children's) parameters and buffers in place, like ``reset_parameters``."""


class Init(contextlib.ContextDecorator):
    """DeepSpeed's ``zero.Init`` analogue: modules built inside the context get meta parameters and buffers (no
    memory); ``zeropp.initialize`` materialises them unit by unit (see the module docstring).

    Everything created by a factory function without an explicit device lands on the meta device (it is
    ``torch.device("meta")`` as a context manager). ``enabled=False`` makes it a no-op, as DeepSpeed's.

    DeepSpeed's other arguments are taken so that its scripts run unchanged: ``config_dict_or_path``/``config``,
    ``dtype``, ``mem_efficient_linear`` and ``pin_memory`` are accepted and have nothing to do here
    (``zeropp.initialize`` reads the config and casts to its compute dtype); ``remote_device`` may be ``None`` or
    ``"none"`` (no offload); ``module``, ``data_parallel_group``, ``mpu``, ``zero_param_parallel_group``,
    ``sequence_data_parallel_group``, ``param_swapper`` must be ``None`` and ``zero_quantized_weights``/
    ``zero_quantized_nontrainable_weights`` false: each of those raises a ``ValueError`` saying what to do instead.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        problems = []
        if module is not None:
            problems.append("module=: pass an eagerly built model to zeropp.initialize, which shards it itself")
        if remote_device not in (None, "none"):
            problems.append(f"remote_device={remote_device!r}: offload is not supported; leave it out (or 'none')")
        for name, value in (("data_parallel_group", data_parallel_group), ("mpu", mpu),
                            ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("param_swapper", param_swapper)):
            if value is not None:
                problems.append(f"{name}=: not supported here; the data-parallel layout is "
                                "zeropp.initialize(topology=...)'s")
        for name, value in (("zero_quantized_weights", zero_quantized_weights),
                            ("zero_quantized_nontrainable_weights", zero_quantized_nontrainable_weights)):
            if value:
                problems.append(f"{name}=True: qwZ is the config's zero_optimization.zero_quantized_weights "
                                "(frozen weights included)")
        if problems:
            raise ValueError("zeropp.Init got DeepSpeed arguments it cannot honour:\n  " + "\n  ".join(problems))
        self.enabled = enabled
        self._device: torch.device | None = None

    def __enter__(self) -> Self:
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


@dataclass(frozen=True)
class MetaInit:
    """How ``initialize`` materialises a meta model: the base seed, the optional ``param_init_fn`` and the device."""

    seed: int
    param_init_fn: ParamInitFn | None
    device: torch.device


def unit_seed(seed: int, unit_name: str) -> int:
    """The RNG seed of unit ``unit_name`` (``""`` for the root): the first 63 bits of SHA-256 of
    ``f"{seed}/{unit_name}"``, so that units are independent of each other and of their number."""
    digest = hashlib.sha256(f"{seed}/{unit_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def meta_state(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device: ``True`` when every parameter and buffer is a meta tensor,
    ``False`` when none is; a mix raises ``ValueError``."""
    tensors = [("parameter", n, t) for n, t in model.named_parameters()]
    tensors += [("buffer", n, t) for n, t in model.named_buffers()]
    meta = [f"{kind} {n!r}" for kind, n, t in tensors if t.is_meta]
    if not meta:
        return False
    if len(meta) != len(tensors):
        real = [f"{kind} {n!r}" for kind, n, t in tensors if not t.is_meta]
        raise ValueError(f"the model is partly on the meta device ({meta[:3]}...) and partly not ({real[:3]}...): "
                         "build it entirely under zeropp.Init() / torch.device('meta'), or entirely on a device")
    return True


def _regions(model: nn.Module, plans: list[UnitPlan]) -> dict[str, list[nn.Module]]:
    """Unit name -> the modules of its region that directly hold a parameter or buffer, in ``named_modules``
    order (see the module docstring)."""
    prefixes = sorted((p.name for p in plans if p.name), key=lambda n: n.count("."), reverse=True)
    out: dict[str, list[nn.Module]] = {p.name: [] for p in plans}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is None and next(module.buffers(recurse=False), None) is None:
            continue
        owner = next((p for p in prefixes if name == p or name.startswith(p + ".")), "")
        out[owner].append(module)
    return out


class Materializer:
    """Initialises a model unit by unit (see the module docstring).

    Args:
        model: the model (on the meta device for ``initialize``; any device for ``reset_parameters_by_unit``).
        plans: its units (``plan_units``, frozen parameters included).
        seed: the base seed (``unit_seed``).
        param_init_fn: the initialiser of one module (default: its ``reset_parameters``).
        device: where meta tensors are allocated.
        dtype: the compute dtype floating parameters and buffers are cast to after initialisation (``None``: kept).

    Attributes:
        largest_live_numel: the most parameter elements with storage at any point of ``materialize`` (measured
            from the model's parameters, for tests and benchmarks).
    """

    def __init__(self, model: nn.Module, plans: list[UnitPlan], *, seed: int, param_init_fn: ParamInitFn | None,
                 device: torch.device, dtype: torch.dtype | None) -> None:
        self.model = model
        self.seed = seed
        self.param_init_fn = param_init_fn
        self.device = torch.device(device)
        self.dtype = dtype
        self.regions = _regions(model, plans)
        self.params = list({id(p): p for p in model.parameters()}.values())
        self.meta_like = {id(p): (p.shape, p.dtype) for p in self.params}  # shapes as built (frees make them 0)
        self.largest_live_numel = 0
        if param_init_fn is None:
            holders = {id(m) for region in self.regions.values() for m in region}
            missing = [f"{type(m).__name__} ({n or '<root>'})" for n, m in model.named_modules()
                       if id(m) in holders and not callable(getattr(m, "reset_parameters", None))]
            if missing:
                raise ValueError(f"modules {missing} hold parameters or buffers but have no reset_parameters(): pass "
                                 "param_init_fn=fn to initialize (fn(module) initialises the module's own parameters "
                                 "and buffers in place)")

    @contextlib.contextmanager
    def _others_on_meta(self, mine: set[int]) -> Iterator[None]:
        """Swap every parameter not in ``mine`` for a meta tensor of its built shape; swap back on exit."""
        swapped = []
        for p in self.params:
            if id(p) not in mine:
                shape, dtype = self.meta_like[id(p)]
                stand_in = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
                swap_tensors(p, stand_in)
                swapped.append((p, stand_in))
        try:
            yield
        finally:
            for p, stand_in in swapped:
                swap_tensors(p, stand_in)

    def _live_numel(self) -> int:
        storages = {}
        for p in self.params:
            if not p.is_meta and p.untyped_storage().nbytes():
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes() // p.element_size()
        return sum(storages.values())

    @torch.no_grad()
    def materialize(self, plan: UnitPlan) -> None:
        """Allocate the unit's meta parameters and its region's meta buffers, initialise them from the unit's seed,
        cast them to the compute dtype (see the module docstring)."""
        own = plan.params + plan.frozen
        for _, p in own:
            if p.is_meta:
                swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                             requires_grad=p.requires_grad))
        modules = self.regions[plan.name]
        for module in modules:
            for name, b in list(module.named_buffers(recurse=False)):
                if b.is_meta:
                    setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=self.device))
        accelerator = self.device.type != "cpu"
        index = self.device.index if self.device.index is not None else 0
        with self._others_on_meta({id(p) for _, p in own}), torch.random.fork_rng(
                devices=[index] if accelerator else [], device_type=self.device.type if accelerator else "cuda"):
            torch.manual_seed(unit_seed(self.seed, plan.name))
            for module in modules:
                if self.param_init_fn is not None:
                    self.param_init_fn(module)
                else:
                    module.reset_parameters()
        self.largest_live_numel = max(self.largest_live_numel, self._live_numel())
        if self.dtype is not None:
            for _, p in own:
                if p.dtype.is_floating_point and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
            for module in modules:
                for name, b in list(module.named_buffers(recurse=False)):
                    if b.dtype.is_floating_point and b.dtype != self.dtype:
                        setattr(module, name, b.to(self.dtype))


def reset_parameters_by_unit(model: nn.Module, seed: int = 0, unit_policy: UnitPolicy | None = None,
                             param_init_fn: ParamInitFn | None = None) -> nn.Module:
    """Re-initialise an eagerly built ``model`` in place exactly as ``initialize`` materialises the same model built
    on the meta device with ``init_seed=seed`` (the module docstring's "Equality"): whole, on this process, no
    cast. Returns ``model``."""
    plans = plan_units(model, unit_policy)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    materializer = Materializer(model, plans, seed=seed, param_init_fn=param_init_fn, device=device, dtype=None)
    for plan in plans:
        materializer.materialize(plan)
    return model
