"""DeepSpeed-compatible training configuration, parsed and validated once, at ``zeropp.initialize``.

``load_config(config, world_size)`` takes a dict or the path of a JSON file and returns a frozen ``Config``.
Keys are spelled as DeepSpeed spells them::

    {
      "train_batch_size": 32,                     # = micro batch * gradient_accumulation_steps * world size
      "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2,
      "gradient_clipping": 1.0,                   # clip by global norm; 0 (default) = off
      "bf16": {"enabled": false},
      "communication_data_type": null,            # exact gradient reduce-scatter: "fp32", "bf16", "fp16";
                                                  # null = the compute dtype (DeepSpeed's default)
      "fp16": {"enabled": false, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
               "hysteresis": 2, "min_loss_scale": 1},           # loss_scale 0 = dynamic
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                 "weight_decay": 0.01}},
      "zero_optimization": {
        "stage": 3,                               # 1, 2 or 3
        "zero_quantized_weights": false,          # qwZ (stages 1-3: every weight all-gather)
        "zero_quantized_gradients": false,        # qgZ (stages 1-3: every gradient reduce-scatter)
        "zero_hpz_partition_size": 1,             # hpZ, stage 3: ranks holding the secondary shard (1 = off);
                                                  # must divide the ranks per node (checked at initialize)
        "reduce_bucket_size": 500000000,
        "stage3_prefetch_bucket_size": 50000000,
        "overlap_comm": false,
        "stage3_max_live_parameters": 1e9,        # stage 3: most elements kept whole for reuse (zeropp.engine.reuse)
        "stage3_max_reuse_distance": 1e9,         # keep a unit whole when its next use is closer (elements)
        "stage3_param_persistence_threshold": 1e5,  # units smaller than this stay whole all the time
        "stage3_model_persistence_threshold": 9223372036854775807,  # most elements of all such units
        "zeropp": {"weight_bits": 8, "gradient_bits": 4, "block_size": 128, "error_feedback": false}
      }
    }

Batch sizes follow DeepSpeed's rules: any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
``gradient_accumulation_steps`` determine the third; ``train_batch_size`` alone means one accumulation step;
``train_micro_batch_size_per_gpu`` alone means one accumulation step too; all three must agree.

Optimizers (``optimizer.type``, case-insensitive), with torch.optim's parameter names and defaults:

* ``AdamW``: ``lr`` (1e-3), ``betas`` ([0.9, 0.999]), ``eps`` (1e-8), ``weight_decay`` (0.01);
* ``Adam``: the same with ``weight_decay`` 0 and, as in DeepSpeed, ``adam_w_mode`` (default **true**: the weight
  decay is decoupled, i.e. AdamW); ``adam_w_mode: false`` gives torch.optim.Adam's L2 penalty;
* ``SGD``: ``lr`` (1e-3), ``momentum`` (0), ``dampening`` (0), ``weight_decay`` (0), ``nesterov`` (false).

Our own keys live in ``zero_optimization.zeropp`` (all optional):

* ``weight_bits`` (8 or 4, default 8): code width of the qwZ weight all-gather when ``zero_quantized_weights``;
* ``gradient_bits`` (8 or 4, default 4): code width of the qgZ reduce-scatter when ``zero_quantized_gradients``;
* ``block_size`` (a power of two from 16 to 8192, default 128): elements per quantization block;
* ``error_feedback`` (default false): keep each gradient buffer's qgZ quantization residual and add it back at
  the next reduction (``zeropp.comm.ErrorFeedback``); needs ``zero_quantized_gradients``.

Errors (``ConfigError``, a ``ValueError``) are raised here, never mid-run. An unknown key names the key, its
place, the closest valid spelling and the valid keys at that level. A DeepSpeed key that zeropp does not
implement (``offload_optimizer``, ``scheduler``, ...) says so. A few DeepSpeed keys describe what zeropp always
does (``contiguous_gradients``, ``allgather_partitions``, ``reduce_scatter``): they are accepted when set to
that behaviour (``true``) and rejected otherwise.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "OptimizerConfig",
    "ZeroConfig",
    "ZeroppConfig",
    "load_config",
]


class ConfigError(ValueError):
    """A bad training configuration; the message names the key and what to do."""


# ---- DeepSpeed keys we know but do not implement: key -> why / what instead --------------------------------

_UNSUPPORTED_TOP = {
    "scheduler": "learning-rate schedulers are not built in; set optimizer.param_groups[i]['lr'] yourself",
    "amp": "Apex AMP is not supported; use bf16 or fp16",
    "zero_allow_untested_optimizer": "only the config's AdamW, Adam and SGD are supported",
    "activation_checkpointing": "DeepSpeed's activation checkpointing API is not supported; use "
    "torch.utils.checkpoint in the model",
    "flops_profiler": "the flops profiler is not supported",
    "tensorboard": "monitoring back-ends are not supported",
    "wandb": "monitoring back-ends are not supported",
    "csv_monitor": "monitoring back-ends are not supported",
    "comms_logger": "use zeropp.comm.stats() for communication volume",
    "prescale_gradients": "gradients are averaged exactly once, in the reduce-scatter",
    "gradient_predivide_factor": "gradients are averaged exactly once, in the reduce-scatter",
    "sparse_gradients": "sparse gradients are not supported",
    "fp32_allreduce": "the reduction dtype is fixed (fp32 gradients, or qgZ)",
    "data_types": "the gradient accumulation dtype is always fp32",
    "pipeline": "pipeline parallelism is not supported",
    "elasticity": "elastic training is not supported",
    "autotuning": "autotuning is not supported",
    "compression_training": "compression training is not supported",
    "data_efficiency": "data efficiency pipelines are not supported",
    "curriculum_learning": "curriculum learning is not supported",
    "sparse_attention": "sparse attention is not supported",
    "checkpoint": "checkpoint options are not supported",
    "steps_per_print": "zeropp does not print progress",
    "wall_clock_breakdown": "zeropp does not print timings",
    "memory_breakdown": "zeropp does not print memory",
    "dump_state": "zeropp does not dump its state",
    "torch_autocast": "autocast is not supported; use bf16 or fp16",
}

_UNSUPPORTED_ZERO = {
    "offload_optimizer": "CPU/NVMe offload is not supported",
    "offload_param": "CPU/NVMe offload is not supported",
    "cpu_offload": "CPU offload is not supported",
    "cpu_offload_params": "CPU offload is not supported",
    "cpu_offload_use_pin_memory": "CPU offload is not supported",
    "sub_group_size": "the optimizer steps over each unit's shard; there are no sub-groups",
    "elastic_checkpoint": "elastic checkpoints are not supported",
    "load_from_fp32_weights": "checkpoints always hold the fp32 master weights",
    "round_robin_gradients": "gradient partitions follow the reduce-scatter layout",
    "legacy_stage1": "only the current stage 1 exists",
    "ignore_unused_parameters": "unused parameters are always allowed (their gradient is zero)",
    "stage3_gather_16bit_weights_on_model_save": "checkpoints are saved sharded",
    "stage3_gather_fp16_weights_on_model_save": "checkpoints are saved sharded",
    "zero_quantized_nontrainable_weights": "frozen parameters are not quantized",
    "mics_shard_size": "MiCS is not supported",
    "mics_hierarchical_params_gather": "MiCS is not supported",
    "memory_efficient_linear": "not supported",
    "pipeline_loading_checkpoint": "not supported",
    "override_module_apply": "not supported",
    "use_all_reduce_for_fetch_params": "parameters are always fetched by all-gather",
    "log_trace_cache_warnings": "not supported",
}

# DeepSpeed keys that describe what zeropp always does: accepted only with that value.
_IMPLIED_ZERO = {
    "contiguous_gradients": (True, "gradients always live in one flat fp32 shard per unit"),
    "allgather_partitions": (True, "parameters are always gathered with all-gather"),
    "reduce_scatter": (True, "gradients are always averaged with reduce-scatter"),
}

_UNSUPPORTED_FP16 = {
    "auto_cast": "inputs are not cast; the model runs in the compute dtype",
    "consecutive_hysteresis": "not supported",
    "fp16_master_weights_and_grads": "master weights and gradients are always fp32",
}


# ---- small readers --------------------------------------------------------------------------------------------


def _check_keys(block: Mapping[str, Any], where: str, valid: list[str], unsupported: Mapping[str, str] = {}) -> None:
    for key in block:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {key!r}")
        if key in valid:
            continue
        name = f"{where}.{key}" if where else key
        if key in unsupported:
            raise ConfigError(f"{name} is a DeepSpeed option that zeropp does not support: {unsupported[key]}")
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown config key {name!r}; {hint}valid keys{' in ' + where if where else ''}: "
                          f"{', '.join(sorted(valid))}")


def _reject_auto(value: Any, name: str) -> None:
    if value == "auto":
        raise ConfigError(f"{name}='auto' is filled in by the Hugging Face Trainer; give a value")


def _bool(block: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = block.get(key, default)
    _reject_auto(value, f"{where}.{key}")
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}={value!r} must be true or false")
    return value


def _int(value: Any, name: str, *, minimum: int | None = None, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    _reject_auto(value, name)
    # JSON writers often spell large sizes as 5e8: accept floats with an integer value.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def _float(value: Any, name: str, *, minimum: float | None = None, below: float | None = None) -> float:
    _reject_auto(value, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} must be a finite number")
    value = float(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    if below is not None and value >= below:
        raise ConfigError(f"{name}={value} must be < {below}")
    return value


def _block(config: Mapping[str, Any], key: str, where: str = "") -> Mapping[str, Any]:
    value = config.get(key, {})
    name = f"{where}.{key}" if where else key
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be an object (a dict), got {type(value).__name__}")
    return value


# ---- the blocks -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BF16Config:
    """``bf16``: compute in bfloat16 with fp32 master weights, optimizer state and gradient shards."""

    enabled: bool = False

    @classmethod
    def parse(cls, block: Mapping[str, Any]) -> BF16Config:
        _check_keys(block, "bf16", ["enabled"], {"immediate_grad_update": "not supported"})
        return cls(enabled=_bool(block, "enabled", "bf16", False))


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: compute in float16 with loss scaling; ``loss_scale`` 0 means dynamic (DeepSpeed's default)."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0.0

    @classmethod
    def parse(cls, block: Mapping[str, Any]) -> FP16Config:
        valid = ["enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"]
        _check_keys(block, "fp16", valid, _UNSUPPORTED_FP16)
        d = cls()
        return cls(
            enabled=_bool(block, "enabled", "fp16", False),
            loss_scale=_float(block.get("loss_scale", d.loss_scale), "fp16.loss_scale", minimum=0.0),
            initial_scale_power=_int(block.get("initial_scale_power", d.initial_scale_power),
                                     "fp16.initial_scale_power", minimum=0),
            loss_scale_window=_int(block.get("loss_scale_window", d.loss_scale_window), "fp16.loss_scale_window",
                                   minimum=1),
            hysteresis=_int(block.get("hysteresis", d.hysteresis), "fp16.hysteresis", minimum=1),
            min_loss_scale=_float(block.get("min_loss_scale", d.min_loss_scale), "fp16.min_loss_scale",
                                  minimum=0.0),
        )


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
    "foreach": "implementation switches do not apply",
    "fused": "implementation switches do not apply",
    "torch_adam": "implementation switches do not apply",
    "bias_correction": "bias correction is always on, as in torch.optim",
    "capturable": "implementation switches do not apply",
    "differentiable": "implementation switches do not apply",
}


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` is ``"AdamW"``, ``"Adam"`` or ``"SGD"``; ``params`` has every hyperparameter filled
    in (defaults of torch.optim, and DeepSpeed's ``adam_w_mode=True`` for Adam)."""

    type: str = "AdamW"
    params: Mapping[str, Any] = field(default_factory=lambda: dict(_OPTIMIZER_PARAMS["adamw"]))

    @classmethod
    def parse(cls, block: Mapping[str, Any]) -> OptimizerConfig:
        _check_keys(block, "optimizer", ["type", "params"])
        kind = block.get("type")
        if not isinstance(kind, str):
            raise ConfigError(f"optimizer.type={kind!r} must be one of {sorted(_OPTIMIZER_NAMES.values())}")
        key = kind.lower()
        if key not in _OPTIMIZER_PARAMS:
            if key in _UNSUPPORTED_OPTIMIZERS:
                raise ConfigError(f"optimizer.type={kind!r} is a DeepSpeed optimizer that zeropp does not support; "
                                  f"use one of {sorted(_OPTIMIZER_NAMES.values())}")
            raise ConfigError(f"unknown optimizer.type={kind!r}; use one of {sorted(_OPTIMIZER_NAMES.values())}")
        given = _block(block, "params", "optimizer")
        defaults = _OPTIMIZER_PARAMS[key]
        _check_keys(given, "optimizer.params", list(defaults), _UNSUPPORTED_OPT_PARAMS)
        params: dict[str, Any] = dict(defaults)
        for name, value in given.items():
            where = f"optimizer.params.{name}"
            if name == "betas":
                if (not isinstance(value, (list, tuple)) or len(value) != 2):
                    raise ConfigError(f"{where}={value!r} must be a list of two numbers in [0, 1)")
                params[name] = tuple(_float(b, where, minimum=0.0, below=1.0) for b in value)
            elif name in ("nesterov", "adam_w_mode"):
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}={value!r} must be true or false")
                params[name] = value
            elif name == "eps":
                params[name] = _float(value, where, minimum=0.0)
                if params[name] == 0.0:
                    raise ConfigError(f"{where}=0 would divide by zero; use a small positive value such as 1e-8")
            elif name == "momentum":
                params[name] = _float(value, where, minimum=0.0)
            else:  # lr, weight_decay, dampening
                params[name] = _float(value, where, minimum=0.0)
        if key == "sgd" and params["nesterov"] and (params["momentum"] <= 0 or params["dampening"] != 0):
            raise ConfigError("optimizer.params.nesterov=true needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
        return cls(type=_OPTIMIZER_NAMES[key], params=params)


_POW2_BLOCKS = [2**k for k in range(4, 14)]


@dataclass(frozen=True)
class ZeroppConfig:
    """``zero_optimization.zeropp``: our own ZeRO++ settings (see the module docstring)."""

    weight_bits: int = 8
    gradient_bits: int = 4
    block_size: int = 128
    error_feedback: bool = False

    @classmethod
    def parse(cls, block: Mapping[str, Any]) -> ZeroppConfig:
        where = "zero_optimization.zeropp"
        _check_keys(block, where, ["weight_bits", "gradient_bits", "block_size", "error_feedback"])
        d = cls()
        values: dict[str, Any] = {}
        for key in ("weight_bits", "gradient_bits"):
            bits = _int(block.get(key, getattr(d, key)), f"{where}.{key}")
            if bits not in (4, 8):
                raise ConfigError(f"{where}.{key}={bits} must be 8 or 4")
            values[key] = bits
        size = _int(block.get("block_size", d.block_size), f"{where}.block_size")
        if size not in _POW2_BLOCKS:
            raise ConfigError(f"{where}.block_size={size} must be a power of two from 16 to 8192")
        values["block_size"] = size
        values["error_feedback"] = _bool(block, "error_feedback", where, False)
        return cls(**values)


_STAGE3_SIZES = ("stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
                 "stage3_model_persistence_threshold")


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: the ZeRO stage, the ZeRO++ switches and the bucket sizes."""

    stage: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1
    reduce_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    overlap_comm: bool = False  # parse(): DeepSpeed's default, true for stage 3
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_model_persistence_threshold: int = sys.maxsize
    zeropp: ZeroppConfig = field(default_factory=ZeroppConfig)

    @property
    def weight_bits(self) -> int | None:
        """Bits of the weight all-gather: ``zeropp.weight_bits`` with qwZ on, else ``None`` (exact)."""
        return self.zeropp.weight_bits if self.zero_quantized_weights else None

    @property
    def gradient_bits(self) -> int | None:
        """Bits of the gradient reduce-scatter: ``zeropp.gradient_bits`` with qgZ on, else ``None`` (exact)."""
        return self.zeropp.gradient_bits if self.zero_quantized_gradients else None

    @property
    def hpz(self) -> bool:
        return self.zero_hpz_partition_size > 1

    @classmethod
    def parse(cls, block: Mapping[str, Any]) -> ZeroConfig:
        where = "zero_optimization"
        valid = ["stage", "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size",
                 "reduce_bucket_size", "stage3_prefetch_bucket_size", "overlap_comm", "zeropp", *_STAGE3_SIZES,
                 *_IMPLIED_ZERO]
        _check_keys(block, where, valid, _UNSUPPORTED_ZERO)
        for key, (value, why) in _IMPLIED_ZERO.items():
            if key in block and block[key] != value:
                raise ConfigError(f"{where}.{key}={block[key]!r} is not supported: {why} (remove the key or set "
                                  f"it to {json.dumps(value)})")
        d = cls()
        stage = _int(block.get("stage", d.stage), f"{where}.stage")
        if stage == 0:
            raise ConfigError(f"{where}.stage=0 (plain data parallelism) is not supported; use stage 1, 2 or 3")
        if stage not in (1, 2, 3):
            raise ConfigError(f"{where}.stage={stage} must be 1, 2 or 3")
        qw = _bool(block, "zero_quantized_weights", where, False)
        qg = _bool(block, "zero_quantized_gradients", where, False)
        hpz = _int(block.get("zero_hpz_partition_size", 1), f"{where}.zero_hpz_partition_size", minimum=1)
        if hpz > 1 and stage != 3:
            raise ConfigError(f"{where}.zero_hpz_partition_size={hpz} applies to the stage-3 backward weight "
                              "all-gather; set stage to 3 (or the size to 1)")
        zeropp = ZeroppConfig.parse(_block(block, "zeropp", where))
        if zeropp.error_feedback and not qg:
            raise ConfigError(f"{where}.zeropp.error_feedback=true needs {where}.zero_quantized_gradients=true")
        return cls(
            stage=stage,
            zero_quantized_weights=qw,
            zero_quantized_gradients=qg,
            zero_hpz_partition_size=hpz,
            reduce_bucket_size=_int(block.get("reduce_bucket_size", d.reduce_bucket_size),
                                    f"{where}.reduce_bucket_size", minimum=1),
            stage3_prefetch_bucket_size=_int(block.get("stage3_prefetch_bucket_size", d.stage3_prefetch_bucket_size),
                                             f"{where}.stage3_prefetch_bucket_size", minimum=0),
            overlap_comm=_bool(block, "overlap_comm", where, stage == 3),
            zeropp=zeropp,
            **{key: _int(block.get(key, getattr(d, key)), f"{where}.{key}", minimum=0) for key in _STAGE3_SIZES},
        )


@dataclass(frozen=True)
class Config:
    """The whole validated configuration. Batch sizes are all filled in and consistent with ``world_size``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int = 1
    gradient_clipping: float = 0.0
    bf16: BF16Config = field(default_factory=BF16Config)
    fp16: FP16Config = field(default_factory=FP16Config)
    optimizer: OptimizerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    communication_data_type: str | None = None

    @property
    def zero(self) -> ZeroConfig:
        """Short for ``zero_optimization``."""
        return self.zero_optimization

    @classmethod
    def parse(cls, config: Mapping[str, Any], world_size: int = 1) -> Config:
        if not isinstance(config, Mapping):
            raise ConfigError(f"the config must be a dict or the path of a JSON file, got {type(config).__name__}")
        valid = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "gradient_clipping", "bf16", "fp16", "optimizer", "zero_optimization", "communication_data_type"]
        _check_keys(config, "", valid, _UNSUPPORTED_TOP)
        batch, micro, accum = _batch_sizes(config, world_size)
        bf16 = BF16Config.parse(_block(config, "bf16"))
        fp16 = FP16Config.parse(_block(config, "fp16"))
        if bf16.enabled and fp16.enabled:
            raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
        opt = config.get("optimizer")
        return cls(
            train_batch_size=batch,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accum,
            world_size=world_size,
            gradient_clipping=_float(config.get("gradient_clipping", 0.0), "gradient_clipping", minimum=0.0),
            bf16=bf16,
            fp16=fp16,
            optimizer=None if opt is None else OptimizerConfig.parse(_block(config, "optimizer")),
            zero_optimization=ZeroConfig.parse(_block(config, "zero_optimization")),
            communication_data_type=_communication_data_type(config.get("communication_data_type")),
        )


