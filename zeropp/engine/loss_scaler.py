"""fp16 loss scaling: DeepSpeed's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``) rule for rule.

Dynamic (``fp16.loss_scale == 0``): the scale starts at ``2 ** initial_scale_power``. After every optimizer step
(an accumulation boundary) ``update(overflow)`` is called with whether any gradient was Inf/NaN on any rank:

* overflow: the step is skipped (by the engine). If the hysteresis counter is 1 (or ``hysteresis`` is 1), the scale
  halves, never below ``min_loss_scale``; otherwise only the counter drops by one (the scale stays). The counter is
  not restored by a halving (as in DeepSpeed: once spent, later overflows halve at once);
* no overflow: when ``loss_scale_window`` clean steps have passed since the last overflow (or since the start),
  the scale doubles (never above ``MAX_SCALE`` = 2^126, so that the scale and its reciprocal stay normal float32
  numbers; the config caps ``initial_scale_power`` at 126 for the same reason) and the hysteresis counter is restored
  to ``hysteresis``.

DeepSpeed's ``consecutive_hysteresis`` is not supported (rejected by the config), and reaching ``min_loss_scale``
does not raise (the scale stays there and overflowing steps keep being skipped).

Static (``fp16.loss_scale > 0``): the scale never changes; an overflowing step is still skipped.
"""

from __future__ import annotations

from ..config import FP16Config

MAX_SCALE = 2.0**126


class LossScaler:
    """The loss scale of an fp16 run and its update rule (see the module docstring)."""

    def __init__(self, config: FP16Config) -> None:
        self.dynamic = config.dynamic
        self.scale = float(2.0 ** config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        self.window = config.loss_scale_window
        self.min_scale = float(config.min_loss_scale)
        self.delayed_shift = config.hysteresis
        self.hysteresis = config.hysteresis  # what is left of it
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """After an optimizer step (taken or skipped): adjust the scale."""
        if self.dynamic:
            if overflow:
                if self.delayed_shift == 1 or self.hysteresis == 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.hysteresis -= 1
                self.last_overflow_iteration = self.iteration
            elif (self.iteration - self.last_overflow_iteration) % self.window == 0:
                self.hysteresis = self.delayed_shift
                self.scale = min(self.scale * 2.0, MAX_SCALE)
        self.iteration += 1

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale}, dynamic={self.dynamic}, hysteresis={self.hysteresis})"
