"""The ``optimizer`` block: AdamW, Adam or SGD with torch.optim's parameter names and defaults."""

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
}
_OPTIMIZER_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
_UNSUPPORTED_OPTIMIZERS = {
    "onebitadam", "onebitlamb", "zerooneadam", "lamb", "lion", "adagrad", "muadam", "muadamw", "musgd",
}
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
    """``optimizer``: ``type`` is ``"AdamW"``, ``"Adam"`` or ``"SGD"``; ``params`` has every hyperparameter filled
    in (defaults of torch.optim, and DeepSpeed's ``adam_w_mode=True`` for Adam)."""

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
            if key in _UNSUPPORTED_OPTIMIZERS:
                p.add("optimizer.type", f"optimizer.type={kind!r} is a DeepSpeed optimizer that zeropp does not "
                                        f"support; use one of {names}")
            else:
                p.add("optimizer.type", f"unknown optimizer.type={kind!r}; use one of {names}")
            return None
        given = get_block(p, block, "params", "optimizer")
        defaults = _OPTIMIZER_PARAMS[key]
        check_keys(p, given, "optimizer.params", [*defaults, *_NO_EFFECT_OPT_PARAMS, _BIAS_CORRECTION],
                   _UNSUPPORTED_OPT_PARAMS)
        params: dict[str, Any] = dict(defaults)
        for name, value in given.items():
            where = f"optimizer.params.{name}"
            if name not in defaults:
                if name in _NO_EFFECT_OPT_PARAMS:
                    as_bool(p, value, where)
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
