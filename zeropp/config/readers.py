"""Readers of one config value or block: each records what is wrong in a ``Problems`` and returns a fallback, so a
config is read to its end and every problem is reported together.

Names are dotted paths (``zero_optimization.stage``). ``"auto"`` anywhere is recorded with ``Problems.auto``.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from typing import Any

from .errors import Problems


def dotted(where: str, key: str) -> str:
    """``where.key``, or ``key`` at the top level."""
    return f"{where}.{key}" if where else key


def is_auto(p: Problems, value: Any, name: str) -> bool:
    """Record and report an ``"auto"`` value."""
    if isinstance(value, str) and value == "auto":
        p.auto(name)
        return True
    return False


def check_keys(
    p: Problems,
    block: Mapping[str, Any],
    where: str,
    valid: list[str],
    unsupported: Mapping[str, str] | None = None,
) -> None:
    """Record every key of ``block`` that is not in ``valid``: a DeepSpeed key zeropp does not do (``unsupported``:
    key -> why) says so; another gets the closest valid spelling and the valid keys of its level."""
    unsupported = unsupported or {}
    for key in block:
        if not isinstance(key, str):
            p.add(dotted(where, repr(key)), f"{where or 'the config'}: keys must be strings, got {key!r}")
            continue
        if key in valid:
            continue
        name = dotted(where, key)
        if key in unsupported:
            p.add(name, f"{name} is a DeepSpeed option that zeropp does not support: {unsupported[key]}; remove it")
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        p.add(name, f"unknown config key {name!r}; {hint}valid keys{' in ' + where if where else ''}: "
                    f"{', '.join(sorted(valid))}")


def check_fixed(p: Problems, block: Mapping[str, Any], where: str, fixed: Mapping[str, tuple[Any, str]]) -> None:
    """DeepSpeed keys that describe what zeropp always does (``fixed``: key -> (the one value, why)): accepted with
    that value, a problem with any other."""
    for key, (value, why) in fixed.items():
        if key not in block:
            continue
        name = dotted(where, key)
        given = block[key]
        if is_auto(p, given, name):
            continue
        if given != value or isinstance(given, bool) != isinstance(value, bool):
            p.add(name, f"{name}={given!r} is not supported: {why}; remove the key or set it to {json.dumps(value)}")


def as_bool(p: Problems, value: Any, name: str, fallback: bool = False) -> bool:
    """``value`` as a bool (``true``/``false`` only)."""
    if is_auto(p, value, name):
        return fallback
    if not isinstance(value, bool):
        p.add(name, f"{name}={value!r} must be true or false")
        return fallback
    return value


def as_int(p: Problems, value: Any, name: str, *, minimum: int | None = None, fallback: int = 0) -> int:
    """``value`` as an int; a float with an integer value (JSON writers spell sizes as ``5e8``) is taken."""
    if is_auto(p, value, name):
        return fallback
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        p.add(name, f"{name}={value!r} must be an integer")
        return fallback
    if minimum is not None and value < minimum:
        p.add(name, f"{name}={value} must be >= {minimum}")
        return fallback
    return value


def as_float(p: Problems, value: Any, name: str, *, minimum: float | None = None, below: float | None = None,
             fallback: float = 0.0) -> float:
    """``value`` as a finite float in ``[minimum, below)``."""
    if is_auto(p, value, name):
        return fallback
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        p.add(name, f"{name}={value!r} must be a finite number")
        return fallback
    value = float(value)
    if minimum is not None and value < minimum:
        p.add(name, f"{name}={value} must be >= {minimum}")
        return fallback
    if below is not None and value >= below:
        p.add(name, f"{name}={value} must be < {below}")
        return fallback
    return value


def get_bool(p: Problems, block: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    return as_bool(p, block.get(key, default), dotted(where, key), default)


def get_int(p: Problems, block: Mapping[str, Any], key: str, where: str, default: int, *,
            minimum: int | None = None) -> int:
    return as_int(p, block.get(key, default), dotted(where, key), minimum=minimum, fallback=default)


def get_float(p: Problems, block: Mapping[str, Any], key: str, where: str, default: float, *,
              minimum: float | None = None, below: float | None = None) -> float:
    return as_float(p, block.get(key, default), dotted(where, key), minimum=minimum, below=below, fallback=default)


def get_block(p: Problems, config: Mapping[str, Any], key: str, where: str = "") -> Mapping[str, Any]:
    """The sub-block ``config[key]`` (``{}`` when absent or null; a problem when not an object)."""
    value = config.get(key, {})
    name = dotted(where, key)
    if value is None:
        return {}
    if is_auto(p, value, name):
        return {}
    if not isinstance(value, Mapping):
        p.add(name, f"{name} must be an object (a dict), got {type(value).__name__}")
        return {}
    return value


def check_disabled(p: Problems, config: Mapping[str, Any], blocks: Mapping[str, str], where: str = "") -> None:
    """DeepSpeed feature blocks zeropp does not have (``blocks``: key -> why), accepted while their ``enabled`` is
    false (or absent: DeepSpeed's default is off); their other keys are not read."""
    for key, why in blocks.items():
        if key not in config:
            continue
        block = get_block(p, config, key, where)
        name = dotted(where, f"{key}.enabled")
        if as_bool(p, block.get("enabled", False), name, False):
            p.add(name, f"{name}=true: {why}; set it to false (or remove the {dotted(where, key)!r} block)")