_COMMUNICATION_DATA_TYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16",
                              "bf16": "bf16", "bfloat16": "bf16"}


def _communication_data_type(value: Any) -> str | None:
    """``communication_data_type``: ``None`` (the compute dtype) or ``"fp32"``/``"fp16"``/``"bf16"``."""
    if value is None:
        return None
    _reject_auto(value, "communication_data_type")
    key = value.lower() if isinstance(value, str) else value
    if key not in _COMMUNICATION_DATA_TYPES:
        raise ConfigError(f"communication_data_type={value!r} must be one of \"fp32\", \"fp16\", \"bf16\" (or null: "
                          "the compute dtype)")
    return _COMMUNICATION_DATA_TYPES[key]


def _batch_sizes(config: Mapping[str, Any], world: int) -> tuple[int, int, int]:
    """DeepSpeed's batch-size arithmetic: ``train = micro * accumulation * world``, missing values derived."""
    train = _int(config.get("train_batch_size"), "train_batch_size", minimum=1, optional=True)
    micro = _int(config.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu", minimum=1,
                 optional=True)
    accum = _int(config.get("gradient_accumulation_steps"), "gradient_accumulation_steps", minimum=1, optional=True)
    if train is None and micro is None:
        raise ConfigError("give train_batch_size or train_micro_batch_size_per_gpu (or both); "
                          "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                          f"world size ({world})")
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world:
            raise ConfigError(f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} * "
                              f"gradient_accumulation_steps={accum} * world size {world} = {micro * accum * world}")
        return train, micro, accum
    if train is not None and micro is not None:
        if train % (micro * world):
            raise ConfigError(f"train_batch_size={train} is not a multiple of train_micro_batch_size_per_gpu={micro}"
                              f" * world size {world}; gradient_accumulation_steps would not be an integer")
        return train, micro, train // (micro * world)
    if train is not None:
        accum = 1 if accum is None else accum
        if train % (accum * world):
            raise ConfigError(f"train_batch_size={train} is not a multiple of gradient_accumulation_steps={accum} * "
                              f"world size {world}; train_micro_batch_size_per_gpu would not be an integer")
        return train, train // (accum * world), accum
    assert micro is not None
    accum = 1 if accum is None else accum
    return micro * accum * world, micro, accum


