"""The precision and ZeRO blocks: ``bf16``, ``fp16``, ``zero_optimization`` and its ``zeropp`` sub-block (what each
key means: the ``zeropp.config`` docstring)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import Problems
from .offload import MemoryBudget, OffloadOptimizerConfig, OffloadParamConfig, offload_consistency
from .partition import (
    MICS_OFF,
    PartitionConfig,
    parse_mics,
    parse_partition,
    partition_point,
    partition_problems,
    resident_given,
)
from .readers import (
    as_bool,
    check_fixed,
    check_keys,
    get_block,
    get_bool,
    get_float,
    get_int,
    is_auto,
)


def json_value(value: object) -> str:
    """``value`` as a config file spells it (``true``, ``"loco"``)."""
    return json.dumps(value)


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (DeepSpeed also reads it as ``bfloat16``): compute in bfloat16 with fp32 master weights, optimizer
    state and gradient shards."""

    enabled: bool = False

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems, where: str = "bf16", stage: int | None = None) -> BF16Config:
        check_keys(p, block, where, ["enabled", "immediate_grad_update"])
        if "immediate_grad_update" in block:
            name = f"{where}.immediate_grad_update"
            if as_bool(p, block["immediate_grad_update"], name) and stage == 1:
                p.add(name, f"{name}=true asks for each micro-batch's gradient in fp32 at once; stage 1 accumulates "
                            "micro-batches in the bf16 .grad (as DeepSpeed's ZeRO-1): set it to false, or use stage "
                            "2 or 3 (which always reduce each micro-batch into the fp32 gradient shard)")
        return cls(enabled=get_bool(p, block, "enabled", where, False))


_FP16_FIXED = {
    "auto_cast": (False, "inputs are not cast; the model runs in the compute dtype"),
    "consecutive_hysteresis": (False, "the hysteresis counter is restored only by a scale increase"),
    "fp16_master_weights_and_grads": (False, "master weights and gradients are always fp32"),
}


