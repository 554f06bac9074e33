"""DeepSpeed's learning-rate schedules (``deepspeed.runtime.lr_schedules``), formula for formula, over any optimizer
with torch.optim-style ``param_groups`` (the engine's ``PartitionedOptimizer``, which reads ``group["lr"]`` again at
every step, or a ``torch.optim.Optimizer``).

The protocol is DeepSpeed's (``torch.optim.lr_scheduler`` classes work on the engine's optimizer too, stepped the
same way): ``step()`` advances ``last_batch_iteration`` by one and writes ``get_lr()`` into every
group's ``"lr"``; ``get_last_lr()``, ``state_dict()`` / ``load_state_dict()`` (``{"last_batch_iteration": i}``).
Constructed with ``last_batch_iteration=-1`` (a fresh start), every schedule but ``OneCycle`` writes its value at
iteration -1 at once (``WarmupLR``/``WarmupDecayLR``: ``warmup_min_lr``; ``WarmupCosineLR``: 0), so the first
optimizer step runs with it, as in DeepSpeed. ``ZeroEngine.step`` calls ``step()`` after every optimizer step that
was applied (not after an fp16-skipped one: DeepSpeed's rule), so the optimizer step number ``k`` (0-based) runs
with the learning rate of iteration ``k - 1``.

Formulas, for iteration ``t`` (``last_batch_iteration``), per parameter group:

* ``WarmupLR``: ``min_lr + (max_lr - min_lr) * gamma(t)``, with ``N = max(2, warmup_num_steps)`` and
  ``gamma = log(t + 1) / log(N)`` (``warmup_type="log"``) or ``t / N`` (``"linear"``) while ``t < N``, then 1;
* ``WarmupDecayLR``: the same warm-up, then ``gamma = max(0, (total_num_steps - t) / max(1, total_num_steps -
  N))``;
* ``WarmupCosineLR``: ``lr0 * ratio(t)``, ``lr0`` each group's lr at construction: while ``t < N``, ``ratio =
  warmup_min_ratio + (1 - warmup_min_ratio) * gamma(t)``; after, with ``s = min(1, (t - N + 1) / max(1,
  total_num_steps - N))``, ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * s)) / 2)``;
* ``OneCycle``: with ``T = first + second`` step sizes and ``x`` the position in the cycle of ``t + 1``, the scale
  rises ``x / r`` (``r = first / T``) then falls ``(x - 1) / (r - 1)`` (quantized to ``floor(stair position) /
  stairs`` when a stair count is set); ``lr = min + (max - min) * scale`` while ``t < T``; after,
  ``cycle_min_lr / (1 + decay_lr_rate * (t - T + 1) / decay_step_size)`` (just ``cycle_min_lr`` without decay).
  With ``cycle_momentum`` (Adam/AdamW, whose groups have ``betas``), ``betas = (max_mom - (max_mom - min_mom) *
  scale, 0.99)`` in the cycle and ``(max_mom * (1 + decay_mom_rate * (t - T + 1) / decay_step_size), 0.99)``
  after; at construction ``lr = cycle_min_lr`` and ``betas = (cycle_min_mom, 0.99)`` (DeepSpeed's constant 0.99
  replaces the second beta). An optimizer without ``betas`` (SGD) gets no momentum cycle (a warning, as DeepSpeed).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import SchedulerConfig


class LRSchedule:
    """The DeepSpeed scheduler protocol over ``optimizer.param_groups`` (see the module docstring); subclasses give
    ``get_lr``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass the engine's optimizer")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        """The learning rate of every parameter group at ``last_batch_iteration``."""
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next iteration) and write its learning rates."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._write()

    def _write(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The learning rates last written."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr() before any step(); call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]

    def _per_group(self, value: float | Sequence[float], name: str) -> list[float]:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise ValueError(f"{name} has {len(value)} values but the optimizer has {groups} parameter groups; "
                                 "give one number or one per group")
            return [float(v) for v in value]
        return [float(value)] * groups

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type={warmup_type!r} must be 'log' or 'linear'")
    return warmup_type


def _positive_steps(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


class WarmupLR(LRSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the first group's lr) over ``warmup_num_steps``
    iterations, then constant."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _positive_steps(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._write()

    def _warmup_gamma(self) -> float:
        t = self.last_batch_iteration
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def _gamma(self) -> float:
        return self._warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``'s warm-up, then linear decay to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_steps(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedule):
    """Each group's lr at construction times a ratio: warm-up from ``warmup_min_ratio`` to 1, then cosine decay to
    ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _positive_steps(total_num_steps, "total_num_steps")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, _positive_steps(warmup_num_steps, "warmup_num_steps"))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write()

    def get_lr_ratio(self) -> float:
        """The ratio at ``last_batch_iteration`` (0 before the start)."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        n = self.warmup_num_steps
        if t < n:
            gamma = math.log(t + 1) / math.log(n) if self.warmup_type == "log" else t / n
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = min(1.0, (t - n + 1) / max(1, self.total_num_steps - n))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(LRSchedule):
    """One triangular cycle of the learning rate (and inversely of Adam's first beta) between ``cycle_min_lr`` and
    ``cycle_max_lr``, then an optional decay (module docstring)."""

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size = float(_positive_steps(cycle_first_step_size, "cycle_first_step_size"))
        self.second_step_size = self.first_step_size if cycle_second_step_size is None else \
            float(_positive_steps(cycle_second_step_size, "cycle_second_step_size"))
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        groups = len(optimizer.param_groups)
        self.min_lrs = [float(cycle_min_lr)] * groups
        self.max_lrs = [float(cycle_max_lr)] * groups
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = decay_step_size == 0 or self.decay_lr_rate == 0.0
        self.skip_mom_decay = decay_step_size == 0 or float(decay_mom_rate) == 0.0
        self.decay_mom_rate = float(decay_mom_rate)
        self.min_moms = [(float(cycle_min_mom), 0.99)] * groups
        self.max_moms = [(float(cycle_max_mom), 0.99)] * groups
        defaults = getattr(optimizer, "defaults", {})
        self.cycle_momentum = cycle_momentum and "betas" in defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"OneCycle: cycle_momentum is off because {type(optimizer).__name__} has no betas "
                          "(as DeepSpeed); set scheduler.params.cycle_momentum to false to silence this",
                          stacklevel=2)
        if last_batch_iteration == -1:
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            if self.cycle_momentum:
                for group, betas in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale(self) -> float:
        i = self.last_batch_iteration + 1
        cycle = math.floor(1 + i / self.total_size)
        x = 1.0 + i / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantized from the integer position in the cycle, not from the float scale
            position = i % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def get_lr(self) -> list[float]:
        t = self.last_batch_iteration
        if t < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (t - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` of every group at ``last_batch_iteration`` (``None`` without the momentum cycle)."""
        if not self.cycle_momentum:
            return None
        t = self.last_batch_iteration
        if t < self.total_size:
            scale = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (t - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms):
                group["betas"] = betas


SCHEDULES: dict[str, type[LRSchedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
}


def build_scheduler(config: SchedulerConfig, optimizer: Any) -> LRSchedule:
    """The schedule ``config`` describes (type and DeepSpeed-named parameters) over ``optimizer``."""
    return SCHEDULES[config.type](optimizer, **config.params)
