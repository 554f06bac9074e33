"""The end-to-end training benchmark (zeropp.bench.training) runs, writes its CSVs and PNGs, prints its table, and
its byte counters show ZeRO++'s cut of the cross-node volume.

One job of 4 ranks as 2 emulated nodes of 2 under the demo's launcher, ``zeropp.cluster``, unshaped (one torchrun
on loopback; the ranks' standard error passes through the launcher, their standard output does not): the tiny
preset, ZeRO-3, full ZeRO++, FSDP2 and HSDP (``zeropp.bench.fsdp``), and FSDP2 with zeropp's comms (full ZeRO++
and each flag alone), 3 steps, the engine's ``steps_per_print`` line at every step. FSDP2 and HSDP do the same work
as ZeRO-3: the same first-step loss (same weights, same data, exact gathers) and, after 3 AdamW steps, the same
held-out loss to 1e-4. The terminal shows the step lines whole, above the progress bars. DeepSpeed's ZeRO-3, where
it is installed, likewise, beside DeepSpeed's engine on zeropp.deepspeed (a job of their own, under the
benchmark's own ``--launcher torchrun``). The shaped run lives in bench/RESULTS.md (too slow for a test).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import worker_quant_backend

from zeropp.bench import training
from zeropp.bench.report import ProgressBar

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("zero3", "zeropp", "fsdp2", "hsdp", "fsdp2-zeropp", "fsdp2-qwz", "fsdp2-hpz", "fsdp2-qgz")


def bench(out: Path, *options: str, timeout: float = 120, cluster: bool = False) -> subprocess.CompletedProcess:
    """The benchmark on 4 ranks as 2 emulated nodes of 2, tiny preset, 3 steps: under its own unshaped torchrun, or
    (``cluster``) under ``python -m zeropp.cluster --unshaped``; standard output and error in one pipe, as on a
    terminal (``proc.stdout``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE",
                                                              "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["ZEROPP_QUANT_BACKEND"] = worker_quant_backend()
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    launch = ["-m", "zeropp.cluster", "--nodes", "2", "--ranks-per-node", "2", "--unshaped", "--quiet", "--",
              "python"] if cluster else []
    proc = subprocess.run(
        [sys.executable, *launch, "-m", "zeropp.bench.training", "--launcher", "torchrun", "--nodes", "2",
         "--ranks-per-node", "2", "--preset", "tiny", "--seq", "16", "--micro-batch", "1", "--steps", "3",
         "--warmup", "1", "--out", str(out), *options],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT, check=False,
    )
    proc.stdout = proc.stdout.decode()  # not text=True: that turns each carriage return into a newline
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("training")
    return out, bench(out, "--configs", ",".join(CONFIGS), "--steps-per-print", "1", cluster=True)


def screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return goes back to the line's start, what follows
    overwrites what was there, ``ESC [K`` clears the line from the cursor on."""
    lines = []
    for raw in text.split("\n"):
        shown, col = "", 0
        for part in re.split(r"(\r|\x1b\[K)", raw):
            if part == "\r":
                col = 0
            elif part == "\x1b[K":
                shown = shown[:col]
            else:
                shown, col = shown[:col] + part + shown[col + len(part):], col + len(part)
        lines.append(shown.rstrip())
    return lines


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_columns_and_rows(run):
    out, _ = run
    rows = read_csv(out / "training.csv")
    assert [r["config"] for r in rows] == list(CONFIGS)
    for col in ("step_s", "tokens_per_s", "speedup", "inter_MB_rank", "intra_MB_rank", "inter_MB_node",
                "intra_MB_node", "ag_inter_MB_rank", "rs_inter_MB_rank", "util_counted", "nic_tx_MB_node",
                "util_nic", "final_loss", "eval_loss", "loss_vs_zero3", "shaped"):
        assert col in rows[0], col
    base, zpp, fsdp2, hsdp = rows[:4]
    assert float(base["speedup"]) == 1.0
    assert float(base["step_s"]) > 0 and float(zpp["step_s"]) > 0
    assert float(zpp["tokens_per_s"]) == pytest.approx(4 * 16 / float(zpp["step_s"]), rel=0.01)
    assert base["shaped"] == "False" and base["nic_tx_MB_node"] == ""  # unshaped: no interface measured
    # same seed, same data: the first step's loss is the same up to qwZ's int8 weights
    curve = read_csv(out / "training_loss.csv")
    assert len(curve) == len(CONFIGS) * 3
    first = {r["config"]: float(r["loss"]) for r in curve if r["step"] == "0"}
    assert first["zeropp"] == pytest.approx(first["zero3"], rel=0.01)
    assert abs(float(zpp["loss_vs_zero3"])) < 0.02
    for row in (fsdp2, hsdp):  # the same work as ZeRO-3: same first loss, same model after 3 steps
        assert first[row["config"]] == pytest.approx(first["zero3"], rel=1e-6)
        assert abs(float(row["loss_vs_zero3"])) < 1e-4
        assert row["inter_MB_rank"] == ""  # torch's collectives: not counted by zeropp.comm.stats
    # FSDP2 with zeropp's comms: the same weights and batch as FSDP2; exact forward gathers (hpZ, qgZ alone) give
    # the same first loss bit for bit, int8 ones (qwZ) within 1%; hpZ alone is exact all through
    by_name = {r["config"]: r for r in rows}
    for name in ("fsdp2-hpz", "fsdp2-qgz"):
        assert first[name] == first["fsdp2"], name
    for name in ("fsdp2-zeropp", "fsdp2-qwz"):
        assert first[name] != first["fsdp2"] and first[name] == pytest.approx(first["fsdp2"], rel=0.01), name
    assert by_name["fsdp2-hpz"]["eval_loss"] == fsdp2["eval_loss"]
    for name in ("fsdp2-zeropp", "fsdp2-qwz", "fsdp2-qgz"):
        assert abs(float(by_name[name]["eval_loss"]) / float(fsdp2["eval_loss"]) - 1) < 0.02, name


def test_deepspeed_rows(tmp_path):
    """DeepSpeed's ZeRO-3 (an optional peer, not a dependency) does the same work as ours: the same first-step loss
    (same weights, same batch, exact gathers); after 3 AdamW steps the same held-out loss in fp32 and, in bf16
    (bf16 weights and bf16 gradient reduce-scatter in both, different summation orders), within 1%. DeepSpeed's
    engine with qwZ + hpZ + qgZ on ``zeropp.deepspeed`` (``deepspeed-zeropp``): the same first-step loss as
    DeepSpeed's exact ZeRO-3 (hpZ's first forward is exact), the held-out loss within 2% of it, and counted
    cross-node bytes. One job for the four DeepSpeed rows."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pytest.skip("DeepSpeed is not installed: pip install deepspeed")
    bench(tmp_path, "--configs", "zero3,deepspeed,deepspeed-zeropp", "--dtypes", "fp32,bf16", "--no-plots",
          timeout=400)
    rows = {r["config"]: r for r in read_csv(tmp_path / "training.csv")}
    assert list(rows) == [f"{c}:{d}" for d in ("fp32", "bf16") for c in ("zero3", "deepspeed", "deepspeed-zeropp")]
    first = {r["config"]: float(r["loss"]) for r in read_csv(tmp_path / "training_loss.csv") if r["step"] == "0"}
    for dtype, tol in (("fp32", 1e-4), ("bf16", 1e-2)):
        ds, base = rows[f"deepspeed:{dtype}"], rows[f"zero3:{dtype}"]
        assert first[f"deepspeed:{dtype}"] == pytest.approx(first[f"zero3:{dtype}"], rel=1e-6)
        assert abs(float(ds["loss_vs_zero3"])) < tol
        assert float(ds["final_loss"]) == pytest.approx(float(base["final_loss"]), rel=tol)
        assert float(ds["speedup"]) == pytest.approx(float(base["step_s"]) / float(ds["step_s"]), rel=0.01)
        assert float(ds["tokens_per_s"]) == pytest.approx(4 * 16 / float(ds["step_s"]), rel=0.01)
        assert ds["inter_MB_rank"] == ""  # torch's collectives: not counted by zeropp.comm.stats
        dz = rows[f"deepspeed-zeropp:{dtype}"]
        assert first[f"deepspeed-zeropp:{dtype}"] == first[f"deepspeed:{dtype}"]
        assert abs(float(dz["eval_loss"]) / float(ds["eval_loss"]) - 1) < 0.02
        # counted: qgZ crosses nodes; the tiny preset's parameters all lie under DeepSpeed's
        # stage3_param_persistence_threshold (1e5 elements), gathered once and kept, so no qwZ gather is measured
        assert float(dz["rs_inter_MB_rank"]) > 0
        assert float(dz["inter_MB_rank"]) == pytest.approx(
            float(dz["ag_inter_MB_rank"]) + float(dz["rs_inter_MB_rank"]), abs=2e-3)


def test_cross_node_bytes(run):
    out, _ = run
    rows = {r["config"]: r for r in read_csv(out / "training.csv")}
    base, zpp = rows["zero3"], rows["zeropp"]
    # full ZeRO++ (int8 weights, in-node backward gather, int4 gradients) against fp32 all-gathers and
    # reduce-scatter: about 0.11x; well under 0.3x
    assert 0 < float(zpp["inter_MB_node"]) < 0.3 * float(base["inter_MB_node"])
    assert 0 < float(zpp["inter_MB_rank"]) < 0.3 * float(base["inter_MB_rank"])
    # the exact baseline: the tiny GPT's units are all under DeepSpeed's default persistence threshold, so one
    # bucketed gather per step and the reduce-scatter each send half of the fp32 model across (2 of 4 ranks
    # elsewhere): 2 * 2 * numel/4 * 4 bytes per rank, padding aside
    from zeropp.models.gpt import GPT, GPTConfig

    numel = GPT(GPTConfig.preset("tiny", block_size=16)).num_params()
    assert float(base["inter_MB_rank"]) == pytest.approx(4 * numel / 1e6, rel=0.05)
    assert float(base["inter_MB_node"]) == pytest.approx(2 * float(base["inter_MB_rank"]), rel=1e-3)
    # FSDP2 + zeropp's comms go through zeropp.comm: counted. Full ZeRO++ there sends well under ZeRO-3's bytes
    # across (int8 forward gathers, backward gathers inside the node, int4 gradients); hpZ alone moves the
    # backward gathers inside the node, so its cross-node bytes are ZeRO-3's (one gather and one reduce-scatter)
    fz = rows["fsdp2-zeropp"]
    assert 0 < float(fz["inter_MB_node"]) < 0.3 * float(base["inter_MB_node"])
    assert float(fz["intra_MB_rank"]) > 0
    assert float(rows["fsdp2-hpz"]["inter_MB_rank"]) == pytest.approx(float(base["inter_MB_rank"]), rel=0.05)
    qwz, qgz = rows["fsdp2-qwz"], rows["fsdp2-qgz"]
    assert 0 < float(qwz["ag_inter_MB_rank"]) < 0.3 * float(qgz["ag_inter_MB_rank"])  # int8 vs exact fp32 gathers
    assert 0 < float(qgz["rs_inter_MB_rank"]) < 0.1 * float(qwz["rs_inter_MB_rank"])  # int4 vs exact fp32 grads


def test_plots_and_table(run):
    out, proc = run
    for name in ("training_loss.png", "training_throughput.png"):
        assert (out / name).stat().st_size > 1000
    assert "inter MB/node" in proc.stdout and "zeropp" in proc.stdout
    assert "You are seeing" in proc.stdout and "NO rate limit" in proc.stdout
    assert "4 bytes per element in fp32" in proc.stdout
    # the sentence compares full ZeRO++ with what the user would otherwise run, from the table's step times
    step = {r["config"]: float(r["step_s"]) for r in read_csv(out / "training.csv")}
    for name, label in (("fsdp2", training.LABELS["fsdp2"]), ("hsdp", training.LABELS["hsdp"])):
        assert f"{step[name] / step['zeropp']:.2f}x as fast as {label}" in proc.stdout, proc.stdout[-1500:]


def test_step_lines_above_the_bars(run):
    """The engine's steps_per_print lines (rank 0, a process under the launcher) come out whole, each on its own
    line, never inside a progress bar; every config's bar ends on 3/3."""
    _, proc = run
    lines = screen(proc.stdout)
    step = re.compile(r"\[zeropp\] step=(\d+) loss=\S+ lr=\[\S+\] grad_norm=\S+ samples/s=\S+ loss_scale=\S+")
    bar = re.compile(r"(\S+) +\[[#.]{24}\] (\d)/3  +\d+\.\d\d step/s  loss +\S+")
    steps = [step.fullmatch(line) for line in lines if "[zeropp]" in line]
    assert steps and all(steps), [line for line in lines if "[zeropp]" in line]
    # the zeropp engines print (zero3, zeropp); FSDP2's rows have no steps_per_print
    assert [int(m.group(1)) for m in steps] == [1, 2, 3] * 2
    bars = [bar.fullmatch(line) for line in lines if "step/s" in line]
    assert bars and all(bars), [line for line in lines if "step/s" in line]
    assert [(m.group(1), m.group(2)) for m in bars] == [(name, "3") for name in CONFIGS]


def test_progress_bar_keeps_printed_lines_whole(capsys):
    """Lines printed in the block (to standard output or error, or logged) go to the bar's stream, above the bar
    when one is drawn; a line printed in parts is written once whole; the streams are restored after the block."""
    stream = io.StringIO()
    stdout, stderr = sys.stdout, sys.stderr
    log = logging.getLogger("test_progress_bar")  # a handler made before the bar, on stdout (DeepSpeed's)
    handler = logging.StreamHandler(sys.stdout)
    log.addHandler(handler)
    try:
        with ProgressBar(stream=stream, width=4) as bar:
            print("before")
            bar.update("cfg", 1, 2, "s1")
            print("step", end="")
            print(" one")
            sys.stderr.write("a warning\n  its source line\n")  # as warnings.showwarning writes
            log.warning("a record")
            bar.update("cfg", 2, 2)
            bar.finish()
            print("after")
            print("late warning", file=sys.stderr)
        assert (sys.stdout, sys.stderr, handler.stream) == (stdout, stderr, stdout)
    finally:
        log.removeHandler(handler)
    print("outside")
    assert capsys.readouterr() == ("outside\n", "")
    assert screen(stream.getvalue()) == ["before", "step one", "a warning", "  its source line", "a record",
                                         "cfg        [####] 2/2", "after", "late warning", ""]
    # another rank on the same terminal: draws nothing; its line replaces the bar instead of joining it
    drawn = io.StringIO()
    ProgressBar(stream=drawn, width=4).update("cfg", 1, 2)  # rank 0's
    with ProgressBar(stream=stream, elsewhere=True) as other:
        other.update("cfg", 1, 2)
        print("rank 1 warning", file=sys.stderr)
    other_rank = capsys.readouterr().err
    assert other_rank == "\r\x1b[Krank 1 warning\n"
    assert screen(drawn.getvalue() + other_rank) == ["rank 1 warning", ""]
    with ProgressBar(enabled=False, stream=stream) as bar:
        bar.update("cfg", 1, 2)
        assert (sys.stdout, sys.stderr) == (stdout, stderr)


def test_traffic_bars_measured_for_every_row():
    """The traffic plot's data from a shaped run's measurements: a NIC bar (the busiest node's transmit bytes per
    step) for every row, FSDP2's and HSDP's included; the counted split beside it where zeropp.comm counted."""
    args = training.parse_args(["--configs", "zero3,fsdp2,hsdp", "--steps", "4", "--warmup", "2"])
    args.load = (0.0, 0.0)
    per_step = {"calls": 0, "sent_intra": 0, "recv_intra": 0, "recv_inter": 0}

    def rank(nic_tx: float | None, inter: float | None) -> dict:
        kinds = None if inter is None else {"all_gather": {**per_step, "sent_inter": inter},
                                            "reduce_scatter": {**per_step, "sent_inter": inter, "sent_intra": 1e6}}
        return {"losses": [3.0] * 4, "times": [0.5] * 4, "phases": [(0.1, 0.3, 0.1)] * 4, "per_kind": kinds,
                "nic": None if nic_tx is None else (nic_tx, nic_tx), "window_s": 1.0, "eval_loss": 3.0}

    measured = {"zero3": (9e6, 2e6), "fsdp2": (12e6, None), "hsdp": (5e6, None)}  # node 0's NIC bytes, counted
    rows = []
    for name, (tx, inter) in measured.items():  # each node's first rank reads its NIC; node 1 sent less
        per_rank = [rank(tx, inter), rank(None, inter), rank(tx / 2, inter), rank(None, inter)]
        rows.append(training.summarize(name, per_rank, args, 2, 4, 64)[0])
    bars = training.traffic_bars(rows)
    assert [b["config"] for b in bars] == ["zero3", "fsdp2", "hsdp"]
    assert [b["nic_tx_MB"] for b in bars] == [9.0, 12.0, 5.0]
    assert bars[0]["counted_inter_MB"] == 2 * 2 * 2e6 / 1e6 and bars[0]["counted_intra_MB"] == 2.0
    assert bars[1]["counted_inter_MB"] is None and bars[2]["counted_intra_MB"] is None


def test_helpers():
    assert training.parse_rate("1gbit") == 1e9
    assert training.parse_rate("100mbit") == 1e8
    assert training.parse_rate("none") is None
    args = training.parse_args(["--quick", "--configs", "zero3,zeropp-w4"])
    assert args.steps == training.QUICK["steps"] and args.configs == ["zero3", "zeropp-w4"]
    cfg = training.zero_config("zeropp-w4", args, 2)["zero_optimization"]
    assert cfg["zero_hpz_partition_size"] == 2 and cfg["zeropp"]["weight_bits"] == 4
    assert cfg["zero_quantized_weights"] and cfg["zero_quantized_gradients"] and cfg["stage"] == 3
    with pytest.raises(SystemExit):
        training.parse_args(["--configs", "zero4"])
    args = training.parse_args(["--configs", "zero3@off,zeropp-ef", "--block-size", "256"])
    assert training.zero_config("zero3@off", args, 2)["zero_optimization"] == {"stage": 3, "overlap_comm": False}
    ef = training.zero_config("zeropp-ef", args, 2)["zero_optimization"]
    assert ef["overlap_comm"] and ef["zeropp"] == {"error_feedback": True, "block_size": 256}
    rot = training.zero_config("zeropp-rot", args, 2)["zero_optimization"]
    assert rot["zeropp"] == {"gradient_rotation": "hadamard", "block_size": 256} and rot["zero_quantized_gradients"]
    with pytest.raises(SystemExit):
        training.parse_args(["--configs", "zero3@maybe"])
    # two dtypes: every config in each, named NAME:DTYPE; bf16 turns bf16.enabled on; DeepSpeed only when installed
    args = training.parse_args(["--configs", "zero3,fsdp2", "--dtypes", "fp32,bf16"])
    assert args.configs == ["zero3:fp32", "fsdp2:fp32", "zero3:bf16", "fsdp2:bf16"]
    assert training.zero_config("zero3:bf16", args, 2)["bf16"] == {"enabled": True}
    assert training.baseline_of("fsdp2:bf16") == "zero3:bf16"
    args = training.parse_args(["--configs", "fsdp2-zeropp,fsdp2-qwz,fsdp2-hpz,fsdp2-qgz", "--dtypes", "bf16"])
    assert args.configs == ["fsdp2-zeropp", "fsdp2-qwz", "fsdp2-hpz", "fsdp2-qgz"] and args.dtypes == ["bf16"]
    with pytest.raises(SystemExit):
        training.parse_args(["--dtypes", "fp8"])
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit):
            training.parse_args(["--configs", "deepspeed"])
        with pytest.raises(SystemExit):
            training.parse_args(["--configs", "deepspeed-zeropp"])
    else:  # deepspeed-zeropp: the zeropp row's ZeRO++ keys, DeepSpeed's spelling, no zeropp block (its blocks are fixed)
        args = training.parse_args(["--configs", "deepspeed-zeropp", "--block-size", "256"])
        zero = training.zero_config("deepspeed-zeropp", args, 2)["zero_optimization"]
        assert zero == {"stage": 3, "overlap_comm": True, "zero_quantized_weights": True,
                        "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
