"""``LossScaler`` alone against DeepSpeed's ``DynamicLossScaler.update_scale`` rules (no processes)."""

from __future__ import annotations

import torch

from zeropp.config import FP16Config
from zeropp.engine import LossScaler


def scales(config: FP16Config, overflows: list[bool]) -> list[float]:
    s = LossScaler(config)
    out = []
    for o in overflows:
        s.update(o)
        out.append(s.scale)
    return out


def test_dynamic_window_and_hysteresis():
    c = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=1.0)
    assert LossScaler(c).scale == 16.0
    # clean steps 0, 1, 2: doubles at the third; overflow at 3 spends the hysteresis; at 4 it halves; a third
    # overflow at 5 halves again (the hysteresis is not restored by a halving); 3 clean steps later (8) it doubles
    # and the hysteresis is back, so the overflow at 9 only spends it
    got = scales(c, [False, False, False, True, True, True, False, False, False, True])
    assert got == [16, 16, 32, 32, 16, 8, 8, 8, 16, 16]


def test_hysteresis_one_halves_at_once_and_min_scale_holds():
    c = FP16Config(enabled=True, initial_scale_power=2, loss_scale_window=100, hysteresis=1, min_loss_scale=1.0)
    assert scales(c, [True] * 4) == [2, 1, 1, 1]  # clamped at min_loss_scale, no error


def test_static_scale_never_moves():
    c = FP16Config(enabled=True, loss_scale=128.0, loss_scale_window=1)
    s = LossScaler(c)
    assert not s.dynamic
    assert scales(c, [True, False, False, True]) == [128.0] * 4


def test_dynamic_scale_stops_at_two_to_the_126():
    c = FP16Config(enabled=True, initial_scale_power=120, loss_scale_window=1, hysteresis=1)
    got = scales(c, [False] * 10)
    assert got == [2.0 ** min(121 + k, 126) for k in range(10)]
    assert float(torch.tensor(1.0 / got[-1], dtype=torch.float32)) == 2.0**-126  # its float32 reciprocal: normal
