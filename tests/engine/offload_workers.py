"""Workers for test_offload.py: the same training with the optimizer's side on the device, on the CPU and on NVMe
swap files (``zeropp.engine.offload``), and the faults of the swap files."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from engine_workers import MODEL, text_batches

import zeropp
from zeropp.engine.offload import OffloadError
from zeropp.models import GPT


def _config(zero: dict, tier: dict, *, dtype: str, accumulation: int, clipping: float) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": clipping, "zero_optimization": {**zero, **tier},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    return config


def _train(engine, rank: int, world: int, steps: int, accumulation: int, seed: int) -> list[float]:
    losses = []
    for inputs, targets in text_batches(steps * accumulation, 2 * world, seed=seed):
        _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def tiers(rank: int, world: int, cases: dict[str, dict], runs: dict[str, dict], nvme: str,
          steps: int = 3) -> dict[str, dict[str, dict]]:
    """For each case (``zero`` keys, ``dtype``, ``accumulation``, ``clipping``, ``frozen``) and each run (the
    offload keys merged into ``zero_optimization``; ``{nvme}`` in a path becomes ``nvme``): train ``steps`` steps;
    return the losses, the whole fp32 masters (``consolidated_state_dict``) and, for NVMe runs, what the swap
    space held, whether the masters and states held no memory after ``initialize`` and the most units whose
    optimizer side was in memory at once (from ``initialize`` to the end) with ``buffer_count``."""
    out: dict[str, dict[str, dict]] = {}
    for case_name, case in cases.items():
        out[case_name] = {}
        for run_name, tier in runs.items():
            stage3_only = "offload_param" in tier or tier.get("offload_optimizer", {}).get("ratio", 1) < 1
            if stage3_only and case["zero"]["stage"] != 3:
                continue  # parameter offload and partial optimizer offload are stage-3 tiers
            tier = {k: {kk: (vv.format(nvme=nvme) if isinstance(vv, str) else vv) for kk, vv in v.items()}
                    for k, v in tier.items()}
            config = _config(case["zero"], tier, dtype=case.get("dtype", "fp32"),
                             accumulation=case.get("accumulation", 1), clipping=case.get("clipping", 0.0))
            model = GPT(MODEL, seed=0)
            if case.get("frozen"):
                model.blocks[0].requires_grad_(False)
            engine, _, _, _ = zeropp.initialize(
                model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad])
            swap = engine.offload.swap
            files = sorted(os.listdir(swap.directory)) if swap is not None else []
            stepped = [u for u, unit in enumerate(engine.units) if unit.master.numel()]
            released = (engine.offload.nvme
                        and all(t.untyped_storage().nbytes() == 0 for u, unit in enumerate(engine.units)
                                for t in [unit.master, *(v[u] for v in engine.optimizer.state.values())]
                                if t.numel()))
            losses = _train(engine, rank, world, steps, case.get("accumulation", 1), seed=7)
            peak = (engine.offload.peak_resident, engine.offload.config.buffer_count)
            masters = engine.consolidated_state_dict()
            directory = swap.directory if swap is not None else None
            engine.destroy()
            out[case_name][run_name] = {
                "losses": losses, "masters": masters, "files": files, "released": released, "stepped": stepped,
                "left": os.path.exists(directory) if directory else False, "peak": peak,
                "skipped": engine.skipped_steps,
            }
    return out


def checkpoint_across_tiers(rank: int, world: int, nvme: str, save_dir: str, phase: str) -> dict:
    """``phase`` "save": train 3 steps with NVMe offload (stage 3, bf16, qwZ/qgZ/hpZ on), save, train 2 more; return
    the losses of the 2 and the masters after. "load": at this world size, for each tier (none, cpu, nvme), load the
    checkpoint, return the masters right after the load and the losses of 2 more steps and the masters after."""
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2 if world == 4 else 1}
    nvme_tier = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                                       "pipeline_write": True, "pin_memory": False}}
    tiers_ = {"none": {}, "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}, "nvme": nvme_tier}
    if phase == "save":
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(
            zero, nvme_tier, dtype="bf16", accumulation=1, clipping=1.0))
        _train(engine, rank, world, 3, 1, seed=11)
        saved = engine.consolidated_state_dict()
        engine.save_checkpoint(save_dir, tag="t")
        after = _train(engine, rank, world, 2, 1, seed=12)
        out = {"saved": saved, "losses": after, "masters": engine.consolidated_state_dict()}
        engine.destroy()
        return out
    out = {}
    for name, tier in tiers_.items():
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=5), config=_config(
            zero, tier, dtype="bf16", accumulation=1, clipping=1.0))
        engine.load_checkpoint(save_dir, tag="t")
        loaded = engine.consolidated_state_dict()
        losses = _train(engine, rank, world, 2, 1, seed=12)
        out[name] = {"loaded": loaded, "losses": losses, "masters": engine.consolidated_state_dict()}
        engine.destroy()
    return out


def swap_faults(rank: int, world: int, nvme: str, fault: str, victim: int) -> dict:
    """Train with NVMe offload; after 2 steps damage one swap file of rank ``victim`` (``fault``: "corrupt" flips a
    byte, "truncate" halves the file, "delete" removes it); return what the next step raised on this rank and what
    a later forward raised."""
    tier = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False}}
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(
        {"stage": 3}, tier, dtype="fp32", accumulation=1, clipping=0.0))
    _train(engine, rank, world, 2, 1, seed=3)
    if rank == victim:
        path = Path(engine.offload.swap.path("unit1.exp_avg"))
        if fault == "corrupt":
            with open(path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0x10]))
        elif fault == "truncate":
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.unlink()
    out = {}
    try:
        _train(engine, rank, world, 1, 1, seed=4)
        out["step"] = None
    except OffloadError as e:
        out["step"] = str(e)
    try:
        _train(engine, rank, world, 1, 1, seed=5)
        out["later"] = None
    except OffloadError as e:
        out["later"] = str(e)
    engine.destroy()
    return out


def hf_templates(rank: int, world: int, paths: list[str]) -> dict[str, dict[str, dict]]:
    """Each of the Hugging Face Trainer's DeepSpeed templates (autos filled as the Trainer fills them) as it is and
    with its offload devices set to "none": 2 optimizer steps of the tiny GPT; the losses and whole masters."""
    import json

    out: dict[str, dict[str, dict]] = {}
    for path in paths:
        given = json.loads(Path(path).read_text())
        plain = json.loads(json.dumps(given))
        for key in ("offload_optimizer", "offload_param"):
            if key in plain["zero_optimization"]:
                plain["zero_optimization"][key]["device"] = "none"
        out[Path(path).name] = {}
        for name, config in (("template", given), ("no offload", plain)):
            engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=config)
            micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
            losses = []
            for inputs, targets in text_batches(2 * accumulation, micro * world, seed=9):
                _, loss = engine(inputs[micro * rank : micro * (rank + 1)], targets[micro * rank : micro * (rank + 1)])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[Path(path).name][name] = {"losses": losses, "masters": engine.consolidated_state_dict(),
                                          "tiers": [engine.offload.tier, engine.param_offload.enabled],
                                          "applied": engine.global_steps - engine.skipped_steps}
            engine.destroy()
    return out


def cuda_tiers(rank: int, world: int, runs: dict[str, dict], nvme: str, steps: int = 3) -> dict[str, dict]:
    """On CUDA (one process, gloo over CUDA tensors at world size 1): each run's losses, whole masters (on the host)
    and where the engine keeps its tensors."""
    dev = torch.device("cuda")
    out: dict[str, dict] = {}
    for name, tier in runs.items():
        tier = {k: {kk: (vv.format(nvme=nvme) if isinstance(vv, str) else vv) for kk, vv in v.items()}
                for k, v in tier.items()}
        config = _config({"stage": 3}, tier, dtype="bf16", accumulation=1, clipping=1.0)
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0).to(dev), config=config)
        unit = next(u for u in engine.units if u.master.numel())
        placed = {"master": str(unit.master.device), "grad_shard": str(unit.grad_shard.device),
                  "shard": str(unit.shard.device), "pinned": bool(unit.grad_shard.is_pinned())}
        losses = []
        for x, y in text_batches(steps, 2 * world, seed=7):
            _, loss = engine(x[2 * rank : 2 * rank + 2].to(dev), y[2 * rank : 2 * rank + 2].to(dev))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        masters = {k: v.cpu() for k, v in engine.consolidated_state_dict().items()}
        engine.destroy()
        out[name] = {"losses": losses, "masters": masters, "placed": placed}
    return out
