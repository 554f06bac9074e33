"""The ``scheduler`` block: DeepSpeed's learning-rate schedules with DeepSpeed's parameter names and defaults (the
schedules themselves: ``zeropp.engine.scheduler``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import Problems
from .readers import as_bool, as_float, as_int, check_keys, get_block, is_auto

_REQUIRED = object()

# per type: parameter -> (DeepSpeed's default, kind); kinds are read by _read below
_PARAMS: dict[str, dict[str, tuple[Any, str]]] = {
    "WarmupLR": {
        "warmup_min_lr": (0.0, "lr"),
        "warmup_max_lr": (None, "lr_or_none"),  # None: the optimizer's lr (of its first parameter group)
        "warmup_num_steps": (1000, "steps"),
        "warmup_type": ("log", "warmup_type"),
    },
    "WarmupDecayLR": {
        "total_num_steps": (_REQUIRED, "steps"),
        "warmup_min_lr": (0.0, "lr"),
        "warmup_max_lr": (0.001, "lr"),
        "warmup_num_steps": (1000, "steps"),
        "warmup_type": ("log", "warmup_type"),
    },
    "WarmupCosineLR": {
        "total_num_steps": (_REQUIRED, "steps"),
        "warmup_min_ratio": (0.0, "ratio"),
        "warmup_num_steps": (1000, "steps"),
        "cos_min_ratio": (0.0001, "ratio"),
        "warmup_type": ("log", "warmup_type"),
    },
    "OneCycle": {
        "cycle_min_lr": (_REQUIRED, "ratio"),
        "cycle_max_lr": (_REQUIRED, "ratio"),
        "decay_lr_rate": (0.0, "ratio"),
        "cycle_first_step_size": (2000, "steps"),
        "cycle_second_step_size": (None, "steps_or_none"),
        "cycle_first_stair_count": (0, "count"),
        "cycle_second_stair_count": (None, "count_or_none"),
        "decay_step_size": (0, "count"),
        "cycle_momentum": (True, "bool"),
        "cycle_min_mom": (0.8, "momentum"),
        "cycle_max_mom": (0.9, "momentum"),
        "decay_mom_rate": (0.0, "ratio"),
    },
}
SCHEDULER_TYPES = tuple(_PARAMS)
_COMMON = {"last_batch_iteration": (-1, "iteration")}
_UNSUPPORTED_TYPES = {"lrrangetest": "the LR range test is not supported"}


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``type`` is one of ``SCHEDULER_TYPES`` (DeepSpeed's spelling; the config may use any case);
    ``params`` has every parameter of that type filled in with DeepSpeed's defaults (``last_batch_iteration`` -1
    included). Learning rates that DeepSpeed takes per parameter group (``warmup_min_lr``, ``warmup_max_lr``) are
    a float or a tuple of floats."""

    type: str = "WarmupLR"
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems) -> SchedulerConfig | None:
        """The parsed block, or ``None`` when its type is unusable (recorded in ``p``)."""
        check_keys(p, block, "scheduler", ["type", "params"])
        kind = block.get("type")
        if is_auto(p, kind, "scheduler.type"):
            return None
        names = {t.lower(): t for t in SCHEDULER_TYPES}
        if not isinstance(kind, str) or kind.lower() not in names:
            why = _UNSUPPORTED_TYPES.get(kind.lower(), "unknown type") if isinstance(kind, str) else "not a name"
            p.add("scheduler.type", f"scheduler.type={kind!r}: {why}; use one of {list(SCHEDULER_TYPES)}")
            return None
        kind = names[kind.lower()]
        specs = {**_PARAMS[kind], **_COMMON}
        given = get_block(p, block, "params", "scheduler")
        check_keys(p, given, "scheduler.params", list(specs))
        params: dict[str, Any] = {}
        for name, (default, how) in specs.items():
            where = f"scheduler.params.{name}"
            if name not in given:
                if default is _REQUIRED:
                    p.add(where, f"{where} is required by scheduler.type={kind!r}; give it")
                    default = 1
                params[name] = default
                continue
            params[name] = _read(p, given[name], where, how, default)
        if kind == "OneCycle" and p.ok("scheduler.params.cycle_min_mom", "scheduler.params.cycle_max_mom") and \
                params["cycle_min_mom"] > params["cycle_max_mom"]:
            p.add("scheduler.params.cycle_min_mom", f"scheduler.params.cycle_min_mom={params['cycle_min_mom']} must "
                                                    f"be <= cycle_max_mom={params['cycle_max_mom']}")
        return cls(type=kind, params=params)


def _read(p: Problems, value: Any, where: str, how: str, default: Any) -> Any:
    """One scheduler parameter of kind ``how``."""
    fallback = 1 if default is _REQUIRED or default is None else default
    if value is None and how.endswith("_or_none"):
        return None
    if how in ("lr", "lr_or_none"):
        if isinstance(value, (list, tuple)):
            if not value:
                p.add(where, f"{where}=[] must be a number or one number per parameter group")
                return fallback
            return tuple(as_float(p, v, where, minimum=0.0) for v in value)
        return as_float(p, value, where, minimum=0.0, fallback=fallback)
    if how in ("steps", "steps_or_none"):
        return as_int(p, value, where, minimum=1, fallback=fallback)
    if how in ("count", "count_or_none"):
        return as_int(p, value, where, minimum=0, fallback=fallback)
    if how == "iteration":
        return as_int(p, value, where, minimum=-1, fallback=fallback)
    if how == "ratio":
        return as_float(p, value, where, minimum=0.0, fallback=fallback)
    if how == "momentum":
        return as_float(p, value, where, minimum=0.0, below=1.0, fallback=fallback)
    if how == "bool":
        return as_bool(p, value, where, fallback)
    assert how == "warmup_type", how
    if is_auto(p, value, where):
        return fallback
    if value not in ("log", "linear"):
        p.add(where, f"{where}={value!r} must be \"log\" or \"linear\"")
        return fallback
    return value
