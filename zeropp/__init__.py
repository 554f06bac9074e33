"""zeropp: ZeRO++ communication kernels and collectives (qwZ, hpZ, qgZ) for ZeRO-3 training on slow networks.

DeepSpeed's module-level API, so that ``import zeropp as deepspeed`` scripts run: ``initialize``, ``Init``,
``init_distributed``, ``add_config_arguments`` and the ``zero`` namespace (``zero.Init``,
``zero.GatheredParameters``), each imported on first use so ``import zeropp`` stays light.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "initialize": "engine",
    "Init": "engine",
    "init_distributed": "comm.process_group",
    "add_config_arguments": "config.arguments",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name == "zero":
        return importlib.import_module(".zero", __name__)
    raise AttributeError(f"module 'zeropp' has no attribute {name!r}")
