"""Output and argument helpers shared by the benchmarks."""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union


def write_csv(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Write ``rows`` as CSV to ``path`` (``"-"``: standard output; missing folders are made); the columns are every
    key seen, in order."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    if path != "-":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
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


Format = Union[str, Callable[[Any], str]]


def format_cell(value: Any, spec: Format | None = None) -> str:
    """One cell: ``""`` for a missing value, ``spec`` (a format spec such as ``".3f"``, or a function) if given, else
    floats to 4 significant digits and everything else as ``str``."""
    if value is None or value == "":
        return ""
    if callable(spec):
        return spec(value)
    if spec is not None:
        try:
            return format(value, spec)
        except (TypeError, ValueError):  # a text cell in a numeric column (an error note)
            return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def rows_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
               formats: Mapping[str, Format] | None = None) -> str:
    """``markdown_table`` of dict rows: one column per name in ``columns`` (cells by ``format_cell`` with
    ``formats[name]``); a column that no row has is left out."""
    formats = formats or {}
    used = [c for c in columns if any(row.get(c) not in (None, "") for row in rows)]
    return markdown_table(used, [[format_cell(row.get(c), formats.get(c)) for c in used] for row in rows])


def parse_size(text: str) -> int:
    """``2^28``, ``1<<28``, ``268435456`` or ``256M`` / ``4K`` (binary)."""
    t = text.strip()
    if "^" in t:
        base, exp = t.split("^")
        return int(base) ** int(exp)
    if "<<" in t:
        a, b = t.split("<<")
        return int(a) << int(b)
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1].upper())
    return int(t[:-1]) * mult if mult else int(t)


def progress(message: str) -> None:
    """A progress line on standard error (kept apart from the tables on standard output), flushed at once."""
    print(message, file=sys.stderr, flush=True)
