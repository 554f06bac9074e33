"""DeepSpeed parity: an unmodified DeepSpeed-style script on 2 gloo ranks against a single-process torch reference
trained the same way (same data order, clipping, and the learning-rate sequence from closed forms written here),
the progress line's values, checkpoints with the scheduler, save_16bit_model, no_sync and fp16-skipped steps."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from engine_launch import launch
from parity_workers import CONFIG_A, MICRO, MLP, ONE_CYCLE, SAMPLES, dataset

WORLD = 2


def warmup_decay_linear(t: int, lo: float, hi: float, warmup: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warm-up) at iteration t; t = -1 is the value set at construction."""
    if t < 0:
        return lo
    n = max(2, warmup)
    frac = t / n if t < n else max(0.0, (total - t) / max(1.0, total - n))
    return lo + (hi - lo) * frac


def reference_a() -> dict:
    """CONFIG_A in one process: each optimizer step on the mean loss of the 8 samples both ranks see in its window,
    clip_grad_norm_, AdamW with the lr of the schedule."""
    model = MLP(seed=0)
    x, y = dataset().tensors
    sched = CONFIG_A["scheduler"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, fused=True)
    per_step = WORLD * MICRO * CONFIG_A["gradient_accumulation_steps"]
    states, norms, rank0_losses = [], [], []
    for step in range(SAMPLES // per_step):
        lo = step * per_step
        # DistributedSampler(shuffle=False) gives rank r the samples r, r + 2, ...; rank 0's micro-batches
        # of this window are samples lo + {0, 2} and lo + {4, 6}
        with torch.no_grad():
            rank0_losses.append([model((x[idx], y[idx])).item() for idx in (
                [lo, lo + 2], [lo + 4, lo + 6])])
        opt.zero_grad()
        model((x[lo:lo + per_step], y[lo:lo + per_step])).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG_A["gradient_clipping"]).item())
        for group in opt.param_groups:
            group["lr"] = warmup_decay_linear(step - 1, sched["warmup_min_lr"], sched["warmup_max_lr"],
                                              sched["warmup_num_steps"], sched["total_num_steps"])
        opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return {"states": states, "norms": norms, "rank0_losses": rank0_losses}


def close(a: dict, b: dict, tol: float = 2e-6) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for key, value in a.items():
        torch.testing.assert_close(value.float(), b[key].float(), rtol=tol, atol=tol, msg=key)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Where the script saves its checkpoint and models."""
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def runs(root) -> dict[str, list[dict]]:
    """``parity_workers.suite``: every test's worker in one launch, results by worker, then rank."""
    per_rank = launch("parity_workers:suite", WORLD, root, timeout=600, root=str(root))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def test_unmodified_deepspeed_script(runs, root):
    ref = reference_a()
    results = runs["deepspeed_script"]
    r0 = results[0]
    sched = CONFIG_A["scheduler"]["params"]
    steps = len(ref["states"])
    for r in results:
        close(r["state_dict"], ref["states"][-1])  # the weights of the single-process reference
        assert r["global_steps"] == steps and r["global_samples"] == steps * WORLD * MICRO * 2
        assert r["scheduler_iteration"] == steps - 1 and all(r["applied"]) and r["optimizer_is_engine_optimizer"]
        expected_lrs = [warmup_decay_linear(t, sched["warmup_min_lr"], sched["warmup_max_lr"],
                                            sched["warmup_num_steps"], sched["total_num_steps"]) for t in range(steps)]
        assert len(r["lrs"]) == steps and all(math.isclose(a[0], b, rel_tol=1e-12)
                                              for a, b in zip(r["lrs"], expected_lrs)), (r["lrs"], expected_lrs)
        assert r["parameters"] == sorted(name for name, _ in MLP().named_parameters())
        # a fresh engine resumed from the step-4 checkpoint ends where the uninterrupted run ended
        close(r["resumed_state_dict"], ref["states"][-1])
        assert r["resumed_iteration"] == steps - 1 and r["resumed_lr"] == r["lrs"][-1]
        assert all((v == 0.5).all() for v in r["reloaded"].values()) and r["reloaded"].keys() == r["state_dict"].keys()
        assert "unexpected keys ['nope']" in r["strict_error"] and "missing keys" in r["strict_error"]
    assert results[0]["local_rank"] == 0 and results[1]["local_rank"] == 1  # one host, 2 ranks: local = global

    # save_16bit_model: what torch.load gives back loads into the plain model and holds the reference weights
    assert r0["saved"] is True
    saved = torch.load(root / "model" / "pytorch_model.bin", weights_only=True)
    plain = MLP(seed=3)
    plain.load_state_dict(saved)
    close(plain.state_dict(), ref["states"][-1])
    if r0["safetensors_installed"]:
        from safetensors.torch import load_file

        close(load_file(root / "model" / "model.safetensors"), ref["states"][-1])
    else:
        assert "safetensors, which is not installed" in r0["safetensors"] and "pip install safetensors" in r0[
            "safetensors"]

    # the progress lines: rank 0 prints every 2 steps, the other rank never
    assert results[1]["lines"] == []
    lines = r0["lines"]
    assert len(lines) == steps // 2, lines
    for i, line in enumerate(lines):
        step = 2 * (i + 1)
        fields = dict(re.findall(r"(\S+?)=(\S+)", line))
        assert line.startswith(f"[zeropp] step={step} ")
        window = [v for s in (step - 2, step - 1) for v in ref["rank0_losses"][s]]
        assert math.isclose(float(fields["loss"]), sum(window) / len(window), rel_tol=1e-4)
        lr = warmup_decay_linear(step - 1, sched["warmup_min_lr"], sched["warmup_max_lr"],
                                 sched["warmup_num_steps"], sched["total_num_steps"])
        assert math.isclose(float(fields["lr"].strip("[]")), lr, rel_tol=1e-5)
        assert math.isclose(float(fields["grad_norm"]), ref["norms"][step - 1], rel_tol=1e-4)
        assert float(fields["samples/s"]) > 0 and float(fields["loss_scale"]) == 1.0
        assert all(float(fields[f"{phase}_ms"]) > 0 for phase in ("forward", "backward", "step"))


