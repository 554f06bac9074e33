"""Output and argument helpers shared by the benchmarks: CSV and Markdown tables, progress lines and bars, loss
curves."""

from __future__ import annotations

import csv
import io
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, Union


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


def moving_average(values: Sequence[float], k: int) -> list[float]:
    """Each value's mean with the ``k - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def draw_loss_curve(ax: Any, steps: Sequence[int], loss: Sequence[float], label: str, k: int) -> Any:
    """A loss curve on the matplotlib axes ``ax``: thin and faint per step (the loss of a few sequences is noisy),
    thick for its ``k``-step moving average, labelled ``label``; returns the color used."""
    (line,) = ax.plot(steps, loss, linewidth=0.6, alpha=0.35)
    ax.plot(steps, moving_average(loss, k), color=line.get_color(), linewidth=1.6, label=label)
    return line.get_color()


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


class ProgressBar:
    """A progress bar on standard error, one line rewritten in place, with what is printed meanwhile kept above it.

    ``with ProgressBar() as bar:`` replaces ``sys.stdout`` and ``sys.stderr`` until the block ends by writers that
    hand every whole line to ``bar.write``, and points the logging handlers that write to them (DeepSpeed's logger)
    at those writers: while a bar is drawn, the line goes above it (the bar is cleared, the line written, the bar
    drawn again: what tqdm's ``write`` does). So the lines of code that knows nothing of the bar (the engine's
    ``steps_per_print`` line, any ``print``, a warning, a log record) never land inside it.

    In the block every line goes to the bar's stream, standard output's too, bar drawn or not, because two streams
    have no order between them: on the emulated cluster (``zeropp.cluster``) a rank's standard output goes
    straight to the terminal while its standard error passes through the launcher (a pipe and a copying thread),
    so a line written to standard output after the bar was cleared (or ended) could still reach the terminal
    first, in the middle of the bar. On one stream a line above the bar (the bar cleared, the line, the bar again)
    is one ``write(2)``, which a pipe keeps in one piece up to ``PIPE_BUF`` bytes (4096 on Linux; a step line and a
    bar are a few hundred).

    The other ranks of a job share the terminal but not the bar: with ``elsewhere`` a process draws nothing and each
    whole line it prints starts by clearing the terminal's line (carriage return, then ``ESC [K``), so a line of
    theirs (a warning each rank prints, as torch's deprecation warnings under DeepSpeed) replaces the bar drawn by
    rank 0 instead of joining it; the bar is back at its next update.

    Only Python's writes are redirected: C code writing to file descriptors 1 and 2 (torch's C++ warnings) still
    writes to the real streams.

    Args:
        enabled: ``False``: draw nothing and redirect nothing (``--no-progress``).
        stream: where the bar goes (default: ``sys.stderr`` when the block starts).
        width: characters of the bar itself.
        elsewhere: the bar is another process's (rank 0's): draw none, print each line on a cleared line.
    """

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, width: int = 24,
                 elsewhere: bool = False) -> None:
        self.enabled = enabled
        self.stream = stream
        self.width = width
        self.elsewhere = elsewhere
        self.shown = ""  # the bar's text as drawn now; "" when no bar is drawn
        self._real: tuple[TextIO, TextIO] | None = None  # sys.stdout and sys.stderr before the block
        self._handlers: list[tuple[logging.StreamHandler, TextIO]] = []  # redirected, with their own streams

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            out, err = self._real = (sys.stdout, sys.stderr)
            if self.stream is None:
                self.stream = err
            sys.stdout, sys.stderr = _LinesAbove(self, out), _LinesAbove(self, err)
            for handler in _stream_handlers():
                if handler.stream is out or handler.stream is err:
                    self._handlers.append((handler, handler.stream))
                    handler.setStream(sys.stdout if handler.stream is out else sys.stderr)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._real is not None:
            redirects = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = self._real
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._handlers = []
            for redirect in redirects:
                if isinstance(redirect, _LinesAbove):
                    redirect.drain()
            self._real = None
        self.finish()

    def update(self, label: str, done: int, total: int, status: str = "") -> None:
        """Draw ``label [####....] done/total  status`` over the current bar."""
        if not self.enabled or self.elsewhere:
            return
        filled = int(self.width * done / max(total, 1))
        text = f"{label:<10} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}  {status}".rstrip()
        assert self.stream is not None
        self.stream.write("\r" + text + " " * max(0, len(self.shown) - len(text)))
        self.stream.flush()
        self.shown = text

    def finish(self) -> None:
        """End the bar drawn (it stays on its line as it was last drawn); the next ``update`` starts a new one."""
        if self.enabled and self.shown:
            assert self.stream is not None
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print ``line`` (no final newline; the lines of one message may come together) in one write: in the block,
        on the bar's stream, above the bar when one is drawn; when the bar is ``elsewhere``, to ``file`` on a
        cleared line; else to ``file`` (default: standard output)."""
        if self.enabled and not self.elsewhere and self._real is not None:
            assert self.stream is not None
            clear = "\r" + " " * len(self.shown) + "\r" if self.shown else ""
            self.stream.write(clear + line + "\n" + self.shown)
            self.stream.flush()
        else:
            out = file or (self._real[0] if self._real else sys.stdout)
            out.write(("\r\x1b[K" if self.enabled and self.elsewhere else "") + line + "\n")
            out.flush()


def _stream_handlers() -> list[logging.StreamHandler]:
    """The stream handlers of the root logger and of every logger made so far."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler)]


class _LinesAbove(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` while a ``ProgressBar`` block runs: the whole lines of each write to
    ``bar.write`` at once (``real``, the stream it stands for, is where they go from a process whose bar is
    elsewhere, or after the block); a line's first part waits for its end (``print`` writes the text, then the
    newline; a part left at the block's end is written as a line). Left open after the block: whoever kept it (a
    logging handler made in the block) still writes through it, to ``real``."""

    def __init__(self, bar: ProgressBar, real: TextIO) -> None:
        super().__init__()
        self.bar = bar
        self.real = real
        self.pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        if lines:  # together: the lines of one write (a warning and its source line) stay together
            self.bar.write("\n".join(lines), self.real)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def drain(self) -> None:
        """Write the unfinished line left, as a line."""
        if self.pending:
            self.bar.write(self.pending, self.real)
            self.pending = ""

    def isatty(self) -> bool:
        return self.real.isatty()

    def fileno(self) -> int:
        return self.real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.real.encoding
