"""Exact rounding of rationals to float32, for tests that need a reference independent of floating point."""

from __future__ import annotations

from fractions import Fraction


def round_to_float32_precision(value: Fraction) -> Fraction:
    """``value`` rounded to 24 significant bits, half to even, with no exponent limit."""
    if value == 0:
        return value
    e = abs(value.numerator).bit_length() - value.denominator.bit_length()  # 2**(e - 1) < |value| < 2**(e + 1)
    if abs(value) < Fraction(2) ** e:
        e -= 1
    ulp = Fraction(2) ** (e - 23)
    return round(value / ulp) * ulp  # round() of a Fraction rounds half to even


def round_to_float32(value: Fraction) -> float:
    """``value`` rounded to the nearest float32 (half to even, subnormals, overflow to Inf)."""
    tiny = Fraction(2) ** -149
    rounded = round_to_float32_precision(value) if abs(value) >= Fraction(2) ** -126 else round(value / tiny) * tiny
    if abs(rounded) >= Fraction(2) ** 128:
        return float("inf") if rounded > 0 else -float("inf")
    return float(rounded)


def fma_float32(code: float, scale: float, acc: float) -> float:
    """``code * scale + acc`` of float32 values, exact, rounded once to float32."""
    return round_to_float32(Fraction(code) * Fraction(scale) + Fraction(acc))
