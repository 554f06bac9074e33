"""``Config``: the whole training configuration, its top-level keys and the checks between blocks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .batch import batch_sizes
from .blocks import BF16Config, FP16Config, ZeroConfig
from .errors import Problems
from .offload import AioConfig
from .optimizer import OptimizerConfig
from .readers import (
    as_bool,
    as_float,
    check_disabled,
    check_fixed,
    check_keys,
    get_block,
    get_int,
    is_auto,
)
from .scheduler import SchedulerConfig

# DeepSpeed keys we know but do not implement: key -> why / what instead
_UNSUPPORTED = {
    "activation_checkpointing": "DeepSpeed's activation checkpointing API is not supported; use "
    "torch.utils.checkpoint in the model",
    "checkpoint": "checkpoint options are not supported (checkpoints are DCP directories, loadable at any world "
    "size)",
    "data_types": "the gradient accumulation dtype is always fp32",
    "pipeline": "pipeline parallelism is not supported",
    "compression_training": "compression training is not supported",
    "sparse_attention": "sparse attention is not supported",
}

# DeepSpeed keys that describe what zeropp always does: accepted with that value only
_FIXED = {
    "prescale_gradients": (False, "gradients are averaged exactly once, in the reduce-scatter"),
    "gradient_predivide_factor": (1.0, "gradients are averaged exactly once, in the reduce-scatter"),
    "memory_breakdown": (False, "zeropp does not print memory"),
    "dump_state": (False, "zeropp does not dump its state"),
    "sparse_gradients": (False, "sparse gradients are not supported"),
    "fp32_allreduce": (False, "for an fp32 gradient reduction set communication_data_type to \"fp32\""),
}

# DeepSpeed feature blocks zeropp does not have: accepted while disabled
_DISABLED = {
    "amp": "Apex AMP is not supported; use bf16 or fp16",
    "torch_autocast": "autocast is not supported; use bf16 or fp16",
    "flops_profiler": "the flops profiler is not supported",
    "tensorboard": "monitoring back-ends are not supported (steps_per_print prints to stdout)",
    "wandb": "monitoring back-ends are not supported (steps_per_print prints to stdout)",
    "csv_monitor": "monitoring back-ends are not supported (steps_per_print prints to stdout)",
    "comms_logger": "the communication logger is not supported; use zeropp.comm.stats() for communication volume",
    "hybrid_engine": "DeepSpeed-Chat's hybrid engine is not supported",
    "elasticity": "elastic training is not supported",
    "autotuning": "autotuning is not supported",
    "data_efficiency": "data efficiency pipelines are not supported",
    "curriculum_learning": "curriculum learning is not supported",
}

# accepted, no effect: only the config's AdamW/Adam/SGD exist, so there is no untested optimizer to allow
_NO_EFFECT = ["zero_allow_untested_optimizer"]

# DeepSpeed's spellings of the gradient reduction dtype -> ours
COMMUNICATION_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
                        "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Config:
    """The whole validated configuration. Batch sizes are all filled in and consistent with ``world_size``.

    ``communication_data_type`` is ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``None`` (DeepSpeed's default: the
    compute dtype); ``scheduler`` is ``None`` without a ``scheduler`` block (the meaning of every field: the
    ``zeropp.config`` docstring)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int = 1
    gradient_clipping: float = 0.0
    bf16: BF16Config = field(default_factory=BF16Config)
    fp16: FP16Config = field(default_factory=FP16Config)
    optimizer: OptimizerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    scheduler: SchedulerConfig | None = None
    communication_data_type: str | None = None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    aio: AioConfig = field(default_factory=AioConfig)

    @property
    def zero(self) -> ZeroConfig:
        """Short for ``zero_optimization``."""
        return self.zero_optimization

    @classmethod
    def parse(cls, config: Mapping[str, Any], world_size: int = 1) -> Config:
        """Validate ``config`` (a DeepSpeed-style dict) for ``world_size`` ranks. Raises one ``ConfigError`` listing
        every problem found."""
        p = Problems()
        if not isinstance(config, Mapping):
            p.add("", f"the config must be a dict or the path of a JSON file, got {type(config).__name__}")
            p.raise_if_any()
        valid = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "gradient_clipping", "bf16", "bfloat16", "fp16", "optimizer", "scheduler", "zero_optimization",
                 "communication_data_type", "steps_per_print", "wall_clock_breakdown", "aio",
                 *_FIXED, *_DISABLED, *_NO_EFFECT]
        check_keys(p, config, "", valid, _UNSUPPORTED)
        check_fixed(p, config, "", _FIXED)
        check_disabled(p, config, _DISABLED)
        for key in _NO_EFFECT:
            if key in config:
                as_bool(p, config[key], key)
        batch, micro, accum = batch_sizes(p, config, world_size)
        zero = ZeroConfig.parse(get_block(p, config, "zero_optimization"), p, world_size)
        bf16_key = "bf16"
        if "bfloat16" in config:  # DeepSpeed's older name of the bf16 block
            if "bf16" in config:
                p.add("bfloat16", "bfloat16 and bf16 are two names of one block; give only bf16")
            else:
                bf16_key = "bfloat16"
        bf16 = BF16Config.parse(get_block(p, config, bf16_key), p, bf16_key,
                                zero.stage if p.ok("zero_optimization.stage") else None)
        fp16 = FP16Config.parse(get_block(p, config, "fp16"), p)
        if bf16.enabled and fp16.enabled:
            p.add("fp16.enabled", f"{bf16_key}.enabled and fp16.enabled are both true; enable at most one")
        optimizer = None
        if config.get("optimizer") is not None:
            optimizer = OptimizerConfig.parse(get_block(p, config, "optimizer"), p)
        scheduler = None
        if config.get("scheduler") is not None:
            scheduler = SchedulerConfig.parse(get_block(p, config, "scheduler"), p)
        out = cls(
            train_batch_size=batch,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accum,
            world_size=world_size,
            gradient_clipping=as_float(p, config.get("gradient_clipping", 0.0), "gradient_clipping", minimum=0.0),
            bf16=bf16,
            fp16=fp16,
            optimizer=optimizer,
            zero_optimization=zero,
            scheduler=scheduler,
            communication_data_type=_communication_dtype(p, config.get("communication_data_type")),
            steps_per_print=get_int(p, config, "steps_per_print", "", 10, minimum=1),
            wall_clock_breakdown=as_bool(p, config.get("wall_clock_breakdown", False), "wall_clock_breakdown"),
            aio=AioConfig.parse(get_block(p, config, "aio"), p),
        )
        if optimizer is not None and optimizer.type == "OneBitAdam":
            _onebit_consistency(p, out)
        p.raise_if_any()
        return out