MAX_SCALE_POWER = 126
"""The largest ``fp16.initial_scale_power``, and ``2**MAX_SCALE_POWER`` the largest static ``fp16.loss_scale``:
the scale and its reciprocal (the unscaling factor) are then both normal float32 numbers, so scaling and unscaling
stay finite and exact. (Any power past ~30 only costs skipped steps while the dynamic scale halves down.)"""


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: compute in float16 with loss scaling; ``loss_scale`` 0 means dynamic (DeepSpeed's default).

    ``initial_scale_power`` is in ``[0, MAX_SCALE_POWER]``, a static ``loss_scale`` in ``[2**-126, 2**126]`` (both
    the scale and its reciprocal normal float32 numbers); with a dynamic scale, ``min_loss_scale`` is at most the
    initial scale ``2**initial_scale_power``.
    """

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
    def parse(cls, block: Mapping[str, Any], p: Problems) -> FP16Config:
        w = "fp16"
        valid = ["enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"]
        check_keys(p, block, w, [*valid, *_FP16_FIXED])
        check_fixed(p, block, w, _FP16_FIXED)
        d = cls()
        loss_scale = get_float(p, block, "loss_scale", w, d.loss_scale, minimum=0.0)
        if p.ok("fp16.loss_scale") and loss_scale and not 2.0**-MAX_SCALE_POWER <= loss_scale <= 2.0**MAX_SCALE_POWER:
            p.add("fp16.loss_scale", f"fp16.loss_scale={loss_scale} must be 0 (dynamic) or between 2**-"
                                     f"{MAX_SCALE_POWER} and 2**{MAX_SCALE_POWER}, where it and its reciprocal are "
                                     "normal float32 numbers")
            loss_scale = d.loss_scale
        power = get_int(p, block, "initial_scale_power", w, d.initial_scale_power, minimum=0)
        if p.ok("fp16.initial_scale_power") and power > MAX_SCALE_POWER:
            p.add("fp16.initial_scale_power", f"fp16.initial_scale_power={power} must be <= {MAX_SCALE_POWER}: the "
                                              f"initial loss scale 2**{power} is past what float32 holds with a "
                                              f"normal reciprocal (DeepSpeed's default is {d.initial_scale_power})")
            power = d.initial_scale_power
        min_loss_scale = get_float(p, block, "min_loss_scale", w, d.min_loss_scale, minimum=0.0)
        if (loss_scale == 0.0 and p.ok("fp16.loss_scale", "fp16.initial_scale_power", "fp16.min_loss_scale")
                and min_loss_scale > 2.0**power):
            p.add("fp16.min_loss_scale", f"fp16.min_loss_scale={min_loss_scale} is above the initial loss scale "
                                         f"2**{power} = {2.0**power:g} (fp16.initial_scale_power); lower it or raise "
                                         "fp16.initial_scale_power")
        return cls(
            enabled=get_bool(p, block, "enabled", w, False),
            loss_scale=loss_scale,
            initial_scale_power=power,
            loss_scale_window=get_int(p, block, "loss_scale_window", w, d.loss_scale_window, minimum=1),
            hysteresis=get_int(p, block, "hysteresis", w, d.hysteresis, minimum=1),
            min_loss_scale=min_loss_scale,
        )


_POW2_BLOCKS = [2**k for k in range(4, 14)]

# zero_optimization.zeropp.nonfinite_gradients: what an fp32/bf16 step does with an Inf/NaN gradient
NONFINITE_GRADIENTS = ("skip", "raise")

# zero_optimization.zeropp.delta_bits: code widths of the weight deltas (zeropp.engine.weight_deltas)
DELTA_BITS = (8, 4)
# zero_optimization.zeropp.delta_refresh_bits: code widths of a quantized refresh (null: exact)
DELTA_REFRESH_BITS = (8,)

# zero_optimization.zeropp.gradient_bits / gradient_bits_intra: qgZ's code widths (weight_bits: 8 or 4)
GRADIENT_BITS = (8, 4, 2)
# zero_optimization.zeropp.gradient_rotation: the rotations qgZ offers, and their block sizes (zeropp.quant.rotation's
# ROTATION_SIZES, kept here so that the config imports without torch; a test pins the two together)
GRADIENT_ROTATIONS = ("hadamard",)
GRADIENT_ROTATION_SIZES = (16, 32, 64, 128)

# zero_optimization.zeropp.error_feedback_beta: the default moving-average coefficient of LoCo's residuals
LOCO_BETA = 0.5

# zero_optimization.zeropp.entry_check_timeout, seconds: the largest value (about 11.6 days; past any torch timeout)
MAX_ENTRY_CHECK_TIMEOUT = 1e6


_RULE_KEYS = ["match", "weight_bits", "gradient_bits"]


@dataclass(frozen=True)
class Rule:
    """One entry of ``zero_optimization.zeropp.rules``, resolved: the parameters whose qualified name ``match``
    finds (``re.search``: anywhere in the name; anchor with ``^``/``$`` for a whole name) get ``weight_bits`` for
    their all-gather and ``gradient_bits`` for their reduce-scatter (``None``: exact). A key the rule leaves out was
    resolved at parse time to the global setting (``zeropp.weight_bits`` when ``zero_quantized_weights``, else
    exact; likewise for gradients)."""

    match: str
    weight_bits: int | None
    gradient_bits: int | None


def parse_rules(value: Any, p: Problems, defaults: tuple[int | None, int | None]) -> tuple[Rule, ...]:
    """``zero_optimization.zeropp.rules``: a list of ``{"match": <regex>, "weight_bits": ..., "gradient_bits":
    ...}``, each resolved to a ``Rule`` (``defaults``: the global ``(weight_bits, gradient_bits)``, ``None`` for
    exact, that a left-out key takes). Bits are ``None`` (exact) or a width ``zeropp.quant.BlockFormat`` accepts."""
    from ..quant.format import SUPPORTED_BITS  # here: the config stays importable without torch unless rules exist

    name = "zero_optimization.zeropp.rules"
    if value is None or is_auto(p, value, name):
        return ()
    if not isinstance(value, (list, tuple)):
        p.add(name, f"{name} must be a list of {{\"match\": <regex>, \"weight_bits\": ..., \"gradient_bits\": ...}}"
                    f" objects, got {type(value).__name__}")
        return ()
    rules = []
    for i, entry in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(entry, Mapping):
            p.add(where, f"{where} must be an object {{\"match\": <regex>, ...}}, got {entry!r}")
            continue
        check_keys(p, entry, where, _RULE_KEYS)
        pattern = entry.get("match")
        if "match" not in entry:
            p.add(f"{where}.match", f"{where} needs \"match\": a regular expression searched for in each parameter's "
                                    "qualified name (re.search)")
            continue
        if not isinstance(pattern, str):
            p.add(f"{where}.match", f"{where}.match must be a regular expression (a string) searched for in each "
                                    f"parameter's qualified name (re.search), got {pattern!r}")
            continue
        try:
            re.compile(pattern)
        except re.error as e:
            p.add(f"{where}.match", f"{where}.match={pattern!r} is not a valid regular expression (re.search): {e}")
            continue
        bits = []
        for key, default in zip(("weight_bits", "gradient_bits"), defaults):
            given = entry.get(key, default)
            if given is not None and (isinstance(given, bool) or given not in SUPPORTED_BITS):
                p.add(f"{where}.{key}", f"{where}.{key}={given!r} must be null (exact) or one of "
                                        f"{', '.join(map(str, SUPPORTED_BITS))} (the widths zeropp.quant supports), "
                                        "or left out for the global setting")
                given = default
            bits.append(given)
        rules.append(Rule(match=pattern, weight_bits=bits[0], gradient_bits=bits[1]))
    return tuple(rules)


@dataclass(frozen=True)
class ZeroppConfig:
    """``zero_optimization.zeropp``: our own ZeRO++ settings (see the ``zeropp.config`` docstring). ``rules``: the
    per-parameter formats (``parse_rules``), resolved against the global switches they were parsed with;
    ``partition``: the sharding factors as given (``zeropp.config.partition``), None: the stage's, ``"auto"``: the
    planner's pick (resolved by ``zeropp.initialize``)."""

    weight_bits: int = 8
    gradient_bits: int = 4
    block_size: int = 128
    error_feedback: bool | str = False
    error_feedback_beta: float = LOCO_BETA
    gradient_bits_intra: int | None = None
    gradient_rotation: str | None = None
    gradient_rotation_size: int = 32
    gradient_stochastic_rounding: bool = False
    nonfinite_gradients: str = "skip"
    entry_check_timeout: float = 300.0
    memory_budget: MemoryBudget | None = None
    weight_deltas: bool = False
    delta_bits: int = 4
    delta_refresh_interval: int = 0
    delta_refresh_bits: int | None = None
    rules: tuple[Rule, ...] = ()
    partition: PartitionConfig | str | None = None

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems, *, quantized_weights: bool = False,
              quantized_gradients: bool = False) -> ZeroppConfig:
        """``quantized_weights`` / ``quantized_gradients``: ``zero_quantized_weights`` / ``_gradients``, the global
        defaults a rule's left-out key takes."""
        w = "zero_optimization.zeropp"
        check_keys(p, block, w, ["weight_bits", "gradient_bits", "gradient_bits_intra", "block_size", "error_feedback",
                                 "error_feedback_beta",
                                 "gradient_rotation", "gradient_rotation_size", "gradient_stochastic_rounding",
                                 "nonfinite_gradients",
                                 "entry_check_timeout", "memory_budget", "weight_deltas", "delta_bits",
                                 "delta_refresh_interval", "delta_refresh_bits", "rules", "partition"])
        d = cls()
        values: dict[str, Any] = {}
        for key, allowed in (("weight_bits", (8, 4)), ("gradient_bits", GRADIENT_BITS)):
            bits = get_int(p, block, key, w, getattr(d, key))
            if bits not in allowed:
                p.add(f"{w}.{key}", f"{w}.{key}={bits} must be {' or '.join(map(str, allowed))}")
                bits = getattr(d, key)
            values[key] = bits
        if block.get("gradient_bits_intra") is not None:
            bits = get_int(p, block, "gradient_bits_intra", w, values["gradient_bits"])
            if bits not in GRADIENT_BITS:
                p.add(f"{w}.gradient_bits_intra", f"{w}.gradient_bits_intra={bits} must be null (the inter-node "
                                                  f"gradient_bits) or {' or '.join(map(str, GRADIENT_BITS))}")
            else:
                values["gradient_bits_intra"] = bits
        size = get_int(p, block, "block_size", w, d.block_size)
        if size not in _POW2_BLOCKS:
            p.add(f"{w}.block_size", f"{w}.block_size={size} must be a power of two from 16 to 8192")
            size = d.block_size
        values["block_size"] = size
        if block.get("error_feedback") == "loco":
            values["error_feedback"] = "loco"
        elif isinstance(block.get("error_feedback"), str):
            p.add(f"{w}.error_feedback", f"{w}.error_feedback={block['error_feedback']!r} must be true (float32 "
                                         "residuals), false or \"loco\" (LoCo's 8-bit moving-average residuals)")
        else:
            values["error_feedback"] = get_bool(p, block, "error_feedback", w, False)
        beta = get_float(p, block, "error_feedback_beta", w, d.error_feedback_beta, minimum=0.0, below=1.0)
        if beta != d.error_feedback_beta and values.get("error_feedback") != "loco":
            p.add(f"{w}.error_feedback_beta", f"{w}.error_feedback_beta={beta} is LoCo's moving-average coefficient: "
                                              f"set {w}.error_feedback to \"loco\", or leave it out")
        values["error_feedback_beta"] = beta
        values["gradient_stochastic_rounding"] = get_bool(p, block, "gradient_stochastic_rounding", w, False)
        rotation = block.get("gradient_rotation")
        if rotation is not None and rotation not in GRADIENT_ROTATIONS:
            p.add(f"{w}.gradient_rotation", f"{w}.gradient_rotation={rotation!r} must be null (off) or one of "
                                            f"{', '.join(map(repr, GRADIENT_ROTATIONS))}")
        elif rotation is not None:
            values["gradient_rotation"] = rotation
        rsize = get_int(p, block, "gradient_rotation_size", w, d.gradient_rotation_size)
        if rsize not in GRADIENT_ROTATION_SIZES:
            p.add(f"{w}.gradient_rotation_size", f"{w}.gradient_rotation_size={rsize} must be one of "
                                                 f"{', '.join(map(str, GRADIENT_ROTATION_SIZES))}")
        elif rsize > size and "gradient_rotation" in values:
            p.add(f"{w}.gradient_rotation_size", f"{w}.gradient_rotation_size={rsize} is larger than {w}.block_size="
                                                 f"{size}: a rotation block lies inside one quantization block; "
                                                 "lower it or raise block_size")
        else:
            values["gradient_rotation_size"] = rsize
        mode = block.get("nonfinite_gradients", d.nonfinite_gradients)
        name = f"{w}.nonfinite_gradients"
        if not is_auto(p, mode, name):
            if mode in NONFINITE_GRADIENTS:
                values["nonfinite_gradients"] = mode
            else:
                p.add(name, f"{name}={mode!r} must be one of {', '.join(map(repr, NONFINITE_GRADIENTS))}")
        name = f"{w}.entry_check_timeout"
        timeout = get_float(p, block, "entry_check_timeout", w, d.entry_check_timeout)
        if p.ok(name) and not 0 < timeout <= MAX_ENTRY_CHECK_TIMEOUT:
            p.add(name, f"{name}={timeout:g} must be a number of seconds above 0 and at most "
                        f"{MAX_ENTRY_CHECK_TIMEOUT:.0f}: how long a rank entering a call that every rank must make "
                        f"(model.state_dict() at stage 3, a save) waits for the others (default "
                        f"{d.entry_check_timeout:g})")
        elif p.ok(name):
            values["entry_check_timeout"] = timeout
        if block.get("memory_budget") is not None:
            budget = get_block(p, block, "memory_budget", w)
            if p.ok(f"{w}.memory_budget"):
                values["memory_budget"] = MemoryBudget.parse(budget, p)
        values["weight_deltas"] = get_bool(p, block, "weight_deltas", w, False)
        bits = get_int(p, block, "delta_bits", w, d.delta_bits)
        if bits not in DELTA_BITS:
            p.add(f"{w}.delta_bits", f"{w}.delta_bits={bits} must be one of {', '.join(map(str, DELTA_BITS))}")
            bits = d.delta_bits
        values["delta_bits"] = bits
        values["delta_refresh_interval"] = get_int(p, block, "delta_refresh_interval", w, d.delta_refresh_interval,
                                                   minimum=0)
        if block.get("delta_refresh_bits") is not None:
            bits = get_int(p, block, "delta_refresh_bits", w, DELTA_REFRESH_BITS[0])
            if bits not in DELTA_REFRESH_BITS:
                p.add(f"{w}.delta_refresh_bits", f"{w}.delta_refresh_bits={bits} must be null (an exact refresh) or "
                                                 f"{' or '.join(map(str, DELTA_REFRESH_BITS))}")
            else:
                values["delta_refresh_bits"] = bits
        defaults = (values["weight_bits"] if quantized_weights else None,
                    values["gradient_bits"] if quantized_gradients else None)
        values["rules"] = parse_rules(block.get("rules"), p, defaults)
        values["partition"] = parse_partition(block.get("partition"), p)
        return cls(**values)


