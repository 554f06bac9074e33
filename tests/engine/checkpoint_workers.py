"""Workers for test_checkpoint.py (checkpoints, issue 4), run on every rank by ``engine_launch.launch``: the tiny GPT
without biases, with dropout 0.1 (so a resumed run matches only if the RNG is restored), on crops of an English text.

Each worker returns what the test compares across launches: the whole fp32 master weights and optimizer state
(exact all-gathers of the shards, ``gathered_state``), losses, and error messages.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch
from engine_workers import MODEL, expect_error, gather_masters, text_batches

import zeropp
from zeropp.engine import EngineUsageError
from zeropp.engine.checkpoint import CheckpointError
from zeropp.models import GPT, GPTConfig

DROPOUT = GPTConfig.preset("tiny", bias=False, dropout=0.1)
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
          "zeropp": {"error_feedback": True}}
STEPS = 6  # global batches of every run: a resumed run takes the last ones


def config(stage: int, zero: dict | None = None, accum: int = 1, optimizer: dict | None = None, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
            "optimizer": optimizer or ADAMW, "zero_optimization": {"stage": stage, **(zero or {})}, **extra}


def make_engine(cfg: dict, seed: int = 0, model: GPTConfig = DROPOUT, groups: bool = False):
    gpt = GPT(model, seed=seed)
    params = gpt.parameters()
    if groups:  # two groups with different learning rates (restored from the checkpoint, not the config)
        params = [{"params": [p for p in gpt.parameters() if p.dim() >= 2]},
                  {"params": [p for p in gpt.parameters() if p.dim() < 2], "lr": 1e-3, "weight_decay": 0.0}]
    engine, _, _, _ = zeropp.initialize(model=gpt, model_parameters=params, config=cfg)
    return engine


def train(engine, rank: int, world: int, batches: list) -> list[float]:
    """One optimizer step per global batch; this rank's micro-batch losses (exact values, for bit comparisons)."""
    accum = engine.gradient_accumulation_steps()
    losses = []
    for inputs, targets in batches:
        for k in range(accum):
            lo = (k * world + rank) * 2
            _, loss = engine(inputs[lo : lo + 2], targets[lo : lo + 2])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def gathered_state(engine) -> dict[str, torch.Tensor]:
    """``master.<name>`` and ``<kind>.<name>``: the whole fp32 masters and optimizer state, gathered exactly."""
    out = {f"master.{n}": t for n, t in gather_masters(engine)[0].items()}
    for kind, shards in engine.optimizer.state.items():
        for unit, shard in zip(engine.units, shards):
            full = torch.empty(unit.full.numel())
            zeropp.comm.all_gather(shard, topology=engine.topology, out=full)
            for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
                out[f"{kind}.{name}"] = full[off : off + shape.numel()].view(shape).clone()
    return out


def residuals(engine) -> list[torch.Tensor]:
    return [t.clone() for u in engine.units if u.error_feedback is not None
            for t in (u.error_feedback.residual, u.error_feedback.partial_residual) if t is not None]


def scramble_rng(rank: int) -> None:
    """Move every RNG away from where the checkpoint left it (the load must put it back)."""
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)


def resume(rank: int, world: int, root: str, runs: dict[str, dict], k: int = 3) -> dict:
    """Per run: train ``k`` steps, save, train the rest (the uninterrupted run); a second engine from a differently
    seeded model loads the checkpoint and trains the rest. Returns, per run, the state saved and both runs' losses,
    final states and residuals (the test compares them bit for bit)."""
    out = {}
    for name, run in runs.items():
        cfg = config(run.get("stage", 3), run.get("zero"), run.get("accum", 1), run.get("optimizer"),
                     **run.get("extra", {}))
        batches = text_batches(STEPS, 2 * run.get("accum", 1) * world)
        engine = make_engine(cfg, groups=run.get("groups", False))
        train(engine, rank, world, batches[:k])
        if run.get("groups"):  # a learning-rate schedule: the hyperparameters come back from the checkpoint
            engine.optimizer.param_groups[0]["lr"] = 1.5e-3
        saved = gathered_state(engine)
        scale = engine.loss_scale
        path = engine.save_checkpoint(Path(root) / name, client_state={"run": name, "step": k})
        assert path == Path(root) / name / f"global_step{k}"
        losses = train(engine, rank, world, batches[k:])
        final, ef = gathered_state(engine), residuals(engine)

        scramble_rng(rank)
        resumed = make_engine(cfg, seed=1, groups=run.get("groups", False))
        got_path, client = resumed.load_checkpoint(Path(root) / name)
        assert got_path == path and client == {"run": name, "step": k}, (got_path, client)
        assert resumed.global_steps == k and resumed.micro_steps == k * run.get("accum", 1)
        assert resumed.loss_scale == scale
        loaded = gathered_state(resumed)
        resumed_losses = train(resumed, rank, world, batches[k:])
        out[name] = {"saved": saved, "loaded": loaded, "losses": losses, "resumed_losses": resumed_losses,
                     "final": final, "resumed_final": gathered_state(resumed), "residuals": ef,
                     "resumed_residuals": residuals(resumed), "scale": scale,
                     "skipped": (engine.skipped_steps, resumed.skipped_steps),
                     "lr": [g["lr"] for g in resumed.optimizer.param_groups]}
    return out


