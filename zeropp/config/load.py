"""``load_config``: a dict, a JSON file or a parsed ``Config`` -> a validated ``Config`` for a world size."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from .errors import ConfigError
from .training import Config


def load_config(config: Mapping[str, Any] | str | os.PathLike[str] | Config, world_size: int = 1) -> Config:
    """Parse and validate ``config`` (a dict, the path of a JSON file, or an already parsed ``Config``) for a
    data-parallel world of ``world_size`` ranks. Raises one ``ConfigError`` naming every offending key."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be a positive integer")
    if isinstance(config, Config):
        if config.world_size != world_size:
            return Config.parse(to_dict(config), world_size)
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        config = read_json(path)
    return Config.parse(config, world_size)


class _DuplicateKeys:
    """``object_pairs_hook`` for ``json.load``: builds each object as a dict and remembers the keys it saw twice."""

    def __init__(self) -> None:
        self.found: dict[int, tuple[dict[str, Any], list[str]]] = {}  # id(object) -> (object, repeated keys)

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        repeated: list[str] = []
        for key, value in pairs:
            if key in obj and key not in repeated:
                repeated.append(key)
            obj[key] = value
        if repeated:
            self.found[id(obj)] = (obj, repeated)
        return obj

    def paths(self, value: Any, where: str = "") -> list[str]:
        """Dotted names (``zero_optimization.stage``, ``a[0].b``) of every repeated key under ``value``."""
        out: list[str] = []
        if isinstance(value, dict):
            for key in self.found.get(id(value), (None, []))[1]:
                out.append(f"{where}.{key}" if where else key)
            for key, item in value.items():
                out += self.paths(item, f"{where}.{key}" if where else key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                out += self.paths(item, f"{where}[{i}]")
        return out


def read_json(path: str) -> Any:
    """The JSON document at ``path``; a ``ConfigError`` names the file when it is missing or not valid JSON, and
    every key that an object repeats (plain JSON readers keep the last value silently), at any depth."""
    duplicates = _DuplicateKeys()
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f, object_pairs_hook=duplicates)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
    repeated = duplicates.paths(document)
    if repeated:
        raise ConfigError(f"config file {path!r} repeats the key{'s' if len(repeated) > 1 else ''} "
                          f"{', '.join(repeated)} in one object; JSON readers keep only the last value, so remove "
                          "the others")
    return document


def _plain(value: Any) -> Any:
    """A tuple as a list (JSON's arrays), e.g. ``zeropp.rules``."""
    return list(value) if isinstance(value, tuple) else value


def to_dict(config: Config) -> dict[str, Any]:
    """A parsed config back as a DeepSpeed-style dict holding every field (``Config.parse`` of it at the same world
    size gives ``config`` again); used to re-derive batch sizes for another world size."""
    z = config.zero_optimization
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "gradient_clipping": config.gradient_clipping,
        "bf16": {"enabled": config.bf16.enabled},
        "fp16": {f.name: getattr(config.fp16, f.name) for f in fields(config.fp16)},
        "zero_optimization": asdict(z, dict_factory=lambda items: {k: _plain(v) for k, v in items}),
        "communication_data_type": config.communication_data_type,
        "steps_per_print": config.steps_per_print,
        "wall_clock_breakdown": config.wall_clock_breakdown,
        "aio": asdict(config.aio),
    }
    if config.optimizer is not None:
        out["optimizer"] = {"type": config.optimizer.type,
                            "params": {k: _plain(v) for k, v in config.optimizer.params.items()}}
    if config.scheduler is not None:
        out["scheduler"] = {"type": config.scheduler.type,
                            "params": {k: _plain(v) for k, v in config.scheduler.params.items()}}
    return out
