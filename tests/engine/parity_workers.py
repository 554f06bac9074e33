"""Workers for test_parity.py, run on every rank by ``engine_launch.launch``: an unmodified DeepSpeed-style training
script (written to DeepSpeed's documented API) against ``zeropp.initialize``, and the engine API around it.

``MLP``, ``dataset`` and the configs are imported by the test too, which trains the single-process reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from argparse import Namespace
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zeropp
from zeropp.engine.scheduler import OneCycle

SAMPLES, MICRO = 64, 2


class MLP(nn.Module):
    """Three units at stage 3 (two layers in a ModuleList, the head in the root); forward returns the loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(self.head(x), y)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g))


# stage 3, accumulation, clipping, the DeepSpeed WarmupDecayLR schedule, progress lines every 2 steps
CONFIG_A = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,
    "steps_per_print": 2,
    "wall_clock_breakdown": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_min_lr": 0.001,
                                                      "warmup_max_lr": 0.05, "warmup_num_steps": 3,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}
# stage 1, a user scheduler passed as a callable (OneCycle, cycling Adam's betas), no_sync accumulation
CONFIG_B = {
    "train_micro_batch_size_per_gpu": MICRO,
    "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 1},
}
ONE_CYCLE = {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 3, "cycle_second_step_size": 2,
             "decay_lr_rate": 0.5, "decay_step_size": 2, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}