def consolidated_and_errors(rank: int, world: int, root: str) -> dict:
    """The consolidated state dict of an exact stage-3 run against ``full_parameters`` (in a plain GPT: same
    logits), its rank-0-only form, a checkpoint for the offline ``consolidate``, and the error cases."""
    engine = make_engine(config(3), model=MODEL)
    train(engine, rank, world, text_batches(2, 2 * world))
    cons = engine.consolidated_state_dict()
    assert engine.consolidated_state_dict(rank0_only=True) == {} or rank == 0
    full = engine.full_parameters()
    plain, ref = GPT(MODEL, seed=5), GPT(MODEL, seed=6)
    plain.load_state_dict(cons)  # strict: every key of the module's state dict, tied alias included
    missing, unexpected = ref.load_state_dict(full, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # full_parameters names a tied parameter once
    assert all(torch.equal(cons[n], full[n]) for n in full)
    idx = text_batches(1, 2, seed=7)[0][0]
    with torch.no_grad():
        logits_equal = torch.equal(plain.eval()(idx)[0], ref.eval()(idx)[0])
    engine.save_checkpoint(Path(root) / "exact", tag="final")

    messages = {}

    expect = functools.partial(expect_error, messages)

    accum = make_engine(config(2, accum=2), model=MODEL)
    x, y = text_batches(1, 2)[0]
    accum.backward(accum(x, y)[1])
    accum.step()  # one micro-batch of two
    expect(EngineUsageError, "save_mid_accumulation", lambda: accum.save_checkpoint(Path(root) / "never"))
    assert not (Path(root) / "never").exists()
    expect(CheckpointError, "other_model_shape", lambda: make_engine(
        config(3), model=GPTConfig.preset("tiny", bias=False, n_embd=32)).load_checkpoint(Path(root) / "exact"))
    expect(CheckpointError, "other_model_depth", lambda: make_engine(
        config(3), model=GPTConfig.preset("tiny", bias=False, n_layer=1)).load_checkpoint(Path(root) / "exact"))
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    expect(CheckpointError, "other_optimizer", lambda: make_engine(
        config(3, optimizer=sgd), model=MODEL).load_checkpoint(Path(root) / "exact"))
    fresh = make_engine(config(3), model=MODEL)
    expect(FileNotFoundError, "missing_tag", lambda: fresh.load_checkpoint(Path(root) / "exact", tag="global_step9"))
    expect(FileNotFoundError, "missing_dir", lambda: fresh.load_checkpoint(Path(root) / "nowhere"))
    expect(FileNotFoundError, "no_latest", lambda: fresh.load_checkpoint(Path(root)))
    fresh.load_checkpoint(Path(root) / "exact")  # still loads after all that
    assert torch.equal(torch.cat([t.reshape(-1) for t in gathered_state(fresh).values()]),
                       torch.cat([t.reshape(-1) for t in gathered_state(engine).values()]))
    return {"consolidated": cons, "logits_equal": logits_equal, "messages": messages}


def reshard(rank: int, world: int, root: str, load: str, save: str | None, cfg: dict,
            topology: zeropp.comm.Topology | None = None) -> dict:
    """Load the checkpoint ``load`` (saved at another world size and layout) into an engine of config ``cfg`` over
    ``topology``'s group, return what it holds, train 2 steps (and save to ``save``). A qgZ engine starts with zero
    residuals."""
    engine, _, _, _ = zeropp.initialize(model=GPT(DROPOUT, seed=2), config=cfg, topology=topology)
    engine.load_checkpoint(Path(root) / load)
    assert all(u.error_feedback is None or u.error_feedback.residual is None for u in engine.units)
    loaded, cons = gathered_state(engine), engine.consolidated_state_dict()
    size, pos = engine.comm.world_size, engine.comm.rank
    losses = train(engine, pos, size, text_batches(2, 2 * size, seed=11))
    if save is not None:
        engine.save_checkpoint(Path(root) / save)
    return {"world_size": size, "loaded": loaded, "consolidated": cons, "losses": losses,
            "saved": gathered_state(engine), "units": [(u.align, u.shard_numel) for u in engine.units]}


def all_checks(rank: int, world: int, root: str, runs: dict[str, dict], stage1: dict, zeropp3: dict) -> dict:
    """Everything in one process group of 4 (process start-up dominates the cost): ``resume`` of ``runs``,
    ``consolidated_and_errors``, the rotated residuals of ``"zeropp"`` left out of an unrotated engine, then
    resharding: the checkpoint of the run ``"zeropp"`` (world 4) loads into a
    world-2 engine of config ``stage1`` on ranks 0 and 1 (a subgroup), whose checkpoint loads back into a world-4
    engine of config ``zeropp3``."""
    out = {"resume": resume(rank, world, root, runs), "consolidated": consolidated_and_errors(rank, world, root)}
    # the run "zeropp" saved rotated residuals: an engine without the rotation loads the rest and starts from none
    zero = runs["zeropp"]["zero"]
    unrotated = make_engine(config(3, {**zero, "zeropp": {**zero["zeropp"], "gradient_rotation": None}}, 2))
    unrotated.load_checkpoint(Path(root) / "zeropp")
    assert all(u.error_feedback is not None and u.error_feedback.residual is None for u in unrotated.units)
    del unrotated
    # and an engine with LoCo's 8-bit residuals leaves out the saved float32 ones
    if "loco-sr" in runs:
        loco = make_engine(config(3, runs["loco-sr"]["zero"]))
        loco.load_checkpoint(Path(root) / "zeropp")
        assert all(u.error_feedback is not None and u.error_feedback.residual is None for u in loco.units)
        del loco
    pair = torch.distributed.new_group([0, 1])  # every rank takes part in creating it
    if rank < 2:
        out["two"] = reshard(rank, world, root, "zeropp", "two", stage1, zeropp.comm.Topology(group=pair))
    torch.distributed.barrier()
    out["four"] = reshard(rank, world, root, "two", None, zeropp3)
    return out
