"""Link rates: ``"1gbit"``, ``"500mbit"``, ``"10gbit"`` ... to bits per second, and back to ``tc``'s syntax.

Units follow ``tc``: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are decimal (``1gbit`` = 10**9 bit/s);
``kibit`` ... ``tibit`` are binary (``1mibit`` = 2**20 bit/s); a bare number is bits per second. Byte rates
(``tc``'s ``mbps`` means megaBYTES per second, an easy slip) are refused with a hint rather than guessed.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1.0, "bit": 1.0,
    "k": 1e3, "kbit": 1e3, "m": 1e6, "mbit": 1e6, "g": 1e9, "gbit": 1e9, "t": 1e12, "tbit": 1e12,
    "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30, "tibit": 2.0**40,
}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_rate(rate: str | int | float) -> float:
    """Bits per second of ``rate`` (``"1gbit"`` -> ``1e9``; numbers are taken as bits per second).

    Raises:
        ValueError: for anything else than a positive finite number with one of the units above.
    """
    if isinstance(rate, bool):
        raise ValueError(f"rate {rate!r} is not a rate; use e.g. '1gbit', '500mbit', '10gbit'")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        m = _RATE.match(str(rate))
        if m is None:
            raise ValueError(
                f"rate {rate!r} is not understood; use a number and a unit, e.g. '1gbit', '500mbit', "
                f"'10gbit' (units: {', '.join(u for u in _UNITS if u)})"
            )
        unit = m.group(2).lower()
        if unit not in _UNITS:
            hint = ""
            if unit.endswith("bps") or unit in ("b", "kb", "mb", "gb", "tb"):
                hint = " (byte rates are not accepted: write the rate in bits, e.g. '8gbit' for 1 GB/s)"
            raise ValueError(
                f"rate {rate!r} has an unknown unit {m.group(2)!r}{hint}; use one of "
                f"{', '.join(u for u in _UNITS if u)}, e.g. '1gbit'"
            )
        value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"rate {rate!r} must be a positive, finite number of bits per second")
    if value < 8000:
        raise ValueError(f"rate {rate!r} = {value:g} bit/s is too slow to be useful (at least 8kbit)")
    return value


def tc_rate(bits_per_second: float) -> str:
    """``bits_per_second`` in ``tc``'s syntax (an integer number of ``bit``, exact for any unit)."""
    return f"{int(round(bits_per_second))}bit"


def format_rate(bits_per_second: float) -> str:
    """A short human form: ``1e9`` -> ``"1 Gbit/s"``, ``5e8`` -> ``"500 Mbit/s"``."""
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.4g} {unit}"
    return f"{bits_per_second:.4g} bit/s"
