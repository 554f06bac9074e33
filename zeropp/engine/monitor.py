"""``Monitor``: DeepSpeed's ``steps_per_print`` progress line and ``wall_clock_breakdown`` timings.

Every ``steps_per_print`` accumulation boundaries (``global_steps`` a multiple of it), the data-parallel group's
first rank prints one line to stdout::

    [zeropp] step=20 loss=2.4817 lr=[0.001] grad_norm=0.93120 samples/s=812.4 loss_scale=65536

* ``loss``: the mean of the losses given to ``backward`` on this rank since the last line (every micro-batch);
* ``lr``: each parameter group's learning rate after the step (what the next step uses);
* ``grad_norm``: the global gradient norm before clipping of the last step (only with ``gradient_clipping``;
  ``skipped`` when that step was skipped: an fp16 overflow, or non-finite gradients under ``nonfinite_gradients:
  "skip"``);
* ``samples/s``: ``train_batch_size`` times the boundaries since the last line, over the wall time since the first
  forward after it;
* ``loss_scale``: the fp16 loss scale (1 otherwise).

With ``wall_clock_breakdown`` the line ends with ``forward_ms=... backward_ms=... step_ms=...``: the mean wall time
of a forward and of a backward (per micro-batch) and of an optimizer step (per boundary, clipping and the weight
publication included) since the last line. For these times the device is synchronized around each phase (as
DeepSpeed does for its breakdown); without ``wall_clock_breakdown`` nothing synchronizes: the losses are summed on
the device and read, like the gradient norm, only at a step that prints.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch


class Monitor:
    """Collects the values of the progress line between two prints (see the module docstring).

    Args:
        steps_per_print: boundaries between two lines.
        wall_clock_breakdown: also time forward, backward and step.
        prints: whether this rank prints (the data-parallel group's first rank).
        device: the engine's device (synchronized for the timings).
    """

    PHASES = ("forward", "backward", "step")

    def __init__(self, steps_per_print: int, wall_clock_breakdown: bool, prints: bool, device: torch.device) -> None:
        self.steps_per_print = steps_per_print
        self.wall_clock_breakdown = wall_clock_breakdown
        self.prints = prints
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._boundaries = 0
        self._window_start: float | None = None
        self._times = {phase: 0.0 for phase in self.PHASES}
        self._counts = {phase: 0 for phase in self.PHASES}
        self._started: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, phase: str) -> None:
        """A forward, backward or (boundary) step begins."""
        if self._window_start is None:
            self._window_start = time.perf_counter()
        if self.wall_clock_breakdown:
            self._sync()
            self._started = time.perf_counter()

    def end(self, phase: str) -> None:
        """The phase begun last ends."""
        if self.wall_clock_breakdown and self._started is not None:
            self._sync()
            self._times[phase] += time.perf_counter() - self._started
            self._counts[phase] += 1
            self._started = None

    def loss(self, loss: torch.Tensor) -> None:
        """The loss given to ``backward`` (summed on its device, on the printing rank only; no host read)."""
        if not self.prints:
            return
        value = loss.detach().float().reshape(())
        self._loss_sum = value.clone() if self._loss_sum is None else self._loss_sum + value
        self._losses += 1

    def boundary(self, engine: Any) -> str | None:
        """After an accumulation boundary's step: print (and return) the line when ``engine.global_steps`` is a
        multiple of ``steps_per_print`` on the printing rank; ``None`` otherwise."""
        self._boundaries += 1
        if engine.global_steps % self.steps_per_print:
            return None
        line = None
        if self.prints:
            elapsed = time.perf_counter() - (self._window_start or time.perf_counter())
            loss = float(self._loss_sum) / self._losses if self._loss_sum is not None else float("nan")
            lrs = "[" + ", ".join(f"{lr:.6g}" for lr in engine.get_lr()) + "]"
            parts = [f"[zeropp] step={engine.global_steps}", f"loss={loss:.6g}", f"lr={lrs}"]
            if engine.config.gradient_clipping > 0:
                norm = engine.get_global_grad_norm()
                parts.append("grad_norm=skipped" if norm is None else f"grad_norm={norm:.6g}")
            samples = engine.train_batch_size() * self._boundaries
            parts.append(f"samples/s={samples / elapsed if elapsed > 0 else float('inf'):.6g}")
            parts.append(f"loss_scale={engine.loss_scale:g}")
            if self.wall_clock_breakdown:
                parts += [f"{phase}_ms={1000 * self._times[phase] / max(1, self._counts[phase]):.6g}"
                          for phase in self.PHASES]
            line = " ".join(parts)
            print(line, file=sys.stdout, flush=True)
        self._reset()
        return line