def _onebit_consistency(p: Problems, config: Config) -> None:
    """OneBitAdam's limits (``zeropp.engine.onebit``): after ``freeze_step`` no rank ever holds the averaged
    gradient, so nothing can clip by its norm; fp16 loss scaling and the offload tiers are not wired to its
    full-size per-rank buffers."""
    why = "with optimizer.type=\"OneBitAdam\""
    if config.gradient_clipping > 0:
        p.add("gradient_clipping", f"gradient_clipping={config.gradient_clipping} {why} is not supported: after "
                                   "freeze_step the averaged gradient is never formed, so there is no global norm to "
                                   "clip by; set it to 0 (or use AdamW)")
    if config.fp16.enabled:
        p.add("fp16.enabled", f"fp16.enabled=true {why} is not supported (its loss scaling is not applied to the "
                              "1-bit phase's local gradients); use bf16 or fp32")
    zero = config.zero_optimization
    if zero.offload_optimizer.enabled or zero.offload_param.enabled or zero.zeropp.memory_budget is not None:
        p.add("zero_optimization.offload_optimizer", f"offload_optimizer, offload_param and memory_budget {why} are "
                                                     "not supported (its local momentum and error buffers stay on "
                                                     "the device); remove them")


def _communication_dtype(p: Problems, value: Any) -> str | None:
    """``communication_data_type``: ``None`` (absent or null: the compute dtype, as DeepSpeed), else one of
    ``"fp32"``, ``"fp16"``, ``"bf16"`` from any of DeepSpeed's spellings (``COMMUNICATION_DTYPES``)."""
    name = "communication_data_type"
    if value is None or is_auto(p, value, name):
        return None
    if isinstance(value, str) and value.lower() in COMMUNICATION_DTYPES:
        return COMMUNICATION_DTYPES[value.lower()]
    p.add(name, f"{name}={value!r} must be \"fp32\", \"fp16\" or \"bf16\" (or null: the compute dtype)")
    return None
