"""Which modules form the units of the engine, and which unit owns each parameter.

A *unit* is the group of parameters communicated together: one flat buffer, gathered as one all-gather in stage 3
and reduce-scattered as one reduce-scatter. The default policy, ``default_unit_modules``, makes a unit of every
child of every outermost ``nn.ModuleList`` (the transformer blocks of a GPT), and the *root unit* — the model
itself — holds every other parameter (embeddings, final norm, head). ``units_of_type(Block)`` picks the modules by
class instead; any callable ``model -> iterable of modules`` works.

Ownership (``plan_units``): a parameter belongs to the innermost unit module that contains it. A parameter
reached from two different units (tied or shared weights) belongs to the root unit, which stays gathered for the
whole forward and backward, so every user of the parameter sees it. Frozen parameters (``requires_grad=False``)
follow the same rule into ``UnitPlan.frozen`` (stage 3 shards them with their unit; stages 1 and 2 keep them whole on
every rank and never communicate them, but a model built on the meta device is still materialised unit by unit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

UnitPolicy = Callable[[nn.Module], Iterable[nn.Module]]
"""A function returning the modules that become units (the root unit is always added)."""


def default_unit_modules(model: nn.Module) -> list[nn.Module]:
    """Every child of every outermost ``nn.ModuleList`` of ``model`` (``ModuleList``s nested inside a chosen
    child stay in that child's unit)."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c, _ in chosen):
            continue
        if isinstance(module, nn.ModuleList):
            chosen.extend((f"{name}.{child_name}" if name else child_name, child)
                          for child_name, child in module.named_children())
    return [module for _, module in chosen]


def units_of_type(*types: type[nn.Module]) -> UnitPolicy:
    """A policy making a unit of every module that is an instance of one of ``types``."""
    if not types:
        raise ValueError("units_of_type needs at least one module class")

    def policy(model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, types) and m is not model]

    return policy


@dataclass
class UnitPlan:
    """One unit: its module (the model for the root unit), its qualified name, its trainable parameters with their
    qualified names, in first-seen order, and likewise its frozen ones."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    frozen: list[tuple[str, nn.Parameter]] = field(default_factory=list)


def plan_units(model: nn.Module, policy: UnitPolicy | None = None) -> list[UnitPlan]:
    """The units of ``model``: the root unit first (named ``""``), then the policy's modules in model order.
    Units without parameters are left out, except the root (it may be empty); a unit with only frozen parameters is
    kept (``UnitPlan.frozen``)."""
    picked = list((policy or default_unit_modules)(model))
    names: dict[int, str] = {}  # module -> its first qualified name
    order: dict[str, int] = {}  # qualified name -> position in model order
    for i, (n, m) in enumerate(model.named_modules(remove_duplicate=False)):
        names.setdefault(id(m), n)
        order.setdefault(n, i)
    prefixes: list[str] = []
    modules: dict[str, nn.Module] = {}
    for module in picked:
        if not isinstance(module, nn.Module):
            raise TypeError(f"the unit policy returned {type(module).__name__}, not an nn.Module")
        if module is model:
            continue  # the root unit always exists
        if id(module) not in names:
            raise ValueError(f"the unit policy returned a {type(module).__name__} that is not a submodule of the model")
        name = names[id(module)]
        if name not in modules:
            prefixes.append(name)
            modules[name] = module
    # innermost unit first when matching a parameter's name
    by_depth = sorted(prefixes, key=lambda p: p.count(".") + 1, reverse=True)

    def owner(param_name: str) -> str:
        return next((p for p in by_depth if param_name.startswith(p + ".")), "")

    owners: dict[int, set[str]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(owner(pname))
        first.setdefault(id(param), (pname, param))
    members: dict[str, list[tuple[str, nn.Parameter]]] = {"": [], **{p: [] for p in prefixes}}
    frozen: dict[str, list[tuple[str, nn.Parameter]]] = {"": [], **{p: [] for p in prefixes}}
    for key, (pname, param) in first.items():
        units = owners[key]
        (members if param.requires_grad else frozen)[units.pop() if len(units) == 1 else ""].append((pname, param))
    ordered = [""] + sorted(prefixes, key=order.__getitem__)
    return [
        UnitPlan(name=p, module=model if p == "" else modules[p], params=members[p], frozen=frozen[p])
        for p in ordered
        if p == "" or members[p] or frozen[p]
    ]
