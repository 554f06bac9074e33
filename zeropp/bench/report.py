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


def markdown_table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table of the cells ``body`` (rows of strings) under ``head``, each column as wide as its widest
    cell, left-aligned."""
    widths = [max([len(h), *(len(row[i]) for row in body)]) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])
