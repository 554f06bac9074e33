"""zeropp.config: DeepSpeed-style parsing, batch-size arithmetic and every error path (single process)."""

from __future__ import annotations

import json

import pytest

from zeropp.config import Config, ConfigError, load_config

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
        ({**BASE, "scheduler": {"type": "WarmupLR"}}, 1, ["scheduler", "does not support"]),
        ({**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, 1,
         ["zero_optimization.offload_optimizer", "does not support", "offload"]),
        ({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, 1,
         ["offload_param", "does not support"]),
        ({**BASE, "zero_optimization": {"sub_group_size": 1e9}}, 1, ["sub_group_size", "does not support"]),
        ({**BASE, "zero_optimization": {"stage": 0}}, 1, ["stage=0", "not supported"]),
        ({**BASE, "zero_optimization": {"contiguous_gradients": False}}, 1,
         ["contiguous_gradients=False", "not supported"]),
        ({**BASE, "fp16": {"enabled": True, "auto_cast": True}}, 1, ["fp16.auto_cast", "does not support"]),
        ({**BASE, "optimizer": {"type": "OneBitAdam"}}, 1, ["OneBitAdam", "does not support"]),
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
        ({**BASE, "zero_optimization": {"zeropp": {"gradient_bits": 16}}}, 1, ["gradient_bits=16", "8 or 4"]),
        ({**BASE, "zero_optimization": {"zeropp": {"block_size": 100}}}, 1, ["block_size=100", "power of two"]),
        ({**BASE, "zero_optimization": {"zeropp": {"error_feedback": True}}}, 1,
         ["error_feedback", "zero_quantized_gradients"]),
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