def _weight_deltas_consistency(p: Problems, stage: int | None, hpz: int, offload_param: OffloadParamConfig,
                               resident: bool) -> None:
    """``zeropp.weight_deltas`` updates the stage-3 hpZ secondary partition in place of its per-step gather
    (``zeropp.engine.weight_deltas``): it needs both (``resident``: a ``zeropp.partition`` ``(p, W, W)``, whose
    parameter partition is the secondary), and the secondary stays on the device between steps."""
    key = "zero_optimization.zeropp.weight_deltas"
    if stage is not None and stage != 3:
        p.add(key, f"{key}=true updates the stage-3 hpZ secondary partition between steps; set "
                   f"zero_optimization.stage to 3 (it is {stage}) or weight_deltas to false")
    elif hpz <= 1 and not resident:
        p.add(key, f"{key}=true sends each step's weight change to the hpZ secondary partitions, and "
                   "zero_optimization.zero_hpz_partition_size is 1 (hpZ off): set it to a divisor above 1 of the "
                   "ranks per node (e.g. the ranks per node), give zeropp.partition {\"parameters\": \"node\", "
                   "\"gradients\": \"world\", \"optimizer\": \"world\"}, or set weight_deltas to false")
    if offload_param.enabled:
        p.add(key, f"{key}=true keeps the hpZ secondary partition and the reconstruction of this rank's shard on "
                   "the device between steps, which zero_optimization.offload_param moves off it: this build does "
                   "not combine them; set offload_param.device to \"none\" or weight_deltas to false")