def one_cycle(t: int) -> tuple[float, float]:
    """DeepSpeed's OneCycle (lr, first beta) at iteration t from the cycle's position, no stairs; t = -1 is the
    value set at construction (cycle_min_lr, cycle_min_mom)."""
    p = ONE_CYCLE
    first, second = p["cycle_first_step_size"], p["cycle_second_step_size"]
    total = first + second
    if t < 0:
        return p["cycle_min_lr"], p["cycle_min_mom"]
    if t < total:
        pos = (t + 1) % total
        scale = pos / first if pos <= first else (total - pos) / second
        return (p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * scale,
                p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * scale)
    decay = 1 + p["decay_lr_rate"] * (t - total + 1) / p["decay_step_size"]
    return p["cycle_min_lr"] / decay, p["cycle_max_mom"]


def test_no_sync_user_scheduler_and_errors(runs):
    results = runs["no_sync"]
    model = MLP(seed=0)
    x, y = dataset().tensors
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    for step in range(6):
        lr, beta1 = one_cycle(step - 1)
        for group in opt.param_groups:
            group["lr"], group["betas"] = lr, (beta1, 0.99)
        opt.zero_grad()
        lo = step * 2 * WORLD * MICRO
        # no_sync with gradient_accumulation_steps 1: each rank's two micro-batch gradients add up, then the
        # ranks' sums are averaged
        halves = [x[lo:lo + WORLD * MICRO], x[lo + WORLD * MICRO:lo + 2 * WORLD * MICRO]]
        targets = [y[lo:lo + WORLD * MICRO], y[lo + WORLD * MICRO:lo + 2 * WORLD * MICRO]]
        loss = sum(model((hx[r * MICRO:(r + 1) * MICRO], hy[r * MICRO:(r + 1) * MICRO]))
                   for hx, hy in zip(halves, targets) for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
    for r in results:
        close(r["state_dict"], model.state_dict(), tol=5e-6)
        assert r["iteration"] == 5
        for step, (lr, betas) in enumerate(zip(r["lrs"], r["betas"])):
            want_lr, want_beta = one_cycle(step)
            assert math.isclose(lr, want_lr, rel_tol=1e-12) and math.isclose(betas[0], want_beta, rel_tol=1e-12)
            assert betas[1] == 0.99
        e = r["errors"]
        assert "step() inside no_sync()" in e["step_in_no_sync"]
        assert "no_sync() needs ZeRO stage 1" in e["stage3"] and "gradient_accumulation_steps" in e["stage3"]
        assert "lr_scheduler=" in e["both"] and "scheduler block" in e["both"]


def test_fp16_skipped_steps_do_not_step_the_scheduler(runs):
    for r in runs["fp16"]:
        applied = r["applied"]
        assert not applied[0] and applied[-1] and r["skipped"] == applied.count(False) >= 1, applied
        # the scheduler's iteration counts applied steps only (it starts at -1)
        assert r["iterations"] == [sum(applied[:i + 1]) - 1 for i in range(len(applied))]


def test_torch_lr_scheduler_drives_the_partitioned_optimizer(runs):
    results = runs["torch_scheduler"]
    model = MLP(seed=0)
    x, y = dataset().tensors
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    for step in range(4):  # each step: the mean loss of the WORLD * MICRO samples the ranks saw
        opt.zero_grad()
        lo = step * WORLD * MICRO
        torch.nn.functional.mse_loss(model.head(torch.tanh(model.layers[1](torch.tanh(model.layers[0](
            x[lo : lo + WORLD * MICRO]))))), y[lo : lo + WORLD * MICRO]).backward()
        opt.step()
        sched.step()
    want = {k: v.detach() for k, v in model.state_dict().items()}
    for r in results:
        assert r["is_optimizer"] and r["lrs"] == [0.02 * 0.5 ** (k + 1) for k in range(4)]
        close(r["state_dict"], want)
        assert "engine.save_checkpoint" in r["errors"]["state_dict"]
        assert "model_parameters" in r["errors"]["add_param_group"]
