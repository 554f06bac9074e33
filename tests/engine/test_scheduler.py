"""zeropp.engine.scheduler: each DeepSpeed schedule's learning-rate (and momentum) sequence against closed forms in
float64 written here, over a plain object with torch.optim-style param_groups (single process)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from zeropp.config import load_config
from zeropp.engine.scheduler import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

T = 40  # iterations checked


def optimizer(lrs=(0.1, 0.02), betas: bool = True) -> SimpleNamespace:
    groups = [{"lr": lr, **({"betas": (0.9, 0.999)} if betas else {"momentum": 0.9})} for lr in lrs]
    return SimpleNamespace(param_groups=groups, defaults=dict(groups[0]))


def run(schedule, opt) -> tuple[torch.Tensor, torch.Tensor]:
    """(lrs at construction, lrs after each of T steps) as float64 tensors of shape (groups,) and (T, groups)."""
    first = torch.tensor([g["lr"] for g in opt.param_groups], dtype=torch.float64)
    after = []
    for _ in range(T):
        schedule.step()
        after.append([g["lr"] for g in opt.param_groups])
        assert schedule.get_last_lr() == after[-1]
    return first, torch.tensor(after, dtype=torch.float64)


def warmup_gamma(t: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    n = max(2, n)
    rising = torch.log1p(t) / math.log(n) if kind == "log" else t / n
    return torch.where(t < n, rising, torch.ones_like(t))


TS = torch.arange(T, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("steps", [1, 7])
def test_warmup_lr(kind, steps):
    opt = optimizer()
    first, after = run(WarmupLR(opt, warmup_min_lr=[0.001, 0.002], warmup_num_steps=steps, warmup_type=kind), opt)
    lo = torch.tensor([0.001, 0.002], dtype=torch.float64)
    hi = torch.tensor([0.1, 0.1], dtype=torch.float64)  # warmup_max_lr defaults to the first group's lr
    torch.testing.assert_close(first, lo, rtol=0, atol=0)
    expected = lo + (hi - lo) * warmup_gamma(TS, steps, kind)[:, None]
    torch.testing.assert_close(after, expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = optimizer()
    n, total = 5, 30
    first, after = run(WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=0.01, warmup_max_lr=0.2,
                                     warmup_num_steps=n, warmup_type=kind), opt)
    assert first.tolist() == [0.01, 0.01]
    decay = torch.clamp((total - TS) / (total - n), min=0.0)
    gamma = torch.where(TS < n, warmup_gamma(TS, n, kind), decay)
    torch.testing.assert_close(after, (0.01 + 0.19 * gamma)[:, None].expand(T, 2), rtol=1e-13, atol=1e-18)
    assert after[-1].tolist() == [0.01, 0.01]  # decayed to warmup_min_lr and held


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = optimizer()
    n, total, start, floor = 6, 25, 0.1, 0.05
    first, after = run(WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=start, warmup_num_steps=n,
                                      cos_min_ratio=floor, warmup_type=kind), opt)
    assert first.tolist() == [0.0, 0.0]  # DeepSpeed's value before the start
    progress = torch.clamp((TS - n + 1) / (total - n), max=1.0)
    cosine = floor + (1 - floor) * (1 + torch.cos(math.pi * progress)) / 2
    ratio = torch.where(TS < n, start + (1 - start) * warmup_gamma(TS, n, kind), cosine)
    torch.testing.assert_close(after, ratio[:, None] * torch.tensor([0.1, 0.02], dtype=torch.float64),
                               rtol=1e-13, atol=1e-18)


@pytest.mark.parametrize("stairs", [0, 2])
def test_one_cycle(stairs):
    opt = optimizer()
    lo, hi, first_size, second_size, rate, every = 0.01, 0.1, 6, 4, 0.5, 3
    s = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, decay_lr_rate=rate, cycle_first_step_size=first_size,
                 cycle_second_step_size=second_size, cycle_first_stair_count=stairs, decay_step_size=every,
                 cycle_min_mom=0.8, cycle_max_mom=0.95, decay_mom_rate=0.1)
    assert [g["lr"] for g in opt.param_groups] == [lo, lo] and opt.param_groups[0]["betas"] == (0.8, 0.99)
    moms, lrs = [], []
    for _ in range(T):
        s.step()
        moms.append(opt.param_groups[1]["betas"])
        lrs.append([g["lr"] for g in opt.param_groups])
    total = first_size + second_size
    pos = torch.remainder(TS + 1, total)
    up, down = pos / first_size, (total - pos) / second_size
    if stairs:
        up, down = torch.floor(up * stairs) / stairs, torch.floor(down * stairs) / stairs
    scale = torch.where(pos <= first_size, up, down)
    after_cycle = 1 + rate * (TS - total + 1) / every
    lr = torch.where(TS < total, lo + (hi - lo) * scale, lo / after_cycle)
    mom = torch.where(TS < total, 0.95 - 0.15 * scale, 0.95 * (1 + 0.1 * (TS - total + 1) / every))
    torch.testing.assert_close(torch.tensor(lrs, dtype=torch.float64), lr[:, None].expand(T, 2), rtol=1e-13, atol=0)
    torch.testing.assert_close(torch.tensor([m[0] for m in moms], dtype=torch.float64), mom, rtol=1e-13, atol=0)
    assert all(m[1] == 0.99 for m in moms)


def test_one_cycle_lr_sequence():
    opt = optimizer(lrs=(0.5,))
    _, after = run(OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4), opt)
    pos = torch.remainder(TS + 1, 8)
    scale = torch.where(pos <= 4, pos / 4, (8 - pos) / 4)
    expected = torch.where(TS < 8, 0.01 + 0.09 * scale, torch.full_like(TS, 0.01))  # no decay: min lr after
    torch.testing.assert_close(after[:, 0], expected, rtol=1e-13, atol=0)


def test_one_cycle_without_betas_warns_and_leaves_momentum():
    opt = optimizer(betas=False)
    with pytest.warns(UserWarning, match="cycle_momentum is off"):
        s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1)
    s.step()
    assert opt.param_groups[0]["momentum"] == 0.9 and "betas" not in opt.param_groups[0]


def test_state_dict_resumes_the_sequence():
    opt_a, opt_b = optimizer(), optimizer()
    a = WarmupDecayLR(opt_a, total_num_steps=20, warmup_num_steps=4, warmup_type="linear")
    for _ in range(7):
        a.step()
    b = WarmupDecayLR(opt_b, total_num_steps=20, warmup_num_steps=4, warmup_type="linear")
    b.load_state_dict(a.state_dict())
    a.step()
    b.step()
    assert a.state_dict() == {"last_batch_iteration": 7} and opt_a.param_groups == opt_b.param_groups


def test_built_from_the_config_with_deepspeeds_defaults():
    c = load_config({"train_micro_batch_size_per_gpu": 1,
                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    opt = optimizer(lrs=(0.3,))
    s = build_scheduler(c.scheduler, opt)
    assert isinstance(s, WarmupLR) and s.warmup_type == "log" and s.min_lrs == [0.0] and s.max_lrs == [0.3]
    assert opt.param_groups[0]["lr"] == 0.0


@pytest.mark.parametrize("make, match", [
    (lambda o: WarmupLR(o, warmup_min_lr=[0.1]), "2 parameter groups"),
    (lambda o: WarmupLR(o, warmup_type="exp"), "'log' or 'linear'"),
    (lambda o: WarmupCosineLR(o, total_num_steps=0), "total_num_steps=0"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size=0"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make(optimizer())
