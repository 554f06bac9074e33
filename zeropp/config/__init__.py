"""DeepSpeed-compatible training configuration, parsed and validated once, at ``zeropp.initialize``.

``load_config(config, world_size)`` takes a dict or the path of a JSON file and returns a frozen ``Config``. Keys
are spelled as DeepSpeed spells them, with DeepSpeed's meanings and defaults, plus zeropp's own block
``zero_optimization.zeropp``: a DeepSpeed config runs unchanged, and a config is checked before anything is built.
Errors (``ConfigError``, a ``ValueError``) are raised here, never mid-run, and list every problem of the config at
once, one line each naming the key and what to change.

Every key, its default and its meaning: the configuration page of the docs (docs/configuration.md); the engine's
side: docs/engine.md and docs/offload.md.

One file per responsibility: ``errors`` (``ConfigError``, the problem collector), ``readers`` (reading one value
or block), ``blocks`` (``bf16``, ``fp16``, ``zero_optimization``), ``offload`` (``offload_optimizer``,
``offload_param``, ``aio``, ``memory_budget``), ``optimizer``, ``scheduler``, ``batch`` (the batch-size arithmetic),
``training`` (``Config``, the top-level keys), ``load`` (``load_config``, ``to_dict``), ``arguments``
(``add_config_arguments``).
"""

from .blocks import (
    NONFINITE_GRADIENTS,
    BF16Config,
    FP16Config,
    Rule,
    ZeroConfig,
    ZeroppConfig,
)
from .errors import ConfigError, Problems
from .load import load_config, to_dict
from .offload import (
    MEMORY_TIERS,
    OFFLOAD_DEVICES,
    AioConfig,
    MemoryBudget,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from .optimizer import OptimizerConfig
from .scheduler import SCHEDULER_TYPES, SchedulerConfig
from .training import COMMUNICATION_DTYPES, Config

__all__ = [
    "COMMUNICATION_DTYPES",
    "MEMORY_TIERS",
    "NONFINITE_GRADIENTS",
    "OFFLOAD_DEVICES",
    "SCHEDULER_TYPES",
    "AioConfig",
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "MemoryBudget",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "Problems",
    "Rule",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroppConfig",
    "load_config",
    "to_dict",
]
