"""``load_config``: a dict, a JSON file or a parsed ``Config`` -> a validated ``Config`` for a world size."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import fields
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
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
    return Config.parse(config, world_size)


def _plain(value: Any) -> Any:
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
        "zero_optimization": {
            **{f.name: getattr(z, f.name) for f in fields(z) if f.name != "zeropp"},
            "zeropp": {f.name: getattr(z.zeropp, f.name) for f in fields(z.zeropp)},
        },
        "communication_data_type": config.communication_data_type,
        "steps_per_print": config.steps_per_print,
        "wall_clock_breakdown": config.wall_clock_breakdown,
    }
    if config.optimizer is not None:
        out["optimizer"] = {"type": config.optimizer.type,
                            "params": {k: _plain(v) for k, v in config.optimizer.params.items()}}
    if config.scheduler is not None:
        out["scheduler"] = {"type": config.scheduler.type,
                            "params": {k: _plain(v) for k, v in config.scheduler.params.items()}}
    return out
