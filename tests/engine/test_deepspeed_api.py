"""DeepSpeed's surface beyond initialize/backward/step, as scripts and the Trainer call it: ``zeropp.init_distributed``,
``zeropp.add_config_arguments``, the ``zeropp.zero`` namespace (``Init``, ``GatheredParameters``) and the engine's
``zero_optimization_stage()``, ``gradient_clipping()``, ``fp16_enabled()``, ``bf16_enabled()``, ``dp_world_size``,
``save_fp16_model()`` and ``destroy()``.

One torchrun launch (2 ranks, gloo) of deepspeed_script.py, a script written for DeepSpeed with ``import zeropp as
deepspeed``; the in-process cases need no process group.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zeropp
from zeropp.config import ConfigError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from deepspeed_script import Net  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "steps_per_print": 1000,
}


def test_deepspeed_script_under_torchrun(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, ZEROPP_QUANT_BACKEND="torch", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "deepspeed_script.py"), "--deepspeed", "--deepspeed_config", str(config), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]

    saved = torch.load(out / "pytorch_model.bin", weights_only=True)
    plain = Net().to(torch.bfloat16)
    plain.load_state_dict(saved)  # the plain model loads the 16-bit file
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
    with torch.no_grad():
        plain_loss = plain((x.to(torch.bfloat16), y)).item()
    trainable = torch.load(out / "trainable.bin", weights_only=True)
    assert sorted(trainable) == sorted(k for k in saved if k != "layers.0.bias")

    for r in results:
        assert (r["backend"], r["world"], r["deepspeed_flag"]) == ("gloo", 2, True)
        assert (r["stage"], r["clipping"], r["fp16"], r["bf16"], r["bfloat16"], r["dp_world_size"]) == \
            (3, 0.5, False, True, True, 2)
        assert r["saved"] is True and r["saved_trainable"] is True
        # the 16-bit file: the engine's consolidated fp32 weights cast to bf16 (frozen ones as held), every rank's
        assert saved.keys() == r["consolidated"].keys()
        for key, value in r["consolidated"].items():
            assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], value.to(torch.bfloat16)), key
        # GatheredParameters(modifier_rank=0): rank 0's in-place change became the weights on every rank, and the
        # engine's forward computes with them as the plain model does
        assert r["gathered_shape"] == (4, 16)
        assert (r["consolidated"]["head.weight"] == 0.25).all()
        assert r["loss"] == plain_loss
        assert r["after_destroy"].startswith("EngineUsageError: forward() after engine.destroy()")
        assert r["stage2"] == (2, 0.0, False, False) and r["stage2_after_destroy"] == (True, True)
    # parameters of no engine: the block is a no-op, each rank keeps its own change
    assert [float(r["plain_weight"][0, 0]) for r in results] == [0.0, 1.0]


def test_add_config_arguments():
    parser = zeropp.add_config_arguments(argparse.ArgumentParser())
    assert vars(parser.parse_args([])) == {"deepspeed": False, "deepspeed_config": None, "deepscale": False,
                                           "deepscale_config": None}
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"


def test_initialize_reads_the_config_from_args_as_deepspeed():
    model = Net()
    both = argparse.Namespace(deepspeed_config="a.json")
    with pytest.raises(ConfigError, match="both in args.deepspeed_config"):
        zeropp.initialize(args=both, model=model, config=CONFIG)
    old_and_new = argparse.Namespace(deepspeed_config="a.json", deepscale_config="b.json")
    with pytest.raises(ConfigError, match="both deepscale_config and deepspeed_config"):
        zeropp.initialize(args=old_and_new, model=model)


def test_init_distributed_without_a_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    with pytest.raises(RuntimeError, match=r"\$MASTER_PORT, \$RANK, \$WORLD_SIZE not set.*torchrun"):
        zeropp.init_distributed()
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        zeropp.init_distributed(dist_init_required=False)
    assert not torch.distributed.is_initialized()


def test_gathered_parameters_outside_an_engine():
    layer = nn.Linear(3, 2)
    with zeropp.zero.GatheredParameters(layer.parameters(), modifier_rank=0):  # plain parameters: a no-op
        with torch.no_grad():
            layer.weight.fill_(2.0)
    assert (layer.weight == 2.0).all()
    with zeropp.zero.GatheredParameters(layer.weight, enabled=False):
        pass
    with pytest.raises(ValueError, match="fwd_module"):
        zeropp.zero.GatheredParameters(layer.weight, fwd_module=layer)
    with zeropp.zero.Init():
        meta = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="meta device.*zeropp.initialize"):
        zeropp.zero.GatheredParameters(meta.parameters(), modifier_rank=0)
    assert zeropp.zero.Init is zeropp.Init  # one Init, whichever name the script uses
