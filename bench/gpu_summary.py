"""The summary that ``bench/gpu_check.sh`` prints last for a stage: every step's status, then the stage's key results,
read from the stage's folder (``steps.tsv``, the logs and the CSVs).

    python bench/gpu_summary.py kernels|tests|engine DIR

* kernels: the bit-for-bit check's counts (and every mismatch), floor/time per kernel for each dtype and block size
  at each size, the copy ceiling measured, and the sweep's best tile per row against the default tile;
* tests: each pytest process's closing line and the tests that failed, erred or were skipped;
* engine: each run's table rows (agreement with plain training, step-time ratio) and the collectives' largest rows.

Every section is read on its own: a missing or broken file is reported in its place, never stops the summary.
"""

from __future__ import annotations

import csv
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zeropp.bench.report import markdown_table, rows_table  # noqa: E402

STEP_COLUMNS = ("step", "status", "exit", "seconds", "limit")


def read_steps(folder: Path) -> list[dict[str, str]]:
    """``steps.tsv``: one line per step, ``name status exit seconds limit`` separated by tabs."""
    path = folder / "steps.tsv"
    if not path.exists():
        return []
    return [dict(zip(STEP_COLUMNS, line.split("\t"))) for line in path.read_text().splitlines() if line.strip()]


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path))) if path.exists() else []


def number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def kernels(folder: Path) -> list[str]:
    return kernel_rows(folder, "kernels.csv", "kernels_main.log", "")


def native(folder: Path) -> list[str]:
    return ["", "native backend (kernels/: the CUDA C++ kernels through CuPy on a GPU, the CPU library on a CPU):",
            *kernel_rows(folder, "native.csv", "kernels_native.log", "native ")]


def kernel_rows(folder: Path, name: str, log: str, what: str) -> list[str]:
    """The check counts, failures and floor/time tables of one ``bench/kernels.py`` CSV."""
    lines: list[str] = []
    rows = read_csv(folder / name)
    if not rows:
        return [f"{name}: no rows (see {log})"]
    checked = [r for r in rows if r.get("check")]
    if checked:
        timed, far = [r for r in checked if r.get("op") != "far"], [r for r in checked if r.get("op") == "far"]
        for label, group in (("rows", timed), ("past 2^31", far)):
            if not group:
                continue
            counts = {s: sum(r["check"] == s for r in group) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
            lines.append(f"check vs the CPU reference, {label}: "
                         + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k == "PASS"))
        bad = [r for r in checked if r["check"] != "PASS"]
        lines += [f"  {r['check']}: {r['dtype']} b{r['block']} {r['size']} {r['kernel']}: {r.get('detail', '')[:200]}"
                  for r in bad[:20]]
        if len(bad) > 20:
            lines.append(f"  ... and {len(bad) - 20} more ({name})")
    errors = [r for r in rows if r.get("error")]
    lines += [f"  ERROR: {r['dtype']} b{r['block']} {r['size']} {r['kernel']}: {r['error'][:200]}" for r in errors[:10]]
    timed = [r for r in rows if number(r.get("floor/time")) is not None]
    configs = list(dict.fromkeys(f"{r['dtype']} b{r['block']}" for r in timed))
    for size in dict.fromkeys(r["size"] for r in timed):
        at = [r for r in timed if r["size"] == size]
        copy = sorted(number(r["copy GB/s"]) for r in at if number(r.get("copy GB/s")))
        lines.append("")
        ceiling = f"; copy measured at {copy[len(copy) // 2]:.0f} GB/s median" if copy else ""
        lines.append(f"{what}floor/time at {size} elements (1.0 = a copy of the same bytes{ceiling}; ! = check "
                     "failed):")
        table: dict[str, dict[str, str]] = {}
        for r in at:
            mark = "" if r.get("check", "PASS") == "PASS" else "!"
            table.setdefault(r["kernel"], {})[f"{r['dtype']} b{r['block']}"] = f"{float(r['floor/time']):.3f}{mark}"
        lines.append(markdown_table(["kernel", *configs], [[k, *(v.get(c, "") for c in configs)]
                                                           for k, v in table.items()]))
    return lines


