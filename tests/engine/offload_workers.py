"""Workers for test_offload.py: the same training with the optimizer's side on the device, on the CPU and on NVMe
swap files (``zeropp.engine.offload``), with the compute shards in host memory or NVMe swap files
(``zeropp.engine.param_offload``), and the faults of the swap files."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from engine_workers import MODEL, text_batches

import zeropp
from zeropp.engine.checkpoint_files import CheckpointError
from zeropp.engine.offload import OffloadError
from zeropp.models import GPT


def _config(zero: dict, tier: dict, *, dtype: str, accumulation: int, clipping: float) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": clipping, "zero_optimization": {**zero, **tier},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    return config


def _train(engine, rank: int, world: int, steps: int, accumulation: int, seed: int,
           spoil: int | None = None) -> list[float]:
    """Train ``steps`` steps; with ``spoil``, the last rank puts a NaN into one gradient element in micro-step
    ``spoil`` (the engine skips that step: ``nonfinite_gradients`` "skip")."""
    losses = []
    weight = next(p for p in engine.module.parameters() if p.requires_grad)
    for micro, (inputs, targets) in enumerate(text_batches(steps * accumulation, 2 * world, seed=seed)):
        _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        handle = None
        if micro == spoil and rank == world - 1:
            handle = weight.register_hook(lambda g: g.clone().view(-1).index_fill_(0, torch.tensor([3]),
                                                                                   float("nan")).view_as(g))
        engine.backward(loss)
        if handle is not None:
            handle.remove()
        engine.step()
        losses.append(loss.item())
    return losses


def _swapped_shards(engine) -> list[torch.Tensor]:
    """The compute shards (trainable and frozen) the parameter tier keeps in swap files."""
    flats = [f for unit in engine.units for f in (unit, unit.frozen) if f is not None]
    return [f.shard for f in flats if f.shard_swap is not None]


def _count_resident(engine, model) -> list[int]:
    """Forward pre-hooks on every module recording how many swapped shards hold storage (a list, appended to)."""
    counts: list[int] = []
    for module in model.modules():
        module.register_forward_pre_hook(lambda *_: counts.append(
            sum(t.untyped_storage().nbytes() > 0 for t in _swapped_shards(engine))))
    return counts


def tiers(rank: int, world: int, cases: dict[str, dict], runs: dict[str, dict], nvme: str,
          steps: int = 3) -> dict[str, dict[str, dict]]:
    """For each case (``zero`` keys, ``dtype``, ``accumulation``, ``clipping``, ``frozen``, ``meta``: the model built
    on the meta device under ``zeropp.Init``, ``spoil``: a NaN gradient in that micro-step, ``only``: the runs to
    make, default all) and each run (its keys merged into ``zero_optimization``; ``{nvme}`` in a path becomes
    ``nvme``): train ``steps`` steps; return the losses, the whole fp32 masters (``consolidated_state_dict``), for
    NVMe runs what the swap spaces held at the start and at the end, whether the masters and states held no memory
    after ``initialize`` and the most units whose optimizer side was in memory at once (from ``initialize`` to the
    end) with ``buffer_count``, and with ``memory_budget`` the placement the first step chose."""
    out: dict[str, dict[str, dict]] = {}
    for case_name, case in cases.items():
        out[case_name] = {}
        for run_name, tier in runs.items():
            if run_name not in case.get("only", runs):
                continue
            stage3_only = "offload_param" in tier or tier.get("offload_optimizer", {}).get("ratio", 1) < 1
            if stage3_only and case["zero"]["stage"] != 3:
                continue  # parameter offload and partial optimizer offload are stage-3 tiers
            tier = {k: {kk: (vv.format(nvme=nvme) if isinstance(vv, str) else vv) for kk, vv in v.items()}
                    if isinstance(v, dict) else v for k, v in tier.items()}
            config = _config(case["zero"], tier, dtype=case.get("dtype", "fp32"),
                             accumulation=case.get("accumulation", 1), clipping=case.get("clipping", 0.0))
            if case.get("meta"):
                with zeropp.Init():
                    model = GPT(MODEL)
            else:
                model = GPT(MODEL, seed=0)
            if case.get("frozen"):
                model.blocks[0].requires_grad_(False)
            engine, _, _, _ = zeropp.initialize(
                model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad],
                init_seed=0 if case.get("meta") else None)
            swap, param_swap = engine.offload.swap, engine.param_offload.swap
            files = sorted(os.listdir(swap.directory)) if swap is not None else []
            param_files = sorted(os.listdir(param_swap.directory)) if param_swap is not None else []
            stepped = [u for u, unit in enumerate(engine.units) if unit.master.numel()]
            released = (engine.offload.nvme
                        and all(t.untyped_storage().nbytes() == 0 for u, unit in enumerate(engine.units)
                                for t in [unit.master, *(v[u] for v in engine.optimizer.state.values())]
                                if t.numel()))
            resident = _count_resident(engine, model)
            losses = _train(engine, rank, world, steps, case.get("accumulation", 1), seed=7, spoil=case.get("spoil"))
            peak = (engine.offload.peak_resident, engine.offload.config.buffer_count)
            param_released = all(t.untyped_storage().nbytes() == 0 for t in _swapped_shards(engine))
            masters = engine.consolidated_state_dict()
            directory = swap.directory if swap is not None else None
            files_after = sorted(os.listdir(directory)) if directory else []
            swapped_out = [u for u, unit in enumerate(engine.units)
                           if unit.master.numel() and unit.master.untyped_storage().nbytes() == 0]
            reloaded = None
            if engine.placement is not None:  # a checkpoint of units in memory and on NVMe loads back exactly
                engine.save_checkpoint(os.path.join(nvme, f"ckpt-{case_name}"), tag="t")
                _train(engine, rank, world, 1, case.get("accumulation", 1), seed=8)
                engine.load_checkpoint(os.path.join(nvme, f"ckpt-{case_name}"), tag="t")
                reloaded = engine.consolidated_state_dict()
            directories = [s.directory for s in (swap, param_swap) if s is not None]
            engine.destroy()
            out[case_name][run_name] = {
                "losses": losses, "masters": masters, "files": files, "released": released, "stepped": stepped,
                "left": any(os.path.exists(d) for d in directories), "skipped": engine.skipped_steps, "peak": peak,
                "files_after": files_after, "swapped_out": swapped_out, "placement": _placement(engine),
                "reloaded": reloaded,
                "param_files": param_files, "param_released": param_released, "most_resident": max(resident),
                "param_read": engine.param_offload.counters["bytes_read"],
                "reads_ahead": engine.param_offload.counters["reads_ahead"],
                "shards": [(u, kind, f.shard_numel) for u, unit in enumerate(engine.units)
                           for kind, f in (("shard", unit), ("frozen", unit.frozen))
                           if f is not None and not unit.persistent],
            }
    return out


def _placement(engine) -> dict | None:
    """What ``memory_budget`` chose (None without one) and the units' sizes, bytes: (master and optimizer states,
    gradient shard)."""
    if engine.placement is None:
        return None
    kinds = len(engine.optimizer.state)
    return {"tiers": list(engine.placement.tiers), "room": engine.placement.room, "used": engine.placement.used,
            "fixed": engine.placement.fixed, "offload_tiers": list(engine.offload.tiers),
            "sizes": [(4 * u.master.numel() * (1 + kinds), 4 * u.grad_shard.numel()) for u in engine.units]}


def _frozen_gpt(seed: int) -> GPT:
    model = GPT(MODEL, seed=seed)
    model.blocks[0].requires_grad_(False)
    return model


def checkpoint_across_tiers(rank: int, world: int, nvme: str, save_dir: str, phase: str) -> dict:
    """``phase`` "save": train 3 steps with the optimizer's side and the compute shards on NVMe (stage 3, bf16,
    qwZ/qgZ/hpZ on, a frozen block), save tag "t", train 2 more; return the losses of the 2 and the masters after,
    and what the save read from the optimizer's swap files. "load": at this world size, for each tier (none, cpu,
    nvme: the optimizer's side, and ``memory_budget`` with NVMe allowed), load "t" (saved with the shards on NVMe),
    return the masters right after the load and the losses of 2 more steps and the masters after; the tier "none"
    also saves tag "plain" right after its load (no parameter offload), and the tier "param_nvme" (the shards on NVMe
    only) loads "plain"; the budget run then saves (its units placed in memory and on NVMe) and loads that back into
    the same engine, and returns the masters loaded and the placement."""
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2 if world == 4 else 1}
    param_tier = {"offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "pin_memory": False},
                  "stage3_param_persistence_threshold": 0}
    nvme_tier = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                                       "pipeline_write": True, "pin_memory": False, "buffer_count": 2}}
    budget = {"offload_optimizer": {**nvme_tier["offload_optimizer"], "buffer_count": 1},
              "zeropp": {"memory_budget": {"device": 1_800_000 // world}}}
    tiers_ = {"none": {}, "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}, "nvme": nvme_tier,
              "param_nvme": param_tier, "budget": budget}
    if phase == "save":
        engine, _, _, _ = zeropp.initialize(model=_frozen_gpt(0), config=_config(
            zero, {**nvme_tier, **param_tier}, dtype="bf16", accumulation=1, clipping=1.0))
        assert engine.param_offload.shards, "nothing swapped: the save would not read shards through the swap"
        _train(engine, rank, world, 3, 1, seed=11)
        saved = engine.consolidated_state_dict()
        engine.offload.peak_resident, before = 0, engine.offload.counters["bytes_read"]
        engine.save_checkpoint(save_dir, tag="t")
        held = engine.offload.peak_resident  # the save reads pieces, never a whole unit
        read = engine.offload.counters["bytes_read"] - before
        after = _train(engine, rank, world, 2, 1, seed=12)
        out = {"saved": saved, "losses": after, "masters": engine.consolidated_state_dict(), "held": held,
               "read": read, "state_bytes": 12 * sum(unit.master.numel() for unit in engine.units),
               "units": len(engine.units)}
        engine.destroy()
        return out
    out = {}
    for name, tier in tiers_.items():
        engine, _, _, _ = zeropp.initialize(model=_frozen_gpt(5), config=_config(
            zero, tier, dtype="bf16", accumulation=1, clipping=1.0))
        engine.offload.peak_resident = 0
        engine.load_checkpoint(save_dir, tag="plain" if name == "param_nvme" else "t")
        held = engine.offload.peak_resident  # nvme: the load holds buffer_count units at a time
        if name == "none":
            engine.save_checkpoint(save_dir, tag="plain")
        loaded = engine.consolidated_state_dict()
        losses = _train(engine, rank, world, 2, 1, seed=12)
        out[name] = {"loaded": loaded, "losses": losses, "masters": engine.consolidated_state_dict(), "held": held}
        if name == "budget":
            engine.save_checkpoint(save_dir, tag=f"budget{world}")
            _train(engine, rank, world, 1, 1, seed=13)
            engine.load_checkpoint(save_dir, tag=f"budget{world}")
            out[name].update(reloaded=engine.consolidated_state_dict(), placement=_placement(engine))
        engine.destroy()
    return out


def swap_faults(rank: int, world: int, nvme: str, fault: str, victim: int, tier: str = "optimizer",
                eval_forward: bool = False, during: str = "step", save_dir: str = "") -> dict:
    """Train with NVMe offload (``tier`` "optimizer": the optimizer's side; "param": the compute shards); after 2
    steps (``during`` "load": and a checkpoint save) damage one swap file of rank ``victim`` (``fault``: "corrupt"
    flips a byte, "truncate" halves the file, "delete" removes it); return what the next step (``eval_forward``: a
    forward under ``torch.no_grad()``; ``during`` "load": the checkpoint's load into the same engine) raised on this
    rank and its type, and what a later forward raised; for "load", also the masters a new engine without offload
    loads from the checkpoint, and those saved."""
    offload = ({"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False}} if tier == "optimizer"
               else {"offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0, "pin_memory": False},
                     "stage3_param_persistence_threshold": 0})
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(
        {"stage": 3, **offload}, {}, dtype="fp32", accumulation=1, clipping=0.0))
    _train(engine, rank, world, 2, 1, seed=3)
    out = {}
    if during == "load":
        out["saved"] = engine.consolidated_state_dict()
        engine.save_checkpoint(save_dir, tag="t")
    if rank == victim:
        swap = engine.offload.swap if tier == "optimizer" else engine.param_offload.swap
        path = Path(swap.path("unit1.exp_avg" if tier == "optimizer" else "unit1.shard"))
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
    try:
        if during == "load":
            engine.load_checkpoint(save_dir, tag="t")
        elif eval_forward:
            with torch.no_grad():
                x, y = text_batches(1, 2 * world, seed=4)[0]
                engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        else:
            _train(engine, rank, world, 1, 1, seed=4)
        out["step"] = None
    except (OffloadError, CheckpointError) as e:
        out["step"], out["kind"] = str(e), type(e).__name__
    try:
        _train(engine, rank, world, 1, 1, seed=5)
        out["later"] = None
    except OffloadError as e:
        out["later"] = str(e)
    engine.destroy()
    if during == "load":
        fresh, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=5), config=_config(
            {"stage": 3}, {}, dtype="fp32", accumulation=1, clipping=0.0))
        fresh.load_checkpoint(save_dir, tag="t")
        out["reloaded"] = fresh.consolidated_state_dict()
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


def cuda_tiers(rank: int, world: int, runs: dict[str, dict], nvme: str, steps: int = 3,
               dtype: str = "bf16") -> dict[str, dict]:
    """On CUDA (one process, gloo over CUDA tensors at world size 1), in ``dtype`` ("bf16" or "fp32"): each run's
    losses, whole masters (on the host) and where the engine keeps its tensors."""
    dev = torch.device("cuda")
    out: dict[str, dict] = {}
    for name, tier in runs.items():
        tier = {k: {kk: (vv.format(nvme=nvme) if isinstance(vv, str) else vv) for kk, vv in v.items()}
                for k, v in tier.items()}
        config = _config({"stage": 3}, tier, dtype=dtype, accumulation=1, clipping=1.0)
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


def swap_setup_fault(rank: int, world: int, nvme: str, victim: int) -> str | None:
    """Initialize with NVMe offload where rank ``victim``'s ``nvme_path`` does not exist; return what initialize
    raised on this rank (``None``: it returned)."""
    path = os.path.join(nvme, "missing") if rank == victim else nvme
    tier = {"offload_optimizer": {"device": "nvme", "nvme_path": path, "pin_memory": False}}
    try:
        zeropp.initialize(model=GPT(MODEL, seed=0), config=_config({"stage": 2}, tier, dtype="fp32", accumulation=1,
                                                                    clipping=0.0))
    except OffloadError as e:
        return str(e)
    return None


def killed_during_write(rank: int, world: int, nvme: str, save_dir: str, victim: int) -> dict:
    """Train 2 steps with NVMe offload (writes pipelined), save a checkpoint, then in step 3 rank ``victim`` is
    killed (SIGKILL) while the write-behind of its second unit is in flight. The victim first writes its launcher
    result file itself (the launcher's child writes it after the worker returns, which a killed process never
    does). The others return what the step raised (type and message) and the checkpoint's masters."""
    import signal
    import sys

    import zeropp.engine.offload as offload_module

    tier = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": True, "pipeline_write": True,
                                  "pin_memory": False}}
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(
        {"stage": 3}, tier, dtype="fp32", accumulation=1, clipping=0.0))
    _train(engine, rank, world, 2, 1, seed=3)
    saved = engine.consolidated_state_dict()
    engine.save_checkpoint(save_dir, tag="t")
    if rank == victim:
        import pickle

        write = offload_module.OptimizerOffload._write

        def dying(self, u):
            transfers = write(self, u)
            if u == 1:
                with open(os.path.join(sys.argv[3], f"result{rank}.pkl"), "wb") as f:
                    pickle.dump(("ok", {"killed": True}), f)
                os.kill(os.getpid(), signal.SIGKILL)
            return transfers

        offload_module.OptimizerOffload._write = dying
    try:
        _train(engine, rank, world, 1, 1, seed=4)
        raised = None
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        raised = (type(e).__name__, str(e))
    engine.destroy()
    return {"raised": raised, "saved": saved}


def load_masters(rank: int, world: int, save_dir: str) -> dict:
    """A new engine without offload loads tag "t" of ``save_dir``: its whole masters."""
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=5), config=_config(
        {"stage": 3}, {}, dtype="fp32", accumulation=1, clipping=0.0))
    engine.load_checkpoint(save_dir, tag="t")
    return engine.consolidated_state_dict()