def load_config(config: Mapping[str, Any] | str | os.PathLike[str] | Config, world_size: int = 1) -> Config:
    """Parse and validate ``config`` (a dict, the path of a JSON file, or an already parsed ``Config``) for a
    data-parallel world of ``world_size`` ranks. Raises ``ConfigError`` naming the offending key."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be a positive integer")
    if isinstance(config, Config):
        if config.world_size != world_size:
            return Config.parse(_to_dict(config), world_size)
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


def _to_dict(config: Config) -> dict[str, Any]:
    """A parsed config back as a DeepSpeed-style dict (used to re-derive batch sizes for another world size)."""
    z = config.zero_optimization
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "gradient_clipping": config.gradient_clipping,
        "bf16": {"enabled": config.bf16.enabled},
        "communication_data_type": config.communication_data_type,
        "fp16": {k: getattr(config.fp16, k) for k in FP16Config.__dataclass_fields__},
        "zero_optimization": {
            **{k: getattr(z, k) for k in ZeroConfig.__dataclass_fields__ if k != "zeropp"},
            "zeropp": {k: getattr(z.zeropp, k) for k in ZeroppConfig.__dataclass_fields__},
        },
    }
    if config.optimizer is not None:
        params = dict(config.optimizer.params)
        if "betas" in params:
            params["betas"] = list(params["betas"])
        out["optimizer"] = {"type": config.optimizer.type, "params": params}
    return out
