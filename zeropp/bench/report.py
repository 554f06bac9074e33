"""Output helpers shared by the benchmarks."""

from __future__ import annotations

import csv
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def write_csv(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Write ``rows`` as CSV to ``path`` (``"-"``: standard output); the columns are every key seen, in order."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    out = sys.stdout if path == "-" else open(path, "w", newline="")
    try:
        writer = csv.DictWriter(out, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    finally:
        if out is not sys.stdout:
            out.close()
