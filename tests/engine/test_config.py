"""zeropp.config: DeepSpeed-style parsing, batch-size arithmetic and every error path (single process)."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

from zeropp.config import (
    Config,
    ConfigError,
    ZeroConfig,
    ZeroppConfig,
    load_config,
    to_dict,
)

BASE = {"train_micro_batch_size_per_gpu": 2}


def cfg(world: int = 1, **top) -> Config:
    return load_config({**BASE, **top}, world_size=world)


def zero(world: int = 1, **keys) -> Config:
    return cfg(world, zero_optimization=keys)


# ---- what parses ------------------------------------------------------------------------------------------


def test_defaults():
    c = cfg()
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (2, 2, 1)
    assert c.gradient_clipping == 0.0 and not c.bf16.enabled and not c.fp16.enabled and c.optimizer is None
    z = c.zero_optimization
    assert z.stage == 1 and z.weight_bits is None and z.gradient_bits is None and not z.hpz
    assert (z.zeropp.weight_bits, z.zeropp.gradient_bits, z.zeropp.block_size) == (8, 4, 128)
    assert z.zeropp.nonfinite_gradients == "skip" and z.zeropp.entry_check_timeout == 300.0


def test_full_deepspeed_config_from_json_path(tmp_path):
    config = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
            "overlap_comm": True, "contiguous_gradients": True,
            "zeropp": {"weight_bits": 4, "gradient_bits": 8, "block_size": 256, "error_feedback": True},
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    c = load_config(path, world_size=4)
    assert c.train_micro_batch_size_per_gpu == 4
    assert c.fp16.enabled and c.fp16.dynamic and c.fp16.initial_scale_power == 12
    assert c.optimizer.type == "AdamW"
    assert c.optimizer.params == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    z = c.zero
    assert (z.stage, z.weight_bits, z.gradient_bits, z.zero_hpz_partition_size) == (3, 4, 8, 2)
    assert z.reduce_bucket_size == 500_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.zeropp.block_size == 256 and z.zeropp.error_feedback
    assert load_config(str(path), world_size=4) == c
    assert load_config(c, world_size=4) is c
    assert load_config(c, world_size=2).train_batch_size == 16  # re-derived for another world size


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 4,
         (16, 2, 2)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 4, (16, 2, 2)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),
        ({"train_batch_size": 16}, 4, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (12, 3, 2)),
        ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
    ],
)
def test_batch_arithmetic(given, world, expected):
    c = load_config(given, world_size=world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_optimizer_defaults_follow_torch_and_deepspeed():
    adam = cfg(optimizer={"type": "Adam"}).optimizer
    assert adam.params["adam_w_mode"] is True and adam.params["weight_decay"] == 0.0  # DeepSpeed's Adam is AdamW
    sgd = cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}).optimizer
    assert sgd.type == "SGD" and sgd.params["momentum"] == 0.9 and sgd.params["dampening"] == 0.0
    onebit = cfg(optimizer={"type": "onebitadam", "params": {"freeze_step": 400, "cuda_aware": False,
                                                             "comm_backend_name": "nccl", "bias_correction": True,
                                                             "max_grad_norm": 0.0}}).optimizer
    assert onebit.type == "OneBitAdam"  # DeepSpeed's OnebitAdam defaults; its backend switches are dropped
    assert dict(onebit.params) == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                   "freeze_step": 400}


# ---- every error path -------------------------------------------------------------------------------------


def err(config, world: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world)
    return str(info.value)


@pytest.mark.parametrize(
    "config, world, needles",
    [
        # unknown keys: the key, where it is, the closest spelling, the valid keys
        ({**BASE, "gradient_cliping": 1.0}, 1, ["'gradient_cliping'", "did you mean 'gradient_clipping'",
                                                 "train_batch_size"]),
        ({**BASE, "zero_optimization": {"stagee": 2}}, 1, ["zero_optimization.stagee", "'stage'"]),
        ({**BASE, "zero_optimization": {"zeropp": {"bits": 4}}}, 1, ["zero_optimization.zeropp.bits",
                                                                      "weight_bits"]),
        ({**BASE, "bf16": {"enable": True}}, 1, ["bf16.enable", "'enabled'"]),
        ({**BASE, "fp16": {"scale": 1}}, 1, ["fp16.scale"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"learning_rate": 1}}}, 1,
         ["optimizer.params.learning_rate", "lr"]),
        ({**BASE, "optimizer": {"type": "AdamW", "param": {}}}, 1, ["optimizer.param", "'params'"]),
        ({**BASE, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, 1,
         ["optimizer.params.betas", "momentum"]),
        # DeepSpeed keys we do not support: said so
        ({**BASE, "scheduler": {"type": "LRRangeTest"}}, 1, ["scheduler.type='LRRangeTest'", "WarmupCosineLR"]),
        ({**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, 1,
         ["zero_optimization.offload_param.device='cpu'", "stage 3 only", "set the stage to 3"]),
        ({**BASE, "zero_optimization": {"zero_quantized_nontrainable_weights": True}}, 1,
         ["zero_quantized_nontrainable_weights", "does not support", "remove it"]),
        ({**BASE, "tensorboard": {"enabled": True, "output_path": "tb"}}, 1, ["tensorboard.enabled=true", "false"]),
        ({**BASE, "prescale_gradients": True}, 1, ["prescale_gradients=True", "set it to false"]),
        ({**BASE, "gradient_predivide_factor": 2.0}, 1, ["gradient_predivide_factor=2.0", "set it to 1.0"]),
        ({**BASE, "communication_data_type": "int8"}, 1, ["communication_data_type='int8'", '"bf16"']),
        ({**BASE, "steps_per_print": 0}, 1, ["steps_per_print=0", ">= 1"]),
        ({**BASE, "wall_clock_breakdown": 1}, 1, ["wall_clock_breakdown=1", "true or false"]),
        ({**BASE, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, 1, ["bfloat16 and bf16", "only bf16"]),
        ({**BASE, "bf16": {"enabled": True, "immediate_grad_update": True}}, 1,
         ["bf16.immediate_grad_update=true", "stage 1"]),
        ({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, 1,
         ["scheduler.params.total_num_steps is required"]),
        ({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}, 1,
         ["scheduler.params.warmup_type='exp'", '"linear"']),
        ({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, 1,
         ["scheduler.params.warmup_num_steps=0", ">= 1"]),
        ({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}}, 1,
         ["scheduler.params.warmup_steps", "did you mean 'warmup_num_steps'"]),
        ({**BASE, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1,
                                                                "cycle_min_mom": 0.95}}}, 1,
         ["cycle_min_mom=0.95", "<= cycle_max_mom=0.9"]),
        ({**BASE, "zero_optimization": {"stage": 0}}, 1, ["stage=0", "not supported"]),
        ({**BASE, "zero_optimization": {"ignore_unused_parameters": False}}, 1,
         ["ignore_unused_parameters=False", "not supported", "set it to true"]),
        ({**BASE, "zero_optimization": {"reduce_scatter": "no"}}, 1, ["reduce_scatter='no'", "true or false"]),
        ({**BASE, "fp16": {"enabled": True, "auto_cast": True}}, 1, ["fp16.auto_cast=True", "set it to false"]),
        ({**BASE, "optimizer": {"type": "ZeroOneAdam"}}, 1, ["ZeroOneAdam", "var_freeze_step", "use \"OneBitAdam\""]),
        ({**BASE, "optimizer": {"type": "OneBitLamb"}}, 1, ["OneBitLamb", "trust ratio", "use \"OneBitAdam\""]),
        ({**BASE, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 0}}}, 1,
         ["optimizer.params.freeze_step=0", "integer >= 1"]),
        ({**BASE, "optimizer": {"type": "OneBitAdam", "params": {"eps_inside_sqrt": True}}}, 1,
         ["eps_inside_sqrt=True", "set it to false"]),
        ({**BASE, "optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": 1}}}, 1,
         ["comm_backend_name=1", "must be a string"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"freeze_step": 5}}}, 1, ["optimizer.params.freeze_step"]),
        ({**BASE, "gradient_clipping": 1.0, "optimizer": {"type": "OneBitAdam"}}, 1,
         ["gradient_clipping=1.0", "OneBitAdam", "set it to 0"]),
        ({**BASE, "fp16": {"enabled": True}, "optimizer": {"type": "OneBitAdam"}}, 1,
         ["fp16.enabled=true", "OneBitAdam", "bf16 or fp32"]),
        ({**BASE, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "OneBitAdam"}},
         1, ["offload_optimizer", "OneBitAdam", "remove them"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, 1, ["amsgrad", "does not support"]),
        # bad values
        ({**BASE, "zero_optimization": {"stage": 4}}, 1, ["stage=4", "1, 2 or 3"]),
        ({**BASE, "zero_optimization": {"stage": "3"}}, 1, ["stage='3'", "integer"]),
        ({**BASE, "zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}}, 1,
         ["zero_hpz_partition_size", "stage to 3"]),
        ({**BASE, "zero_optimization": {"zero_hpz_partition_size": 0}}, 1, ["zero_hpz_partition_size=0", ">= 1"]),
        ({**BASE, "zero_optimization": {"overlap_comm": "yes"}}, 1, ["overlap_comm='yes'", "true or false"]),
        ({**BASE, "zero_optimization": {"reduce_bucket_size": 1.5}}, 1, ["reduce_bucket_size=1.5", "integer"]),
        ({**BASE, "zero_optimization": {"zeropp": {"weight_bits": 2}}}, 1, ["weight_bits=2", "8 or 4"]),
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_bits": 16}}}, 1, ["gradient_bits=16", "8 or 4 or 2"]),
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_bits_intra": 8}}}, 1,
         ["gradient_bits_intra=8", "zero_quantized_gradients=true"]),
        ({**BASE, "zero_optimization": {"zero_quantized_gradients": True, "zeropp": {"gradient_bits_intra": 3}}}, 1,
         ["gradient_bits_intra=3", "8 or 4 or 2"]),
        ({**BASE, "zero_optimization": {"zeropp": {"block_size": 100}}}, 1, ["block_size=100", "power of two"]),
        ({**BASE, "zero_optimization": {"zeropp": {"error_feedback": True}}}, 1,
         ["error_feedback", "zero_quantized_gradients"]),
        ({**BASE, "zero_optimization": {"zero_quantized_gradients": True, "zeropp": {"error_feedback": "lo"}}}, 1,
         ["error_feedback='lo'", '"loco"']),
        ({**BASE, "zero_optimization": {"zero_quantized_gradients": True, "zeropp": {"error_feedback_beta": 0.9}}}, 1,
         ["error_feedback_beta", 'error_feedback to "loco"']),
        ({**BASE, "zero_optimization": {"zero_quantized_gradients": True, "zeropp": {
            "error_feedback": "loco", "error_feedback_beta": 1.0}}}, 1, ["error_feedback_beta=1.0", "< 1.0"]),
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_stochastic_rounding": True}}}, 1,
         ["gradient_stochastic_rounding=true", "zero_quantized_gradients=true"]),
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_rotation": "hadamard"}}}, 1,
         ["gradient_rotation='hadamard'", "zero_quantized_gradients=true"]),
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_rotation": "walsh"}}}, 1,
         ["gradient_rotation='walsh'", "null (off) or one of 'hadamard'"]),
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_rotation_size": 24}}}, 1,
         ["gradient_rotation_size=24", "16, 32, 64, 128"]),
        ({**BASE, "zero_optimization": {"zero_quantized_gradients": True, "zeropp": {
            "gradient_rotation": "hadamard", "gradient_rotation_size": 64, "block_size": 32}}}, 1,
         ["gradient_rotation_size=64 is larger than zero_optimization.zeropp.block_size=32"]),
        ({**BASE, "zero_optimization": {"zeropp": {"nonfinite_gradients": "ignore"}}}, 1,
         ["zero_optimization.zeropp.nonfinite_gradients='ignore'", "'skip', 'raise'"]),
        ({**BASE, "zero_optimization": {"zeropp": {"entry_check_timeout": 0}}}, 1,
         ["zero_optimization.zeropp.entry_check_timeout=0", "above 0", "default 300"]),
        ({**BASE, "zero_optimization": []}, 1, ["zero_optimization must be an object"]),
        ({**BASE, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, 1, ["both true"]),
        ({**BASE, "fp16": {"loss_scale_window": 0}}, 1, ["fp16.loss_scale_window=0", ">= 1"]),
        ({**BASE, "gradient_clipping": -1}, 1, ["gradient_clipping=-1.0", ">= 0"]),
        ({**BASE, "gradient_clipping": float("nan")}, 1, ["gradient_clipping=nan", "finite"]),
        ({**BASE, "gradient_clipping": "auto"}, 1, ["'auto'", "Hugging Face"]),
        ({**BASE, "optimizer": {"params": {}}}, 1, ["optimizer.type=None", "AdamW"]),
        ({**BASE, "optimizer": {"type": "Adamax"}}, 1, ["unknown optimizer.type='Adamax'"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, 1, ["betas", "two numbers"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, 1, ["betas", "< 1.0"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": -1}}}, 1, ["optimizer.params.lr=-1.0", ">= 0"]),
        ({**BASE, "optimizer": {"type": "AdamW", "params": {"eps": 0}}}, 1, ["eps=0", "divide by zero"]),
        ({**BASE, "optimizer": {"type": "SGD", "params": {"nesterov": True}}}, 1, ["nesterov", "momentum > 0"]),
        # batch sizes
        ({}, 1, ["train_batch_size or train_micro_batch_size_per_gpu"]),
        ({"gradient_accumulation_steps": 2}, 1, ["train_batch_size or train_micro_batch_size_per_gpu"]),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2,
         ["train_batch_size=16 !=", "= 8"]),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2}, 4, ["not a multiple", "world size 4"]),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 1, ["not a multiple"]),
        ({"train_batch_size": 0}, 1, ["train_batch_size=0", ">= 1"]),
        ({"train_micro_batch_size_per_gpu": True}, 1, ["must be an integer"]),
        # the container itself
        ([1, 2], 1, ["dict or the path of a JSON file"]),
        ({1: 2}, 1, ["keys must be strings"]),
    ],
)
def test_errors(config, world, needles):
    message = err(config, world)
    for needle in needles:
        assert needle in message, (needle, message)


def test_file_errors(tmp_path):
    assert "does not exist" in err(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in err(bad)
    assert "world_size=0" in err(BASE, world=0)


def test_quantized_collectives_at_every_stage_hpz_at_stage_3_only():
    """qwZ and qgZ quantize stage 1/2's post-step gather and reduce-scatter too; hpZ needs stage 3's re-gather."""
    for stage in (1, 2, 3):
        z = cfg(zero_optimization={"stage": stage, "zero_quantized_weights": True,
                                   "zero_quantized_gradients": True}).zero
        assert (z.weight_bits, z.gradient_bits) == (8, 4)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=2 applies to the stage-3"):
        cfg(zero_optimization={"stage": 2, "zero_hpz_partition_size": 2})


# ---- configs as DeepSpeed and its users publish them ----------------------------------------------------------

# DeepSpeed's ZeRO++ tutorial (deepspeed.ai/tutorials/zeropp), its zero_optimization block verbatim; the tutorial
# launches with --fp16 and DeepSpeed needs a batch size, so those two are added.
ZEROPP_TUTORIAL = {
    "train_micro_batch_size_per_gpu": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 10000000,
        "reduce_scatter": False,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    },
}

# The Hugging Face Trainer's ZeRO-3 template (transformers tests/deepspeed/ds_config_zero3.json), verbatim.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e14,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_fp16_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_AUTO_KEYS = [
    "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "gradient_accumulation_steps", "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
]


def hf_filled() -> dict:
    """HF_ZERO3 with the values the Trainer fills in for --per_device_train_batch_size 4 --learning_rate 3e-5
    --warmup_steps 500 on 2 ranks, and offload turned off the documented way (``"device": "none"``; the template
    with its CPU offload on: tests/engine/test_offload_config.py)."""
    c = json.loads(json.dumps(HF_ZERO3))
    c["fp16"]["enabled"] = True
    c["optimizer"]["params"] = {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    c["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}
    z = c["zero_optimization"]
    z.update(reduce_bucket_size=589824, stage3_prefetch_bucket_size=530841, stage3_param_persistence_threshold=7680)
    z["offload_optimizer"]["device"] = z["offload_param"]["device"] = "none"
    c.update(gradient_accumulation_steps=1, gradient_clipping=1.0, train_batch_size=8, train_micro_batch_size_per_gpu=4)
    return c


def deepspeed_chat(stage: int, enable_tensorboard: bool = False) -> dict:
    """DeepSpeed-Chat's training config (DeepSpeedExamples applications/DeepSpeed-Chat/dschat/utils/ds_utils.py,
    ``get_train_ds_config(offload=False, dtype="bf16", stage=stage)``), as that function builds it."""
    device = "none"
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        "bfloat16": {"enabled": True},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": enable_tensorboard, "output_path": "/tmp/step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    }


def test_zeropp_tutorial_config():
    c = load_config(ZEROPP_TUTORIAL, world_size=32)
    z = c.zero
    assert (z.stage, z.weight_bits, z.gradient_bits, z.zero_hpz_partition_size) == (3, 8, 4, 16)
    assert z.reduce_bucket_size == 10_000_000 and z.overlap_comm and c.fp16.enabled
    assert (c.train_batch_size, c.gradient_accumulation_steps, c.steps_per_print) == (32, 1, 10)


def test_hf_trainer_zero3_template_filled_in():
    c = load_config(hf_filled(), world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 1)
    assert c.scheduler.type == "WarmupLR"
    assert dict(c.scheduler.params) == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500,
                                        "warmup_type": "log", "last_batch_iteration": -1}
    z = c.zero
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (10**9, 10**9)
    assert z.stage3_param_persistence_threshold == 7680 and z.sub_group_size == 10**14
    assert z.stage3_gather_16bit_weights_on_model_save  # from DeepSpeed's older spelling
    assert z.reduce_bucket_size == 589824 and isinstance(z.stage3_max_live_parameters, int)
    assert (c.steps_per_print, c.wall_clock_breakdown, c.communication_data_type) == (2000, False, None)


def test_hf_trainer_zero3_template_as_published_is_one_error_naming_every_auto():
    auto_line = err(HF_ZERO3, world=2)
    assert "\n" not in auto_line, auto_line  # the autos are the only problem (its CPU offload blocks parse)
    assert "Hugging Face Trainer" in auto_line
    for key in HF_AUTO_KEYS:
        assert key in auto_line, (key, auto_line)
    assert auto_line.count(",") == len(HF_AUTO_KEYS) - 1  # no other key named


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_chat_config(stage):
    c = load_config(deepspeed_chat(stage), world_size=8)
    assert c.bf16.enabled and not c.fp16.enabled and c.gradient_clipping == 1.0
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (32, 4, 1)
    z = c.zero
    assert (z.stage, z.stage3_param_persistence_threshold, z.stage3_max_live_parameters) == (stage, 10**4, 3 * 10**7)
    assert z.stage3_prefetch_bucket_size == 3 * 10**7 and z.overlap_comm
    assert "tensorboard.enabled=true" in err(deepspeed_chat(stage, enable_tensorboard=True), world=8)


def test_five_problems_in_one_error():
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_cliping": 1.0,                                     # misspelt
        "fp16": {"enabled": True, "loss_scale_window": 0},           # out of range
        "scheduler": {"type": "WarmupCosineLR", "params": {}},       # total_num_steps missing
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}, "zero_hpz_partition_size": "2"},
    }
    message = err(config)
    lines = message.splitlines()
    assert lines[0] == "5 problems in the config:" and len(lines) == 6, message
    for needle in ["'gradient_cliping'; did you mean 'gradient_clipping'", "fp16.loss_scale_window=0 must be >= 1",
                   "scheduler.params.total_num_steps is required", "offload_param.device=\"nvme\" needs",
                   "zero_hpz_partition_size='2' must be an integer"]:
        assert sum(needle in line for line in lines[1:]) == 1, (needle, message)


def test_no_follow_on_errors():
    """A bad stage is one problem: the checks that depend on it (hpZ needs stage 3) are not made on a fallback."""
    message = err({**BASE, "zero_optimization": {"stage": "three", "zero_hpz_partition_size": 2}})
    assert "\n" not in message and "stage='three' must be an integer" in message


@pytest.mark.parametrize("given, expected", [("fp32", "fp32"), ("float32", "fp32"), ("FP16", "fp16"),
                                             ("half", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16"), (None, None)])
def test_communication_data_type_spellings(given, expected):
    assert cfg(communication_data_type=given).communication_data_type == expected


def test_new_keys_take_deepspeeds_defaults():
    c = cfg()
    z = c.zero
    assert (c.steps_per_print, c.wall_clock_breakdown, c.scheduler, c.communication_data_type) == (10, False, None,
                                                                                                   None)
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance, z.stage3_param_persistence_threshold) == (
        1_000_000_000, 1_000_000_000, 100_000)
    assert z.stage3_model_persistence_threshold == sys.maxsize
    assert (z.allgather_bucket_size, z.sub_group_size, z.stage3_gather_16bit_weights_on_model_save) == (
        500_000_000, 1_000_000_000, False)


@pytest.mark.parametrize("kind, params, expected", [
    ("warmupdecaylr", {"total_num_steps": 100}, {"total_num_steps": 100, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000, "warmup_type": "log"}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_type": "linear"},
     {"total_num_steps": 10, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
      "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3},
     {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
      "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
      "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
      "decay_mom_rate": 0.0}),
    ("WarmupLR", {"warmup_min_lr": [0, 1e-5]}, {"warmup_min_lr": (0.0, 1e-5), "warmup_max_lr": None,
                                                "warmup_num_steps": 1000, "warmup_type": "log"}),
])
def test_scheduler_defaults_are_deepspeeds(kind, params, expected):
    s = cfg(scheduler={"type": kind, "params": params}).scheduler
    assert s.type.lower() == kind.lower() and dict(s.params) == {**expected, "last_batch_iteration": -1}


def test_round_trip_keeps_every_field():
    """``to_dict`` then ``Config.parse`` gives the same config, with every field away from its default."""
    config = {
        "train_batch_size": 24, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
        "steps_per_print": 7, "wall_clock_breakdown": True, "communication_data_type": "bfloat16",
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 50,
                 "hysteresis": 3, "min_loss_scale": 0.5},
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9], "adam_w_mode": False}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                      "cycle_second_step_size": 7, "last_batch_iteration": 3}},
        "zero_optimization": {
            "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2, "reduce_bucket_size": 11, "stage3_prefetch_bucket_size": 12,
            "overlap_comm": False, "stage3_max_live_parameters": 13, "stage3_max_reuse_distance": 14,
            "stage3_param_persistence_threshold": 15, "stage3_model_persistence_threshold": 16,
            "allgather_bucket_size": 17, "sub_group_size": 18, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme/o", "pin_memory": False, "buffer_count": 6,
                                  "pipeline_read": True, "pipeline_write": True, "fast_init": True},
            "offload_param": {"device": "nvme", "nvme_path": "/nvme/p", "pin_memory": False, "buffer_count": 7,
                              "buffer_size": 19, "max_in_cpu": 0},
            "zeropp": {"weight_bits": 4, "gradient_bits": 8, "gradient_bits_intra": 2, "block_size": 64,
                       "error_feedback": "loco", "error_feedback_beta": 0.25, "gradient_stochastic_rounding": True,
                       "gradient_rotation": "hadamard", "gradient_rotation_size": 16,
                       "nonfinite_gradients": "raise", "entry_check_timeout": 12.5,
                       "memory_budget": {"device": 4e9, "cpu": 8e9}, "delta_bits": 8,
                       "delta_refresh_interval": 5, "delta_refresh_bits": 8,
                       "rules": [{"match": "ln_", "weight_bits": None}, {"match": "wte", "gradient_bits": 4}],
                       "partition": {"parameters": "world", "gradients": "world", "optimizer": "world"}},
        },
        "aio": {"block_size": 4096, "queue_depth": 4, "thread_count": 2, "single_submit": True,
                "overlap_events": False},
    }
    c = load_config(config, world_size=4)
    for f in dataclasses.fields(ZeroppConfig):
        if f.name != "weight_deltas":  # refused with offload_param (test_weight_deltas round-trips it)
            assert getattr(c.zero.zeropp, f.name) != getattr(ZeroppConfig(), f.name), f.name
    defaults = Config(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    for f in dataclasses.fields(Config):
        if f.name not in ("world_size", "bf16"):  # bf16 and fp16 cannot both be on: fp16 is
            assert getattr(c, f.name) != getattr(defaults, f.name), f.name
    for f in dataclasses.fields(ZeroConfig):
        # overlap_comm: its default is true at stage 3, false is the non-default here; a mics_shard_size fits one
        # world size, not the two below (test_partition_config round-trips the MiCS keys)
        if f.name not in ("overlap_comm", "mics_shard_size", "mics_hierarchical_params_gather"):
            assert getattr(c.zero, f.name) != getattr(ZeroConfig(), f.name), f.name
    assert not c.zero.overlap_comm
    assert Config.parse(to_dict(c), world_size=4) == c
    assert load_config(c, world_size=2) == dataclasses.replace(c, world_size=2, train_batch_size=12)


# ---- fp16 scale bounds and duplicate JSON keys (found by fuzzing) ----------------------------------------------


@pytest.mark.parametrize("power", [127, 200, 2000, 10**6])
def test_initial_scale_power_past_float32_is_a_config_error(power):
    message = err({**BASE, "fp16": {"enabled": True, "initial_scale_power": power}})
    assert f"fp16.initial_scale_power={power} must be <= 126" in message, message


@pytest.mark.parametrize("power", [0, 16, 126])
def test_accepted_initial_scale_powers_give_a_normal_float32_scale_and_reciprocal(power):
    c = cfg(fp16={"enabled": True, "initial_scale_power": power})
    scale = np.float32(2.0**c.fp16.initial_scale_power)
    tiny = np.finfo(np.float32).tiny
    assert np.isfinite(scale) and scale >= tiny and np.float32(1) / scale >= tiny
    assert float(scale) == 2.0**power  # held exactly


@pytest.mark.parametrize("loss_scale, ok", [(1e39, False), (2.0**126, True), (2.0**127, False), (1e-40, False),
                                            (2.0**-126, True), (128.0, True)])
def test_static_loss_scale_must_be_a_normal_float32(loss_scale, ok):
    config = {**BASE, "fp16": {"enabled": True, "loss_scale": loss_scale}}
    if ok:
        assert load_config(config).fp16.loss_scale == loss_scale
        assert np.isfinite(np.float32(loss_scale)) and np.float32(loss_scale) == loss_scale
    else:
        assert f"fp16.loss_scale={loss_scale}" in err(config)


def test_min_loss_scale_above_the_initial_scale_is_a_config_error():
    message = err({**BASE, "fp16": {"enabled": True, "initial_scale_power": 8, "min_loss_scale": 257}})
    assert "fp16.min_loss_scale=257.0 is above the initial loss scale 2**8 = 256" in message, message
    assert cfg(fp16={"enabled": True, "initial_scale_power": 8, "min_loss_scale": 256}).fp16.min_loss_scale == 256
    # a static scale never moves, so min_loss_scale does not constrain it
    assert cfg(fp16={"enabled": True, "loss_scale": 4, "min_loss_scale": 256}).fp16.loss_scale == 4
    # one error only when the power itself is bad (no follow-on complaint about min_loss_scale)
    message = err({**BASE, "fp16": {"initial_scale_power": 300, "min_loss_scale": 1e30}})
    assert "initial_scale_power=300" in message and "min_loss_scale" not in message, message


@pytest.mark.parametrize(
    "text, repeated",
    [
        ('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}', ["train_micro_batch_size_per_gpu"]),
        ('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, "stage": 3}}',
         ["zero_optimization.stage"]),
        (('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"zeropp": {"block_size": 64, "weight_bits": 4,'
          ' "block_size": 128}}, "fp16": {"enabled": true, "enabled": false}}'),
         ["zero_optimization.zeropp.block_size", "fp16.enabled"]),
        ('{"train_micro_batch_size_per_gpu": 2, "x": [{"a": 1}, {"b": 1, "b": 2}]}', ["x[1].b"]),
    ],
)
def test_json_file_with_a_duplicate_key_is_a_config_error_naming_it(tmp_path, text, repeated):
    path = tmp_path / "dup.json"
    path.write_text(text)
    assert json.loads(text)  # the plain reader takes it, keeping the last value
    message = err(path)
    assert "repeats the key" in message and str(path) in message, message
    for key in repeated:
        assert key in message, (key, message)


def test_json_file_with_the_same_key_in_different_objects_parses(tmp_path):
    path = tmp_path / "ok.json"
    config = {**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": False}}
    path.write_text(json.dumps(config))
    c = load_config(path)
    assert c.fp16.enabled and not c.bf16.enabled and c == load_config(config)


# ---- zero_optimization.zeropp.entry_check_timeout ---------------------------------------------------------------


@pytest.mark.parametrize("given", [0.5, 2, 300, 1e6])
def test_entry_check_timeout_takes_positive_seconds(given):
    assert zero(zeropp={"entry_check_timeout": given}).zero_optimization.zeropp.entry_check_timeout == given


@pytest.mark.parametrize(
    "given, needles",
    [
        (0, ["entry_check_timeout=0 must be a number of seconds above 0 and at most 1000000"]),
        (-5, ["entry_check_timeout=-5 must be a number of seconds above 0"]),
        (1e7, ["entry_check_timeout=1e+07", "at most 1000000"]),
        ("60s", ["entry_check_timeout='60s' must be a finite number"]),
        (float("inf"), ["entry_check_timeout=inf must be a finite number"]),
        (True, ["entry_check_timeout=True must be a finite number"]),
        (None, ["entry_check_timeout=None must be a finite number"]),
        ("auto", ["'auto'", "zero_optimization.zeropp.entry_check_timeout"]),
    ],
)
def test_entry_check_timeout_rejects_what_is_not_positive_seconds(given, needles):
    message = err({**BASE, "zero_optimization": {"zeropp": {"entry_check_timeout": given}}})
    for needle in needles:
        assert needle in message, (needle, message)
    assert message.count("entry_check_timeout") == 1 or given == "auto", message  # one line, no follow-on problem



def test_gradient_rotation():
    """``zeropp.gradient_rotation`` reaches the engine as the rotation's block size, with qgZ only; its sizes are
    zeropp.quant's."""
    from zeropp.config.blocks import GRADIENT_ROTATION_SIZES
    from zeropp.quant import ROTATION_SIZES

    assert GRADIENT_ROTATION_SIZES == ROTATION_SIZES
    qgz = {"zero_quantized_gradients": True}
    assert cfg(zero_optimization=qgz).zero.gradient_rotation is None
    on = {**qgz, "zeropp": {"gradient_rotation": "hadamard"}}
    assert cfg(zero_optimization=on).zero.gradient_rotation == 32
    sized = {**qgz, "zeropp": {"gradient_rotation": "hadamard", "gradient_rotation_size": 128}}
    assert cfg(zero_optimization=sized).zero.gradient_rotation == 128
    # the size alone (rotation off) is not checked against a small block size
    small = {**qgz, "zeropp": {"gradient_rotation": None, "block_size": 16}}
    assert cfg(zero_optimization=small).zero.gradient_rotation is None
