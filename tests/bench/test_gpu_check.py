"""``bench/gpu_check.sh STAGE OUTDIR --quick`` on the CPU: each stage runs its steps at toy sizes (< 30 s), leaves
exactly one file, ``OUTDIR/STAGE.tar.gz`` (the lent GPU machines return at most 8), holding its logs, CSVs and
summary, and prints the summary last. Also: a stage out of time skips its steps and still packs and summarizes;
``bench/gpu_summary.py`` reports failures, skips and timeouts; ``bench/pytest_shard.py`` splits a suite exactly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import exact_triton

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "kernels": {"kernels_main.log", "native_build.log", "kernels_native.log", "kernels_sweep.log", "kernels.csv",
                "native.csv", "sweep.csv"},
    "tests": {"quant_format_1of2.log", "quant_format_2of2.log", "comm_cuda.log", "fsdp_cuda.log"},
    "engine": {"engine_w1_bf16.log", "engine_w2_bf16.log", "collectives.log", "collectives.csv"},
}
KEY_LINES = {  # a line of the stage's summary that shows its results were read
    "kernels": "check vs the CPU reference, rows: 216 PASS",
    "tests": "quant_format_1of2: ",
    "engine": "| zeropp |",
}


def gpu_check(stage: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ZEROPP_QUANT_BACKEND", "OUT")}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), stage, str(out), "--quick"],
                          env={**environ, "PYTHON": sys.executable, **env}, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)


def members(archive: Path) -> dict[str, str]:
    with tarfile.open(archive) as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


@pytest.mark.parametrize("stage", ["kernels", "tests", "engine"])
def test_quick_stage_packs_one_archive_and_prints_its_summary_last(stage, tmp_path):
    if stage == "kernels" and not torch.cuda.is_available():
        exact_triton("cpu")  # the kernels stage checks the Triton kernels' bits, here under the interpreter
    proc = gpu_check(stage, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == [f"{stage}.tar.gz"]
    files = members(tmp_path / f"{stage}.tar.gz")
    assert EXPECTED[stage] | {"steps.tsv", "summary.txt", "machine.txt"} <= set(files), sorted(files)
    steps = [line.split("\t") for line in files["steps.tsv"].splitlines()]
    assert len(steps) == len([f for f in EXPECTED[stage] if f.endswith(".log")])
    assert all(s[1] == "PASS" and s[2] == "0" for s in steps), steps
    out = proc.stdout.rstrip().splitlines()
    assert out[-1].startswith(f"gpu_check {stage}: PASS ({len(steps)} of {len(steps)} steps passed"), out[-1]
    start = out.index(f"==== gpu_check {stage}: summary ====")
    assert not any(line.startswith("=== ") for line in out[start:]), "the summary must come last"
    assert any(KEY_LINES[stage] in line for line in out[start:]), out[start:]
    assert files["summary.txt"].strip() == "\n".join(out[start:-1]).strip()


def test_a_stage_out_of_time_skips_packs_and_fails(tmp_path):
    proc = gpu_check("engine", tmp_path, GPU_CHECK_BUDGET="10")
    assert proc.returncode == 1
    files = members(tmp_path / "engine.tar.gz")
    assert [line.split("\t")[1] for line in files["steps.tsv"].splitlines()] == ["SKIP"] * 3
    assert proc.stdout.rstrip().splitlines()[-1].startswith("gpu_check engine: FAIL (0 of 3 steps passed")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_reports_failures_skips_and_timeouts(tmp_path):
    (tmp_path / "steps.tsv").write_text("quant_a\tFAIL\t1\t30\t480\nquant_b\tTIMEOUT\t124\t480\t480\n")
    (tmp_path / "quant_a.log").write_text(
        "..F.s\nE       AssertionError: codes differ\n"
        "FAILED tests/quant/test_x.py::test_y[8] - AssertionError: codes differ\n"
        "SKIPPED [1] tests/comm/test_comm_cuda.py:27: needs a CUDA device\n1 failed, 3 passed, 1 skipped in 9.1s\n")
    (tmp_path / "quant_b.log").write_text("....")
    text = load("gpu_summary").summary("tests", tmp_path)
    assert "| quant_b | TIMEOUT | 124  |" in text
    assert "quant_a: 1 failed, 3 passed, 1 skipped in 9.1s" in text
    assert "FAILED tests/quant/test_x.py::test_y[8]" in text and "SKIPPED [1]" in text
    assert "quant_b: (no closing line)" in text
    assert "quant_a: first error: E       AssertionError: codes differ" in text
    # a stage whose CSV is missing still summarizes
    assert "kernels.csv: no rows" in load("gpu_summary").summary("kernels", tmp_path)


@pytest.mark.parametrize("count", [0, 1, 2, 7, 323])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pytest_shards_cover_every_test_once(count, k):
    bounds = [load("pytest_shard").shard_bounds(f"{i}/{k}", count) for i in range(1, k + 1)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