def deepspeed_script(rank: int, world: int, root: str) -> dict:
    """The script, as a DeepSpeed user writes it (only the import differs)."""
    args = Namespace(local_rank=0, deepspeed_config=None)
    model = MLP(seed=0)
    model_engine, optimizer, _, lr_scheduler = zeropp.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=CONFIG_A, dist_init_required=True)
    sampler = DistributedSampler(dataset(), num_replicas=model_engine.world_size, rank=model_engine.global_rank,
                                 shuffle=False)
    loader = DataLoader(dataset(), batch_size=model_engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    out = {"local_rank": model_engine.local_rank, "lrs": [], "applied": [], "lines": []}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        for step, batch in enumerate(loader):
            batch = [t.to(model_engine.device) for t in batch]
            loss = model_engine(batch)
            model_engine.backward(loss)
            model_engine.step()
            if (step + 1) % model_engine.gradient_accumulation_steps() == 0:
                out["lrs"].append(model_engine.get_lr())
                out["applied"].append(model_engine.was_step_applied())
            if step + 1 == 8:  # four optimizer steps: save, then go on
                model_engine.save_checkpoint(Path(root) / "ckpt", client_state={"step": step})
    out["lines"] = stdout.getvalue().splitlines()
    out["global_steps"], out["global_samples"] = model_engine.global_steps, model_engine.global_samples
    out["scheduler_iteration"] = lr_scheduler.last_batch_iteration
    out["optimizer_is_engine_optimizer"] = optimizer is model_engine.optimizer
    out["state_dict"] = model_engine.state_dict()
    out["saved"] = model_engine.save_16bit_model(Path(root) / "model")
    try:
        out["safetensors"] = model_engine.save_16bit_model(Path(root) / "model", "model.safetensors")
    except ImportError as e:
        out["safetensors"] = str(e)
    out["safetensors_installed"] = importlib.util.find_spec("safetensors") is not None
    out["parameters"] = sorted(name for name, _ in model_engine.named_parameters())

    # resume from the checkpoint taken after four steps in a fresh engine (another seed): same weights, same lr
    resumed, _, _, resumed_scheduler = zeropp.initialize(model=MLP(seed=7), config=CONFIG_A)
    resumed.load_checkpoint(Path(root) / "ckpt")
    with contextlib.redirect_stdout(io.StringIO()):
        for step, batch in enumerate(loader):
            if step >= 8:
                loss = resumed(batch)
                resumed.backward(loss)
                resumed.step()
    out["resumed_state_dict"] = resumed.state_dict()
    out["resumed_lr"] = resumed.get_lr()
    out["resumed_iteration"] = resumed_scheduler.last_batch_iteration

    # load_state_dict puts whole weights into the shards: the next state_dict gives them back
    target = {k: torch.full_like(v, 0.5) for k, v in out["state_dict"].items()}
    resumed.load_state_dict(target)
    out["reloaded"] = resumed.state_dict()
    try:
        resumed.load_state_dict({"nope": torch.zeros(1)})
    except KeyError as e:
        out["strict_error"] = str(e)
    return out


def no_sync_and_user_scheduler(rank: int, world: int) -> dict:
    """Stage 1: two micro-batches per step, the first under ``no_sync``; the scheduler is a callable."""
    model = MLP(seed=0)
    engine, _, _, scheduler = zeropp.initialize(
        model=model, config=CONFIG_B, lr_scheduler=lambda opt: OneCycle(opt, **ONE_CYCLE))
    x, y = dataset().tensors
    lrs, betas = [], []
    for step in range(6):
        lo = step * 2 * world * MICRO
        first = slice(lo + rank * MICRO, lo + (rank + 1) * MICRO)
        second = slice(lo + (world + rank) * MICRO, lo + (world + rank + 1) * MICRO)
        with engine.no_sync():
            engine.backward(engine((x[first], y[first])))
        engine.backward(engine((x[second], y[second])))
        engine.step()
        lrs.append(engine.get_lr()[0])
        betas.append(engine.get_mom()[0])
    errors = {}
    with engine.no_sync():
        engine.backward(engine((x[:MICRO], y[:MICRO])))
        try:
            engine.step()
        except zeropp.engine.EngineUsageError as e:
            errors["step_in_no_sync"] = str(e)
    engine.zero_grad()
    stage3, _, _, _ = zeropp.initialize(model=MLP(), config={**CONFIG_B, "zero_optimization": {"stage": 3}})
    try:
        with stage3.no_sync():
            pass
    except zeropp.engine.EngineUsageError as e:
        errors["stage3"] = str(e)
    try:
        zeropp.initialize(model=MLP(), config=CONFIG_A, lr_scheduler=lambda opt: OneCycle(opt, **ONE_CYCLE))
    except zeropp.config.ConfigError as e:
        errors["both"] = str(e)
    return {"state_dict": engine.state_dict(), "lrs": lrs, "betas": betas, "errors": errors,
            "iteration": scheduler.last_batch_iteration}


def fp16_skipped_steps(rank: int, world: int) -> dict:
    """fp16 with a loss scale far too large: the first steps overflow and are skipped; the scheduler is stepped only
    on applied steps (DeepSpeed's rule)."""
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, scheduler = zeropp.initialize(model=MLP(), config=config)
    x, y = dataset().tensors
    applied, iterations = [], []
    for step in range(10):
        lo = (step * world + rank) * MICRO
        engine.backward(engine((x[lo:lo + MICRO].half(), y[lo:lo + MICRO].half())))
        engine.step()
        applied.append(engine.was_step_applied())
        iterations.append(scheduler.last_batch_iteration)
    return {"applied": applied, "iterations": iterations, "skipped": engine.skipped_steps}


def torch_scheduler(rank: int, world: int) -> dict:
    """Stage 3 with a ``torch.optim.lr_scheduler`` class over the engine's optimizer (as Hugging Face's
    ``get_scheduler`` builds one), the script calling ``optimizer.zero_grad()`` as torch scripts do."""
    model = MLP(seed=0)
    engine, optimizer, _, scheduler = zeropp.initialize(
        model=model, config={**CONFIG_B, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
                             "zero_optimization": {"stage": 3}},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k))
    x, y = dataset().tensors
    lrs = []
    for step in range(4):
        lo = step * world * MICRO + rank * MICRO
        optimizer.zero_grad()
        engine.backward(engine((x[lo : lo + MICRO], y[lo : lo + MICRO])))
        engine.step()
        lrs.append(scheduler.get_last_lr()[0])
    errors = {}
    for name, call in (("state_dict", optimizer.state_dict), ("add_param_group", lambda: optimizer.add_param_group({}))):
        try:
            call()
        except NotImplementedError as e:
            errors[name] = str(e)
    return {"state_dict": engine.state_dict(), "lrs": lrs, "errors": errors,
            "is_optimizer": isinstance(optimizer, torch.optim.Optimizer)}


def suite(rank: int, world: int, root: str) -> dict:
    """Every worker above in one launch (each launch costs every rank seconds of imports), each on engines of its
    own: their results by name."""
    return {"deepspeed_script": deepspeed_script(rank, world, root), "no_sync": no_sync_and_user_scheduler(rank, world),
            "fp16": fp16_skipped_steps(rank, world), "torch_scheduler": torch_scheduler(rank, world)}
