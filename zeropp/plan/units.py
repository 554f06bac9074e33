"""How the planner's reports print a duration: milliseconds below a second, seconds with fixed decimals above."""

from __future__ import annotations

import math


def duration(seconds: float) -> str:
    """``seconds`` for a reader: ``"0"``, ``"0.079 ms"``, ``"17.61 ms"``, ``"536.4 ms"``, ``"3.742 s"``,
    ``"123.4 s"`` (four significant digits from 1 ms up, three decimals of a millisecond below it; ``"<0.001 ms"``
    for less than half a microsecond).

    Raises:
        ValueError: for a negative, infinite or NaN duration (a bug upstream, never a time to print).
    """
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"duration {seconds!r} s must be a finite number >= 0")
    if seconds == 0:
        return "0"
    if seconds >= 1:
        return f"{seconds:.1f} s" if seconds >= 100 else f"{seconds:.3f} s"
    ms = seconds * 1e3
    if ms < 0.0005:
        return "<0.001 ms"
    return f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms" if ms >= 1 else f"{ms:.3f} ms"