# DeepSpeed keys we know but do not implement: key -> why / what instead
_ZERO_UNSUPPORTED = {
    "zero_quantized_nontrainable_weights": "frozen parameters are not quantized",
    "override_module_apply": "not supported",
}

# DeepSpeed keys that describe what zeropp always does: accepted with that value only
_ZERO_FIXED = {
    "ignore_unused_parameters": (True, "unused parameters are always allowed (their gradient is zero)"),
    "load_from_fp32_weights": (True, "checkpoints always hold and load the fp32 master weights"),
    "elastic_checkpoint": (False, "elastic checkpoints are not supported (checkpoints load at any world size)"),
    "cpu_offload": (False, "DeepSpeed's deprecated switch; for CPU offload give offload_optimizer "
                           "{\"device\": \"cpu\"}"),
    "cpu_offload_params": (False, "DeepSpeed's deprecated switch; for CPU offload give offload_param "
                                  "{\"device\": \"cpu\"}"),
    "cpu_offload_use_pin_memory": (False, "DeepSpeed's deprecated switch; give pin_memory in offload_optimizer / "
                                          "offload_param"),
    "legacy_stage1": (False, "only the current stage 1 exists"),
    "use_all_reduce_for_fetch_params": (False, "parameters are always fetched by all-gather"),
    "pipeline_loading_checkpoint": (False, "pipeline parallelism is not supported"),
}

