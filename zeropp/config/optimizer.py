"""The ``optimizer`` block: AdamW, Adam or SGD with torch.optim's parameter names and defaults; OneBitAdam with
DeepSpeed's (``zeropp.engine.onebit``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import Problems
from .readers import as_bool, as_float, check_keys, get_block, is_auto

_OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    # DeepSpeed's OnebitAdam defaults (deepspeed/runtime/fp16/onebit/adam.py)
    "onebitadam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "freeze_step": 100000},
}
_OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "onebitadam": "OneBitAdam"}
_UNSUPPORTED_OPTIMIZERS = {"lamb", "lion", "adagrad", "muadam", "muadamw", "musgd"}
# DeepSpeed's other 1-bit optimizers: what their sharded form would need that zeropp's OneBitAdam does not have
_ONEBIT_MISSING = {
    "zerooneadam": "ZeroOneAdam's variance refresh policy (var_freeze_step, var_update_scaler) and its local steps "
                   "without communication (local_step_scaler, local_step_clipper) are not implemented",
    "onebitlamb": "OneBitLamb's per-parameter trust ratio needs each whole parameter's update norm and its "
                  "compressed-phase scaling coefficients (max_coeff, min_coeff, factor_*), which are not implemented",
}
# OneBitAdam: DeepSpeed's communication-backend switches; zeropp communicates over the engine's process group
_ONEBIT_NO_EFFECT = {"cuda_aware": "bool", "comm_backend_name": "str"}
_UNSUPPORTED_OPT_PARAMS = {
    "amsgrad": "AMSGrad is not supported",
    "maximize": "maximize is not supported",
    "capturable": "CUDA-graph capture of the optimizer is not supported",
    "differentiable": "a differentiable optimizer step is not supported",
}
# implementation switches of DeepSpeed's and torch's optimizers: the arithmetic is torch.optim's either way, so any
# boolean is accepted and changes nothing
_NO_EFFECT_OPT_PARAMS = ["torch_adam", "fused", "foreach"]
_BIAS_CORRECTION = "bias_correction"  # always on (torch.optim's Adam): true accepted


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` is ``"AdamW"``, ``"Adam"``, ``"SGD"`` or ``"OneBitAdam"``; ``params`` has every
    hyperparameter filled in (defaults of torch.optim, DeepSpeed's ``adam_w_mode=True`` for Adam, DeepSpeed's
    OnebitAdam defaults with ``freeze_step`` for OneBitAdam; its ``cuda_aware`` and ``comm_backend_name`` are
    checked and dropped)."""

    type: str = "AdamW"
    params: Mapping[str, Any] = field(default_factory=lambda: dict(_OPTIMIZER_PARAMS["adamw"]))

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems) -> OptimizerConfig | None:
        """The parsed block, or ``None`` when its type is unusable (recorded in ``p``)."""
        check_keys(p, block, "optimizer", ["type", "params"])
        kind = block.get("type")
        names = sorted(_OPTIMIZER_NAMES.values())
        if is_auto(p, kind, "optimizer.type"):
            return None
        if not isinstance(kind, str):
            p.add("optimizer.type", f"optimizer.type={kind!r} must be one of {names}")
            return None
        key = kind.lower()
        if key not in _OPTIMIZER_PARAMS:
            if key in _ONEBIT_MISSING:
                p.add("optimizer.type", f"optimizer.type={kind!r} is not supported: {_ONEBIT_MISSING[key]}; use "
                                        "\"OneBitAdam\" (1-bit momentum communication after freeze_step) or "
                                        "\"AdamW\"")
            elif key in _UNSUPPORTED_OPTIMIZERS:
                p.add("optimizer.type", f"optimizer.type={kind!r} is a DeepSpeed optimizer that zeropp does not "
                                        f"support; use one of {names}")
            else:
                p.add("optimizer.type", f"unknown optimizer.type={kind!r}; use one of {names}")
            return None
        given = get_block(p, block, "params", "optimizer")
        defaults = _OPTIMIZER_PARAMS[key]
        onebit = key == "onebitadam"
        extra = [*_ONEBIT_NO_EFFECT, "eps_inside_sqrt", "max_grad_norm"] if onebit else _NO_EFFECT_OPT_PARAMS
        check_keys(p, given, "optimizer.params", [*defaults, *extra, _BIAS_CORRECTION], _UNSUPPORTED_OPT_PARAMS)
        params: dict[str, Any] = dict(defaults)
        for name, value in given.items():
            where = f"optimizer.params.{name}"
            if name not in defaults:
                if name in _NO_EFFECT_OPT_PARAMS or (onebit and _ONEBIT_NO_EFFECT.get(name) == "bool"):
                    as_bool(p, value, where)
                elif onebit and _ONEBIT_NO_EFFECT.get(name) == "str" and not isinstance(value, str):
                    p.add(where, f"{where}={value!r} must be a string (it has no effect: zeropp communicates over "
                                 "the engine's process group)")
                elif onebit and name == "eps_inside_sqrt" and value is not False:
                    p.add(where, f"{where}={value!r} is not supported: eps is added outside the square root (as "
                                 "torch.optim); remove the key or set it to false")
                elif onebit and name == "max_grad_norm" and value not in (0, 0.0):
                    p.add(where, f"{where}={value!r} is not supported (DeepSpeed's OnebitAdam ignores it too); "
                                 "remove the key or set it to 0")
                elif name == _BIAS_CORRECTION and not is_auto(p, value, where) and value is not True:
                    p.add(where, f"{where}={value!r} is not supported: bias correction is always on (as "
                                 "torch.optim); remove the key or set it to true")
                continue
            if is_auto(p, value, where):
                continue
            if name == "betas":
                if not isinstance(value, (list, tuple)) or len(value) != 2:
                    p.add(where, f"{where}={value!r} must be a list of two numbers in [0, 1)")
                    continue
                params[name] = tuple(as_float(p, b, where, minimum=0.0, below=1.0, fallback=0.9) for b in value)
            elif name in ("nesterov", "adam_w_mode"):
                params[name] = as_bool(p, value, where, defaults[name])
            elif name == "freeze_step":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    p.add(where, f"{where}={value!r} must be an integer >= 1 (optimizer steps of exact Adam before "
                                 "the 1-bit momentum communication starts)")
                else:
                    params[name] = value
            elif name == "eps":
                params[name] = as_float(p, value, where, minimum=0.0, fallback=defaults[name])
                if params[name] == 0.0:
                    p.add(where, f"{where}=0 would divide by zero; use a small positive value such as 1e-8")
            else:  # lr, weight_decay, dampening, momentum
                params[name] = as_float(p, value, where, minimum=0.0, fallback=defaults[name])
        if key == "sgd" and params["nesterov"] and (params["momentum"] <= 0 or params["dampening"] != 0):
            p.add("optimizer.params.nesterov", "optimizer.params.nesterov=true needs momentum > 0 and dampening = 0 "
                                               "(as torch.optim.SGD)")
        return cls(type=_OPTIMIZER_NAMES[key], params=params)