def sweep(folder: Path) -> list[str]:
    rows = [r for r in read_csv(folder / "sweep.csv") if number(r.get("ms")) is not None]
    if not rows:
        return ["sweep.csv: no rows (see kernels_sweep.log)"]
    out = []
    for key in dict.fromkeys((r["kernel"], r["dtype"], r["block"], r["size"]) for r in rows):
        group = [r for r in rows if (r["kernel"], r["dtype"], r["block"], r["size"]) == key]
        good = [r for r in group if r.get("check", "PASS") == "PASS"] or group
        best = min(good, key=lambda r: float(r["ms"]))
        default = next((r for r in group if r.get("default") == "yes"), None)
        out.append({"kernel": key[0], "dtype": key[1], "block": key[2], "size": key[3],
                    "default tile": f"{default['elements']} x {default['warps']}w" if default else "",
                    "default floor/time": float(default["floor/time"]) if default else None,
                    "best tile": f"{best['elements']} x {best['warps']}w", "best floor/time": float(best["floor/time"]),
                    "speed-up": float(default["ms"]) / float(best["ms"]) if default else None,
                    "checks": f"{sum(r.get('check') == 'PASS' for r in group)}/{len(group)}"
                    if any(r.get("check") for r in group) else ""})
    fmt = {"default floor/time": ".3f", "best floor/time": ".3f", "speed-up": ".3f"}
    return ["", "tile/warps sweep: best tile per row (checked tiles only):",
            rows_table(out, ["kernel", "dtype", "block", "size", "default tile", "default floor/time", "best tile",
                             "best floor/time", "speed-up", "checks"], fmt)]


PYTEST_CLOSING = re.compile(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b")


def tests(folder: Path) -> list[str]:
    lines = []
    for step in read_steps(folder):
        log = folder / f"{step['step']}.log"
        text = log.read_text(errors="replace").splitlines() if log.exists() else []
        closing = next((line.strip(" =") for line in reversed(text) if PYTEST_CLOSING.search(line)),
                       "(no closing line)")
        lines.append(f"{step['step']}: {closing}")
        for kind, most in (("FAILED ", 15), ("ERROR ", 5), ("SKIPPED ", 8)):  # skips too: on a GPU, none expected
            found = [line for line in text if line.startswith(kind)]
            lines += [f"    {line[:220]}" for line in found[:most]]
            if len(found) > most:
                lines.append(f"    ... and {len(found) - most} more {kind.strip()} ({log.name})")
    return lines


def engine(folder: Path) -> list[str]:
    lines = []
    for step in read_steps(folder):
        log = folder / f"{step['step']}.log"
        text = log.read_text(errors="replace").splitlines() if log.exists() else []
        if step["step"].startswith("collectives"):
            body = [line for line in text if re.match(r"^\s+(all_gather|reduce_scatter)\b", line)]
            head = [line for line in text if line.startswith("#")][-1:]
            lines += [f"{step['step']}:", *head, *body[-6:]] if body else [f"{step['step']}: no rows"]
            continue
        header = [line for line in text if "world size" in line][:1]
        table = [line for line in text if line.startswith("| config") or line.startswith("| zero")]
        lines += [f"{step['step']}: {header[0] if header else '(no result)'}", *table]
    return lines


SECTIONS: dict[str, list[Callable[[Path], list[str]]]] = {"kernels": [kernels, native, sweep], "tests": [tests],
                                                          "engine": [engine]}


def summary(stage: str, folder: Path) -> str:
    machine = folder / "machine.txt"
    lines = [f"==== gpu_check {stage}: summary ====",
             "machine: " + (" | ".join(line.strip() for line in machine.read_text(errors="replace").splitlines()
                                       if line.strip()) if machine.exists() else "?")]
    steps = read_steps(folder)
    lines.append(rows_table(steps, STEP_COLUMNS) if steps else "no steps ran")
    for step in steps:  # the first exception a failed step's log shows (torchrun's own wrapper error left out)
        log = folder / f"{step['step']}.log"
        if step["status"] in ("FAIL", "TIMEOUT") and log.exists():
            errors = [line.strip() for line in log.read_text(errors="replace").splitlines()
                      if re.match(r"\s*([\w.]+(Error|Exception)|E\s+\w+(Error|Exception)):", line)
                      and "ChildFailedError" not in line]
            if errors:
                lines.append(f"{step['step']}: first error: {errors[0][:300]}")
    for section in SECTIONS.get(stage, []):
        try:
            lines += section(folder)
        except Exception:  # noqa: BLE001 - the rest of the summary must still print
            lines.append(f"({section.__name__}: could not be summarized: {traceback.format_exc(limit=2)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in SECTIONS:
        print("usage: python bench/gpu_summary.py kernels|tests|engine DIR", file=sys.stderr)
        return 2
    print(summary(argv[0], Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
