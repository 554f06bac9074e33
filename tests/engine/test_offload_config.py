"""zeropp.config.offload: DeepSpeed's offload_optimizer / offload_param / aio blocks and zeropp's memory_budget
(single process, except the engine's refusal, which runs zeropp.initialize in a child process).

The expected defaults are written out from DeepSpeed's source (deepspeed/runtime/zero/offload_config.py,
deepspeed/runtime/swap_tensor/constants.py at 0.19.6), not read from the classes under test.

The Hugging Face Trainer's templates in fixtures/hf_trainer are transformers' tests/deepspeed/ds_config_zero2.json
and ds_config_zero3.json verbatim (the files the DeepSpeed page of the transformers docs launches with); the
``*_filled.json`` files are them with the "auto" values filled in as the Trainer fills them for
``--per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 3e-5 --warmup_steps 500 --fp16``
on 2 ranks, TrainingArguments' defaults otherwise (betas 0.9/0.999, eps 1e-8, weight decay 0, max_grad_norm 1) and,
for ZeRO-3, a model of hidden size 768 (reduce_bucket_size = 768**2, stage3_prefetch_bucket_size =
int(0.9 * 768**2), stage3_param_persistence_threshold = 10 * 768).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeropp.config import (
    AioConfig,
    Config,
    ConfigError,
    MemoryBudget,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    load_config,
    to_dict,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FIXTURES = HERE / "fixtures" / "hf_trainer"
BASE = {"train_micro_batch_size_per_gpu": 2}
W = "zero_optimization"

# DeepSpeed 0.19.6's defaults, field by field
DS_OPTIMIZER_DEFAULTS = {"device": "none", "nvme_path": None, "pin_memory": True, "buffer_count": 4,
                         "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0}
DS_PARAM_DEFAULTS = {"device": "none", "nvme_path": None, "pin_memory": True, "buffer_count": 5,
                     "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
DS_AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                   "overlap_events": True}


def zero(stage: int = 3, world: int = 1, top: dict | None = None, **keys) -> Config:
    return load_config({**BASE, **(top or {}), W: {"stage": stage, **keys}}, world_size=world)


def err(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=1)
    return str(info.value)


def zero_err(stage: int = 3, top: dict | None = None, **keys) -> str:
    return err({**BASE, **(top or {}), W: {"stage": stage, **keys}})


# ---- DeepSpeed's defaults ---------------------------------------------------------------------------------------


def test_defaults_when_the_blocks_are_left_out():
    c = zero(stage=1)
    assert dataclasses.asdict(c.zero.offload_optimizer) == DS_OPTIMIZER_DEFAULTS
    assert dataclasses.asdict(c.zero.offload_param) == DS_PARAM_DEFAULTS
    assert dataclasses.asdict(c.aio) == DS_AIO_DEFAULTS
    assert c.zero.zeropp.memory_budget is None
    assert not (c.zero.offload_optimizer.enabled or c.zero.offload_param.enabled or c.zero.offload)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_defaults_of_the_keys_left_out_of_an_enabled_block(device):
    path = {"nvme_path": "/local_nvme"} if device == "nvme" else {}
    z = zero(offload_optimizer={"device": device, **path}, offload_param={"device": device, **path},
             top={"aio": {}}).zero
    assert dataclasses.asdict(z.offload_optimizer) == {**DS_OPTIMIZER_DEFAULTS, "device": device, **path}
    assert dataclasses.asdict(z.offload_param) == {**DS_PARAM_DEFAULTS, "device": device, **path}
    assert z.offload_optimizer.enabled and z.offload_param.enabled and z.offload
    assert z.offload_optimizer.nvme == z.offload_param.nvme == (device == "nvme")
    assert not z.offload_optimizer.pipeline and not z.offload_optimizer.partial


@pytest.mark.parametrize("block", [None, {}, {"device": None}, {"device": "none"}])
def test_absent_null_and_none_devices_are_off(block):
    z = zero(stage=1, offload_optimizer=block, offload_param=block).zero
    assert not z.offload_optimizer.enabled and not z.offload_param.enabled and not z.offload


# ---- every key, valid ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, given, expected", [
    ("device", "cpu", "cpu"),
    ("nvme_path", "/mnt/nvme0", "/mnt/nvme0"),
    ("nvme_path", Path("/mnt/nvme1"), "/mnt/nvme1"),
    ("pin_memory", False, False),
    ("buffer_count", 9, 9),
    ("buffer_count", 8.0, 8),
    ("pipeline_read", True, True),
    ("pipeline_write", True, True),
    ("fast_init", True, True),
    ("ratio", 0.3, 0.3),
    ("ratio", 1, 1.0),
])
def test_offload_optimizer_keys(key, given, expected):
    block = {"device": "cpu", key: given}
    got = getattr(zero(offload_optimizer=block).zero.offload_optimizer, key)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("key, given, expected", [
    ("device", "nvme", "nvme"),
    ("nvme_path", "relative/dir", "relative/dir"),
    ("pin_memory", False, False),
    ("buffer_count", 2, 2),
    ("buffer_size", 1e6, 1_000_000),
    ("max_in_cpu", 0, 0),
    ("max_in_cpu", 5e9, 5_000_000_000),
])
def test_offload_param_keys(key, given, expected):
    block = {"device": "nvme", "nvme_path": "/nvme", key: given}
    got = getattr(zero(offload_param=block).zero.offload_param, key)
    assert got == expected and type(got) is type(expected)


def test_pipeline_is_either_switch():
    for read, write in [(True, False), (False, True), (True, True), (False, False)]:
        o = zero(offload_optimizer={"device": "nvme", "nvme_path": "/n", "pipeline_read": read,
                                    "pipeline_write": write}).zero.offload_optimizer
        assert o.pipeline == (read or write)


def test_partial_offload_at_stage_3_on_cpu():
    o = zero(offload_optimizer={"device": "cpu", "ratio": 0.25}).zero.offload_optimizer
    assert o.partial and o.ratio == 0.25
    # ratio is DeepSpeed's key of the block: read (and checked) with the device off too, with no effect
    assert not zero(stage=1, offload_optimizer={"ratio": 0.5}).zero.offload_optimizer.partial


def test_deepspeed_keys_of_superoffload():
    o = zero(offload_optimizer={"device": "cpu", "super_offload": False, "cpuadam_cores_perc": 0.5})
    assert o.zero.offload_optimizer == OffloadOptimizerConfig(device="cpu")


@pytest.mark.parametrize("key, given, field, expected", [
    ("block_size", 262144, "block_size", 262144),
    ("queue_depth", 32.0, "queue_depth", 32),
    ("intra_op_parallelism", 4, "intra_op_parallelism", 4),
    ("thread_count", 3, "intra_op_parallelism", 3),  # DeepSpeed's name before 0.16.4
    ("single_submit", True, "single_submit", True),
    ("overlap_events", False, "overlap_events", False),
])
def test_aio_keys(key, given, field, expected):
    aio = zero(top={"aio": {key: given}}).aio
    assert aio == AioConfig(**{**DS_AIO_DEFAULTS, field: expected})
    assert type(getattr(aio, field)) is type(expected)


def test_aio_use_gds_false_is_accepted():
    assert zero(top={"aio": {"use_gds": False}}).aio == AioConfig(**DS_AIO_DEFAULTS)


@pytest.mark.parametrize("budget, expected", [
    ({"device": 40e9, "cpu": 100e9}, MemoryBudget(device=40_000_000_000, cpu=100_000_000_000)),
    ({"device": 1}, MemoryBudget(device=1, cpu=None)),
    ({"cpu": 2**40}, MemoryBudget(device=None, cpu=2**40)),
    ({"device": None, "cpu": 7}, MemoryBudget(device=None, cpu=7)),
    ({}, MemoryBudget()),
])
def test_memory_budget(budget, expected):
    z = zero(stage=2, offload_optimizer={"device": "cpu"}, zeropp={"memory_budget": budget}).zero
    assert z.zeropp.memory_budget == expected and z.offload
    assert all(isinstance(v, int) for v in dataclasses.asdict(z.zeropp.memory_budget).values() if v is not None)


@pytest.mark.parametrize("optimizer, param", [
    ({"device": "cpu"}, {}),
    ({}, {"device": "cpu"}),
    ({"device": "nvme", "nvme_path": "/o"}, {"device": "nvme", "nvme_path": "/p"}),
])
def test_memory_budget_with_any_block_that_lets_states_leave_the_device(optimizer, param):
    z = zero(offload_optimizer=optimizer, offload_param=param, zeropp={"memory_budget": {"device": 8e9}}).zero
    assert z.zeropp.memory_budget == MemoryBudget(device=8_000_000_000) and z.offload


def test_memory_budget_null_is_no_budget():
    z = zero(zeropp={"memory_budget": None}).zero
    assert z.zeropp.memory_budget is None and not z.offload


# ---- every key, invalid: the key and the fix, one line, nothing else ---------------------------------------------


@pytest.mark.parametrize("stage, keys, top, needles", [
    # offload_optimizer
    (3, {"offload_optimizer": {"device": "gpu"}}, {}, ["offload_optimizer.device='gpu'", '"none", "cpu" or "nvme"']),
    (3, {"offload_optimizer": {"device": "CPU"}}, {}, ["offload_optimizer.device='CPU'", "did you mean 'cpu'"]),
    (3, {"offload_optimizer": {"device": True}}, {}, ["offload_optimizer.device=True", '"cpu"']),
    (3, {"offload_optimizer": {"device": "nvme"}}, {}, ['offload_optimizer.device="nvme" needs',
                                                        "offload_optimizer.nvme_path", "add it"]),
    (3, {"offload_optimizer": {"device": "cpu", "nvme_path": ""}}, {}, ["offload_optimizer.nvme_path=''",
                                                                        "non-empty path"]),
    (3, {"offload_optimizer": {"device": "cpu", "nvme_path": 7}}, {}, ["offload_optimizer.nvme_path=7"]),
    (3, {"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}, {}, ["offload_optimizer.pin_memory='yes'",
                                                                            "true or false"]),
    (3, {"offload_optimizer": {"device": "cpu", "buffer_count": 0}}, {}, ["offload_optimizer.buffer_count=0",
                                                                          ">= 1"]),
    (3, {"offload_optimizer": {"device": "cpu", "buffer_count": 2.5}}, {}, ["offload_optimizer.buffer_count=2.5",
                                                                            "integer"]),
    (3, {"offload_optimizer": {"device": "cpu", "pipeline_read": 1}}, {}, ["offload_optimizer.pipeline_read=1"]),
    (3, {"offload_optimizer": {"device": "cpu", "pipeline_write": "no"}}, {}, ["offload_optimizer.pipeline_write"]),
    (3, {"offload_optimizer": {"device": "cpu", "fast_init": None}}, {}, ["offload_optimizer.fast_init=None"]),
    (3, {"offload_optimizer": {"device": "cpu", "ratio": 0}}, {}, ["offload_optimizer.ratio=0",
                                                                   "above 0 and at most 1"]),
    (3, {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}, {}, ["offload_optimizer.ratio=1.5", "at most 1"]),
    (3, {"offload_optimizer": {"device": "cpu", "ratio": "half"}}, {}, ["offload_optimizer.ratio='half'",
                                                                        "finite number"]),
    (2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, {}, ["offload_optimizer.ratio=0.5",
                                                                     "needs stage 3", "or the ratio to 1"]),
    (3, {"offload_optimizer": {"device": "nvme", "nvme_path": "/n", "ratio": 0.5}}, {},
     ["offload_optimizer.ratio=0.5", 'device "cpu" only']),
    (3, {"offload_optimizer": {"device": "cpu", "super_offload": True}}, {}, ["offload_optimizer.super_offload=True",
                                                                              "SuperOffload", "set it to false"]),
    (3, {"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 2}}, {},
     ["offload_optimizer.cpuadam_cores_perc=2", "at most 1"]),
    (3, {"offload_optimizer": {"device": "cpu", "pin_memmory": True}}, {},
     ["offload_optimizer.pin_memmory", "did you mean 'pin_memory'"]),
    (3, {"offload_optimizer": {"device": "cpu", "buffer_size": 5}}, {},
     ["offload_optimizer.buffer_size", "valid keys in zero_optimization.offload_optimizer"]),
    (3, {"offload_optimizer": "cpu"}, {}, ["zero_optimization.offload_optimizer must be an object"]),
    # offload_param
    (1, {"offload_param": {"device": "cpu"}}, {}, ["offload_param.device='cpu'", "stage 3 only", "set the stage to 3",
                                                   'or the device to "none"']),
    (2, {"offload_param": {"device": "nvme", "nvme_path": "/n"}}, {}, ["offload_param.device='nvme'",
                                                                       "stage 3 only"]),
    (3, {"offload_param": {"device": "disk"}}, {}, ["offload_param.device='disk'", '"nvme"']),
    (3, {"offload_param": {"device": "nvme"}}, {}, ['offload_param.device="nvme" needs', "offload_param.nvme_path"]),
    (3, {"offload_param": {"device": "cpu", "pin_memory": 0}}, {}, ["offload_param.pin_memory=0"]),
    (3, {"offload_param": {"device": "cpu", "buffer_count": -1}}, {}, ["offload_param.buffer_count=-1", ">= 1"]),
    (3, {"offload_param": {"device": "cpu", "buffer_size": 0}}, {}, ["offload_param.buffer_size=0", ">= 1"]),
    (3, {"offload_param": {"device": "cpu", "max_in_cpu": -5}}, {}, ["offload_param.max_in_cpu=-5", ">= 0"]),
    (3, {"offload_param": {"device": "cpu", "max_in_cpu": "1e9"}}, {}, ["offload_param.max_in_cpu='1e9'",
                                                                        "integer"]),
    (3, {"offload_param": {"device": "cpu", "ratio": 0.5}}, {}, ["offload_param.ratio", "valid keys"]),
    # aio
    (3, {}, {"aio": {"block_size": 0}}, ["aio.block_size=0", ">= 1"]),
    (3, {}, {"aio": {"block_size": 1000}}, ["aio.block_size=1000", "multiple of 4096", "e.g. 1048576"]),
    (3, {}, {"aio": {"queue_depth": 0}}, ["aio.queue_depth=0", ">= 1"]),
    (3, {}, {"aio": {"intra_op_parallelism": 0}}, ["aio.intra_op_parallelism=0", ">= 1"]),
    (3, {}, {"aio": {"thread_count": 0}}, ["aio.thread_count=0", ">= 1"]),
    (3, {}, {"aio": {"thread_count": 2, "intra_op_parallelism": 2}}, ["aio.thread_count is the old name of "
                                                                      "aio.intra_op_parallelism", "only one"]),
    (3, {}, {"aio": {"single_submit": "false"}}, ["aio.single_submit='false'", "true or false"]),
    (3, {}, {"aio": {"overlap_events": 1}}, ["aio.overlap_events=1"]),
    (3, {}, {"aio": {"use_gds": True}}, ["aio.use_gds=True", "GPUDirect Storage is not supported",
                                         "set it to false"]),
    (3, {}, {"aio": {"queue_dept": 4}}, ["aio.queue_dept", "did you mean 'queue_depth'"]),
    (3, {}, {"aio": [1]}, ["aio must be an object"]),
    (3, {"aio": {"block_size": 262144}}, {}, ["zero_optimization.aio", "top-level block", "move it out"]),
    # memory_budget
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"device": 0}}}, {},
     ["memory_budget.device=0", ">= 1"]),
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"cpu": -1e9}}}, {},
     ["memory_budget.cpu=-1000000000", ">= 1"]),
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"cpu": 1.5}}}, {},
     ["memory_budget.cpu=1.5", "integer"]),
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"device": "40GB"}}}, {},
     ["memory_budget.device='40GB'", "integer"]),
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"gpu": 1e9}}}, {},
     ["memory_budget.gpu", "valid keys in zero_optimization.zeropp.memory_budget: cpu, device"]),
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"nvme": 1e12}}}, {},
     ["memory_budget.nvme", "no budget", "nvme_path"]),
    (2, {"offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": 40e9}}, {},
     ["zero_optimization.zeropp.memory_budget must be an object"]),
    (3, {"zeropp": {"memory_budget": {"device": 1e9}}}, {}, ["memory_budget places states", 'are "none"',
                                                             'set either to "cpu"', "or remove memory_budget"]),
    (3, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "zeropp": {"memory_budget": {"cpu": 1e9}}}, {},
     ["offload_optimizer.ratio=0.5", "remove one of the two"]),
    (2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "zeropp": {"memory_budget": {"cpu": 1e9}}}, {},
     ["offload_optimizer.ratio=0.5", "needs stage 3"]),
    # DeepSpeed's deprecated switches point at the blocks
    (2, {"cpu_offload": True}, {}, ["zero_optimization.cpu_offload=True", 'offload_optimizer {"device": "cpu"}']),
])
def test_errors_name_the_key_and_the_fix(stage, keys, top, needles):
    message = zero_err(stage, top, **keys)
    assert "\n" not in message, message  # one problem, no follow-on lines
    for needle in needles:
        assert needle in message, (needle, message)


def test_every_problem_at_once():
    message = zero_err(2, top={"aio": {"use_gds": True, "thread_count": 0}},
                       offload_optimizer={"device": "nvme", "ratio": 2, "pin_memory": "y"},
                       offload_param={"device": "cpu", "buffer_size": 0}, reduce_bucket_size=0)
    lines = message.splitlines()
    assert lines[0] == "8 problems in the config:" and len(lines) == 9, message
    for needle in ["reduce_bucket_size=0", "offload_optimizer.ratio=2",
                   'offload_optimizer.device="nvme" needs', "offload_optimizer.pin_memory='y'",
                   "offload_param.device='cpu'", "offload_param.buffer_size=0", "aio.use_gds=True",
                   "aio.thread_count=0"]:
        assert sum(needle in line for line in lines[1:]) == 1, (needle, message)


def test_no_stage_rule_on_a_stage_that_did_not_parse():
    message = zero_err("three", offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu", "ratio": 0.5})
    assert "\n" not in message and "stage='three' must be an integer" in message


# ---- "auto" -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, keys, top, auto_key", [
    (3, {"offload_optimizer": "auto"}, {}, "zero_optimization.offload_optimizer"),
    (3, {"offload_optimizer": {"device": "auto"}}, {}, "zero_optimization.offload_optimizer.device"),
    (3, {"offload_optimizer": {"device": "nvme", "nvme_path": "auto"}}, {},
     "zero_optimization.offload_optimizer.nvme_path"),
    (3, {"offload_optimizer": {"device": "cpu", "pin_memory": "auto"}}, {},
     "zero_optimization.offload_optimizer.pin_memory"),
    (3, {"offload_optimizer": {"device": "cpu", "ratio": "auto"}}, {}, "zero_optimization.offload_optimizer.ratio"),
    (3, {"offload_param": {"device": "auto", "buffer_size": 5}}, {}, "zero_optimization.offload_param.device"),
    (1, {"offload_param": {"device": "auto"}}, {}, "zero_optimization.offload_param.device"),
    (3, {"offload_param": {"device": "cpu", "max_in_cpu": "auto"}}, {}, "zero_optimization.offload_param.max_in_cpu"),
    (3, {}, {"aio": "auto"}, "aio"),
    (3, {}, {"aio": {"queue_depth": "auto"}}, "aio.queue_depth"),
    (3, {}, {"aio": {"use_gds": "auto"}}, "aio.use_gds"),
    (3, {"zeropp": {"memory_budget": "auto"}}, {}, "zero_optimization.zeropp.memory_budget"),
    (3, {"offload_param": "auto", "zeropp": {"memory_budget": {}}}, {}, "zero_optimization.offload_param"),
    (3, {"offload_param": {"device": "auto"}, "zeropp": {"memory_budget": {}}}, {},
     "zero_optimization.offload_param.device"),
    (3, {"offload_param": {"device": "cpu"}, "zeropp": {"memory_budget": {"device": "auto"}}}, {},
     "zero_optimization.zeropp.memory_budget.device"),
])
def test_auto_is_one_line_naming_the_key(stage, keys, top, auto_key):
    message = zero_err(stage, top, **keys)
    assert "\n" not in message, message  # no follow-on problem from the placeholder
    assert "Hugging Face Trainer" in message and f"({auto_key})" in message, message


# ---- round trip -------------------------------------------------------------------------------------------------


def test_round_trip_keeps_every_offload_field():
    config = {**BASE, "aio": {"block_size": 8192, "queue_depth": 2, "intra_op_parallelism": 3,
                              "single_submit": True, "overlap_events": False},
              W: {"stage": 3,
                  "offload_optimizer": {"device": "cpu", "nvme_path": "/o", "pin_memory": False, "buffer_count": 1,
                                        "pipeline_read": True, "pipeline_write": True, "fast_init": True,
                                        "ratio": 0.5},
                  "offload_param": {"device": "nvme", "nvme_path": "/p", "pin_memory": False, "buffer_count": 1,
                                    "buffer_size": 3, "max_in_cpu": 4}}}
    c = load_config(config, world_size=2)
    for block, default in [(c.zero.offload_optimizer, OffloadOptimizerConfig()),
                           (c.zero.offload_param, OffloadParamConfig()), (c.aio, AioConfig())]:
        for f in dataclasses.fields(block):
            assert getattr(block, f.name) != getattr(default, f.name), f.name
    assert Config.parse(to_dict(c), world_size=2) == c
    assert json.loads(json.dumps(to_dict(c))) == to_dict(c)  # plain JSON values
    budget = zero(offload_param={"device": "cpu"}, zeropp={"memory_budget": {"cpu": 5}})
    assert Config.parse(to_dict(budget)) == budget


# ---- the Hugging Face Trainer's templates -----------------------------------------------------------------------


def autos(value, where: str = "") -> dict[str, object]:
    """Dotted key -> value of every leaf of a JSON document."""
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, item in value.items():
            out.update(autos(item, f"{where}.{key}" if where else key))
        return out
    return {where: value}


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_hf_fixture_is_the_template_with_only_its_autos_filled(name):
    template = autos(json.loads((FIXTURES / f"ds_config_{name}.json").read_text()))
    filled = autos(json.loads((FIXTURES / f"ds_config_{name}_filled.json").read_text()))
    assert set(filled) == set(template)
    changed = {key for key in template if filled[key] != template[key]}
    assert changed == {key for key, value in template.items() if value == "auto"}
    # and the published template, as is, is one error naming exactly those keys
    message = str(pytest.raises(ConfigError, load_config, FIXTURES / f"ds_config_{name}.json", world_size=2).value)
    assert "\n" not in message and all(key in message for key in changed), message


def test_hf_trainer_zero2_cpu_offload_template():
    c = load_config(FIXTURES / "ds_config_zero2_filled.json", world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 4, 2)
    assert c.fp16.enabled and c.fp16.dynamic and not c.bf16.enabled and c.gradient_clipping == 1.0
    z = c.zero
    assert z.stage == 2 and z.overlap_comm
    assert (z.reduce_bucket_size, z.allgather_bucket_size) == (200_000_000, 200_000_000)
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", nvme_path=None, pin_memory=True,
                                                         buffer_count=4, pipeline_read=False, pipeline_write=False,
                                                         fast_init=False, ratio=1.0)
    assert z.offload_param == OffloadParamConfig() and not z.offload_param.enabled
    assert z.offload_optimizer.enabled and not z.offload_optimizer.nvme and z.offload
    assert z.zeropp.memory_budget is None and c.aio == AioConfig()
    assert c.optimizer.type == "AdamW" and c.optimizer.params["lr"] == 3e-5
    assert c.optimizer.params["betas"] == (0.9, 0.999) and c.optimizer.params["weight_decay"] == 0.0
    assert c.scheduler.type == "WarmupLR" and c.scheduler.params["warmup_num_steps"] == 500
    assert (c.steps_per_print, c.wall_clock_breakdown) == (2000, False)


def test_hf_trainer_zero3_cpu_offload_template():
    c = load_config(FIXTURES / "ds_config_zero3_filled.json", world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 4, 2)
    assert c.fp16.enabled and not c.bf16.enabled
    z = c.zero
    assert z.stage == 3 and z.overlap_comm and z.sub_group_size == 10**14
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        589_824, 530_841, 7_680)
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (10**9, 10**9)
    assert z.stage3_gather_16bit_weights_on_model_save
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
    assert z.offload_param == OffloadParamConfig(device="cpu", nvme_path=None, pin_memory=True, buffer_count=5,
                                                 buffer_size=100_000_000, max_in_cpu=1_000_000_000)
    assert z.offload_optimizer.enabled and z.offload_param.enabled and not z.offload_param.nvme
    assert z.zeropp.memory_budget is None and c.aio == AioConfig()


# ---- the engine refuses what it does not run yet ------------------------------------------------------------------

_INITIALIZE_CHILD = r"""
import json, sys
import torch
import torch.distributed as dist
import zeropp
from zeropp.config import ConfigError

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
for name, zero in json.loads(sys.argv[2]).items():
    try:
        zeropp.initialize(model=torch.nn.Linear(4, 4), config={**base, "zero_optimization": zero})
        print(json.dumps([name, "initialized"]))
    except ConfigError as e:
        print(json.dumps([name, str(e)]))
dist.destroy_process_group()
"""


def test_initialize_runs_every_offload_tier_and_the_memory_budget(tmp_path):
    cases = {
        "no offload": {"stage": 3, "offload_optimizer": {"device": "none", "pin_memory": False}},
        "optimizer cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer nvme": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "param cpu": {"stage": 3, "offload_param": {"device": "cpu"}},
        "param nvme": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "budget": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "zeropp": {"memory_budget": {"device": 1e9}}},
    }
    proc = subprocess.run([sys.executable, "-c", _INITIALIZE_CHILD, str(tmp_path / "store"), json.dumps(cases)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
                          env={**os.environ, "ZEROPP_QUANT_BACKEND": "torch"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
    for name in cases:
        assert got[name] == "initialized", (name, got[name])