# DeepSpeed keys that choose how DeepSpeed implements something whose result zeropp computes its own way: any
# boolean is accepted and changes nothing (the trained weights are the same)
_ZERO_NO_EFFECT = ["contiguous_gradients", "allgather_partitions", "reduce_scatter", "round_robin_gradients",
                   "memory_efficient_linear", "log_trace_cache_warnings"]

_STAGE3_DEFAULTS = {
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": sys.maxsize,
    "allgather_bucket_size": 500_000_000,
    "sub_group_size": 1_000_000_000,
}


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: the ZeRO stage, the ZeRO++ switches, the bucket sizes, DeepSpeed's stage-3 tuning keys
    and the offload blocks (their meaning in zeropp: the ``zeropp.config`` docstring)."""

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
    allgather_bucket_size: int = 500_000_000
    sub_group_size: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    zeropp: ZeroppConfig = field(default_factory=ZeroppConfig)
    mics_shard_size: int = MICS_OFF
    mics_hierarchical_params_gather: bool = False

    @property
    def weight_bits(self) -> int | None:
        """Bits of the weight all-gather: ``zeropp.weight_bits`` with qwZ on, else ``None`` (exact)."""
        return self.zeropp.weight_bits if self.zero_quantized_weights else None

    @property
    def gradient_bits(self) -> int | None:
        """Bits of the gradient reduce-scatter: ``zeropp.gradient_bits`` with qgZ on, else ``None`` (exact)."""
        return self.zeropp.gradient_bits if self.zero_quantized_gradients else None

    @property
    def gradient_bits_intra(self) -> int | None:
        """Bits of qgZ's intra-node hop when they differ from ``gradient_bits``: ``zeropp.gradient_bits_intra`` with
        qgZ on, else ``None`` (both hops in ``gradient_bits``)."""
        return self.zeropp.gradient_bits_intra if self.zero_quantized_gradients else None

    @property
    def gradient_rotation(self) -> int | None:
        """Block size of qgZ's Hadamard rotation: ``zeropp.gradient_rotation_size`` with qgZ and
        ``zeropp.gradient_rotation`` on, else ``None`` (no rotation)."""
        on = self.zero_quantized_gradients and self.zeropp.gradient_rotation is not None
        return self.zeropp.gradient_rotation_size if on else None

    def partition_point(self, world: int, ranks_per_node: int) -> tuple[int, int, int]:
        """The ``(parameters, gradients, optimizer)`` sharding factors, in ranks, that the engine runs at ``world``
        ranks of ``ranks_per_node`` per node: ``zeropp.partition``, else ``mics_shard_size``'s MiCS point, else the
        stage's (``zeropp.config.partition``). Raises ``ConfigError`` for one the topology or engine cannot run."""
        return partition_point(self.stage, self.zeropp.partition, self.mics_shard_size, world, ranks_per_node)

    @property
    def hpz(self) -> bool:
        return self.zero_hpz_partition_size > 1

    @property
    def offload(self) -> bool:
        """Whether some state may leave the accelerator: an offload device other than ``"none"`` or a
        ``zeropp.memory_budget``."""
        return self.offload_optimizer.enabled or self.offload_param.enabled or self.zeropp.memory_budget is not None

    @classmethod
    def parse(cls, block: Mapping[str, Any], p: Problems, world_size: int = 1) -> ZeroConfig:
        """``world_size``: the data-parallel ranks the partition is checked for (``zeropp.config.partition``)."""
        w = "zero_optimization"
        valid = ["stage", "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size",
                 "reduce_bucket_size", "stage3_prefetch_bucket_size", "overlap_comm", "zeropp",
                 "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                 "offload_optimizer", "offload_param", "aio", "mics_shard_size", "mics_hierarchical_params_gather",
                 *_STAGE3_DEFAULTS, *_ZERO_FIXED, *_ZERO_NO_EFFECT]
        check_keys(p, block, w, valid, _ZERO_UNSUPPORTED)
        check_fixed(p, block, w, _ZERO_FIXED)
        for key in _ZERO_NO_EFFECT:
            if key in block:
                as_bool(p, block[key], f"{w}.{key}")
        if "aio" in block:
            p.add(f"{w}.aio", f"{w}.aio: aio is a top-level block of the config (DeepSpeed rejects it here too); move "
                              "it out of zero_optimization")
        d = cls()
        stage = get_int(p, block, "stage", w, d.stage)
        if p.ok(f"{w}.stage"):
            if stage == 0:
                p.add(f"{w}.stage", f"{w}.stage=0 (plain data parallelism) is not supported; use stage 1, 2 or 3")
            elif stage not in (1, 2, 3):
                p.add(f"{w}.stage", f"{w}.stage={stage} must be 1, 2 or 3")
        known_stage = stage if p.ok(f"{w}.stage") else None
        offload_optimizer = OffloadOptimizerConfig.parse(get_block(p, block, "offload_optimizer", w), p, known_stage)
        offload_param = OffloadParamConfig.parse(get_block(p, block, "offload_param", w), p, known_stage)
        qg = get_bool(p, block, "zero_quantized_gradients", w, False)
        hpz = get_int(p, block, "zero_hpz_partition_size", w, 1, minimum=1)
        if hpz > 1 and stage != 3 and p.ok(f"{w}.stage"):
            p.add(f"{w}.zero_hpz_partition_size", f"{w}.zero_hpz_partition_size={hpz} applies to the stage-3 "
                                                  "backward weight all-gather; set stage to 3 (or the size to 1)")
        qw = get_bool(p, block, "zero_quantized_weights", w, False)
        zeropp = ZeroppConfig.parse(get_block(p, block, "zeropp", w), p, quantized_weights=qw, quantized_gradients=qg)
        offload_consistency(p, offload_optimizer, offload_param, zeropp.memory_budget)
        mics_size, mics_hierarchical = parse_mics(block, p)
        if p.ok(f"{w}.stage"):
            for key, message in partition_problems(stage, zeropp.partition, mics_size, world_size, None):
                p.add(key, message)
        if zeropp.weight_deltas:
            _weight_deltas_consistency(p, stage if p.ok(f"{w}.stage") else None, hpz, offload_param,
                                       resident_given(zeropp.partition, world_size))
        if zeropp.error_feedback and not qg and p.ok(f"{w}.zero_quantized_gradients"):
            p.add(f"{w}.zeropp.error_feedback",
                  f"{w}.zeropp.error_feedback={json_value(zeropp.error_feedback)} needs "
                  f"{w}.zero_quantized_gradients=true")
        if zeropp.gradient_stochastic_rounding and not qg and p.ok(f"{w}.zero_quantized_gradients"):
            p.add(f"{w}.zeropp.gradient_stochastic_rounding",
                  f"{w}.zeropp.gradient_stochastic_rounding=true rounds qgZ's quantized gradients and needs "
                  f"{w}.zero_quantized_gradients=true (or gradient_stochastic_rounding false)")
        if zeropp.gradient_bits_intra is not None and not qg and p.ok(f"{w}.zero_quantized_gradients"):
            p.add(f"{w}.zeropp.gradient_bits_intra",
                  f"{w}.zeropp.gradient_bits_intra={zeropp.gradient_bits_intra} sets the bits of qgZ's intra-node hop "
                  f"and needs {w}.zero_quantized_gradients=true (or gradient_bits_intra null)")
        if zeropp.gradient_rotation is not None and not qg and p.ok(f"{w}.zero_quantized_gradients"):
            p.add(f"{w}.zeropp.gradient_rotation",
                  f"{w}.zeropp.gradient_rotation={zeropp.gradient_rotation!r} rotates qgZ's quantized gradients and "
                  f"needs {w}.zero_quantized_gradients=true (or gradient_rotation null)")
        gather_key = "stage3_gather_16bit_weights_on_model_save"
        old_key = "stage3_gather_fp16_weights_on_model_save"  # DeepSpeed's older spelling of the same key
        if gather_key in block and old_key in block:
            p.add(f"{w}.{old_key}", f"{w}.{old_key} is the old spelling of {w}.{gather_key}; give only one")
        gather = get_bool(p, block, gather_key if gather_key in block else old_key, w, False)
        return cls(
            stage=stage,
            zero_quantized_weights=qw,
            zero_quantized_gradients=qg,
            zero_hpz_partition_size=hpz,
            reduce_bucket_size=get_int(p, block, "reduce_bucket_size", w, d.reduce_bucket_size, minimum=1),
            stage3_prefetch_bucket_size=get_int(p, block, "stage3_prefetch_bucket_size", w,
                                                d.stage3_prefetch_bucket_size, minimum=0),
            overlap_comm=get_bool(p, block, "overlap_comm", w, stage == 3),
            **{key: get_int(p, block, key, w, default, minimum=0) for key, default in _STAGE3_DEFAULTS.items()},
            stage3_gather_16bit_weights_on_model_save=gather,
            offload_optimizer=offload_optimizer,
            offload_param=offload_param,
            zeropp=zeropp,
            mics_shard_size=mics_size,
            mics_hierarchical_params_gather=mics_hierarchical,
        )

