"""Workers for test_rules.py (``zero_optimization.zeropp.rules``), run on every rank by ``engine_launch.launch``: one
launch trains the tiny GPT under several rule sets and the exact runs they are compared with, and returns what each
saw (the weights its first forward computed with, the gradients its first backward reduced, the bytes of its first
step, its losses, its unit layout)."""

from __future__ import annotations

import torch

import zeropp
from zeropp.config import ConfigError
from zeropp.models import GPT

from engine_workers import MODEL, text_batches

MICRO = 2
EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def config(stage: int, zero: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, **EVERY_GATHER, **(zero or {})},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}}


def whole(engine, attr: str) -> dict[str, torch.Tensor]:
    """Each trainable parameter's ``attr`` (``"master"`` or ``"grad_shard"``), whole (an exact all-gather of each
    unit's shards), by name."""
    out = {}
    for unit in engine.units:
        full = torch.empty(unit.full.numel())
        zeropp.comm.all_gather(getattr(unit, attr), topology=engine.topology, out=full)
        for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
            out[name] = full[off : off + shape.numel()].view(shape).clone()
    return out


def capture_forward(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    """Hooks recording each parameter's values when the module holding it runs forward (the first time): the
    weights the model computes with (gathered, dequantized under qwZ)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    first = {id(p): n for n, p in model.named_parameters()}  # a tied parameter by its first name
    for module in model.modules():
        own = [(first[id(p)], p) for p in module.parameters(recurse=False)]
        if own:
            def hook(_m, _args, own=own):
                for n, p in own:
                    seen.setdefault(n, p.detach().clone())
            handles.append(module.register_forward_pre_hook(hook))
    return seen, handles


def local_gradient_max(rank: int, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Per parameter, the largest |gradient| any rank's micro-batch gives (plain torch, the initial weights): what
    bounds the qgZ error of the average."""
    model = GPT(MODEL, seed=0)
    lo = rank * MICRO
    _, loss = model(inputs[lo : lo + MICRO], targets[lo : lo + MICRO])
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    amax = torch.stack([p.grad.abs().max() for _, p in model.named_parameters()])
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(names, amax.tolist()))


def train(rank: int, world: int, cfg: dict, steps: int, save: str | None = None, freeze: tuple[str, ...] = ()) -> dict:
    """Train ``steps`` steps; record the first forward's weights, first backward's reduced gradients, the first
    step's bytes, the losses, the units' layout and the final masters; ``save``: a checkpoint before the last step
    (and the masters then); ``freeze``: names of parameters made frozen."""
    model = GPT(MODEL, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in freeze)
    engine, _, _, _ = zeropp.initialize(model=model, config=cfg)
    weights, handles = capture_forward(model)
    losses, grads, traffic = [], {}, {}
    for step, (inputs, targets) in enumerate(text_batches(steps, MICRO * world)):
        zeropp.comm.reset_stats()
        lo = rank * MICRO
        _, loss = engine(inputs[lo : lo + MICRO], targets[lo : lo + MICRO])
        engine.backward(loss)
        if step == 0:
            for h in handles:
                h.remove()
            traffic = zeropp.comm.stats()
            grads = whole(engine, "grad_shard")
            zeropp.comm.reset_stats()  # the step's own bytes (stages 1-2: the post-step gather) are added below
        engine.step()
        if step == 0:
            for kind, counts in zeropp.comm.stats().items():
                for field, n in counts.items():
                    traffic[kind][field] += n
        mean = torch.tensor([loss.item()])
        engine.comm.all_reduce_sum(mean)
        losses.append(mean.item() / world)
        if save is not None and step == steps - 2:
            engine.save_checkpoint(save, tag="t")
            at_save = whole(engine, "master")
    stage = cfg["zero_optimization"]["stage"]
    return {"at_save": at_save if save is not None else {}, "weights": weights, "grads": grads, "traffic": traffic,
            "losses": losses, "masters": whole(engine, "master"),
            # stages 1-2: the whole parameters the post-step gather wrote
            "whole_params": {n: p.detach().clone() for n, p in model.named_parameters()} if stage < 3 else {},
            "units": [{"name": u.name, "shard": u.shard_numel, "params": list(u.param_names),
                       "frozen": [] if u.frozen is None else list(u.frozen.param_names),
                       "frozen_shard": 0 if u.frozen is None else u.frozen.shard_numel,
                       "bits": (u.comm.weight_bits, u.comm.gradient_bits)} for u in engine.units]}


def rules_runs(rank: int, world: int, runs: dict[str, dict], steps: int, ckpt: str) -> dict:
    """Every run of ``runs`` (name -> ``{"stage": s, "zero": {...}}``), ``steps`` steps each (the one named
    ``"save"`` in ``runs`` saves a checkpoint under ``ckpt``); then the checkpoint loaded into a fresh engine of the
    same rules and of exact ZeRO-3, their masters and one more step's loss; the first step's local gradient bounds;
    and the messages of rule sets ``initialize`` refuses."""
    out: dict = {"runs": {}}
    for name, run in runs.items():
        cfg = config(run.get("stage", 3), run.get("zero"))
        out["runs"][name] = train(rank, world, cfg, steps, save=ckpt if run.get("save") else None,
                                  freeze=tuple(run.get("freeze", ())))
    inputs, targets = text_batches(1, MICRO * world)[0]
    out["grad_max"] = local_gradient_max(rank, inputs, targets)

    saved = next(name for name, run in runs.items() if run.get("save"))
    loads = {}
    for label, zero in (("same", runs[saved].get("zero")), ("exact", None)):
        model = GPT(MODEL, seed=1)  # other weights: the load must replace them all
        engine, _, _, _ = zeropp.initialize(model=model, config=config(3, zero))
        engine.load_checkpoint(ckpt, tag="t")
        loads[label] = {"masters": whole(engine, "master")}
        if label == "same":  # the saved run's last step again
            inputs, targets = text_batches(steps, MICRO * world)[-1]
            lo = rank * MICRO
            _, loss = engine(inputs[lo : lo + MICRO], targets[lo : lo + MICRO])
            engine.backward(loss)
            engine.step()
            loads[label]["masters_after"] = whole(engine, "master")
    out["loads"] = loads

    errors = {}
    for label, rules in (("no_match", [{"match": r"^nothing_here", "weight_bits": None}]),
                         ("shadowed", [{"match": r"ln_", "weight_bits": None}, {"match": r"ln_1", "weight_bits": 4}])):
        try:
            zeropp.initialize(model=GPT(MODEL, seed=0),
                              config=config(3, {"zero_quantized_weights": True, "zeropp": {"rules": rules}}))
        except ConfigError as e:
            errors[label] = str(e)
    out["errors"] = errors
    return out
