"""The convergence harness (zeropp.bench.convergence): one torchrun job of 2 gloo ranks as 2 emulated nodes of 1, the
tiny preset, 4 steps, three configs: exact ZeRO-3 (named), exact ZeRO-3 again, and int4 weights + int4 gradients
from a DeepSpeed JSON file. Checked against independent numbers: the exact run's training losses and eval loss
equal a single-process training of the same model on the same global batches (plain torch AdamW, clipping, the
held-out text); running exact twice gives the same curve bit for bit and a difference of exactly 0; int4 moves
fewer cross-node bytes and ends at another, finite eval loss. The argument and config helpers are checked without
a launch."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import worker_quant_backend

from zeropp.bench import convergence
from zeropp.config import load_config
from zeropp.data import TextBatches
from zeropp.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
STEPS, SEQ, MICRO, WORLD, EVAL_EVERY, EVAL_BATCHES, LR = 4, 16, 2, 2, 2, 2, 1e-3
INT4 = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                              "zeropp": {"weight_bits": 4}}}
OPTIONS = ["--model", "preset:tiny", "--steps", str(STEPS), "--seq", str(SEQ), "--micro-batch", str(MICRO),
           "--eval-every", str(EVAL_EVERY), "--eval-batches", str(EVAL_BATCHES), "--warmup", "1",
           "--lr", str(LR), "--lr-warmup", "0", "--data-bytes", str(1 << 18)]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    (out / "int4.json").write_text(json.dumps(INT4))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE",
                                                              "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(ZEROPP_QUANT_BACKEND=worker_quant_backend(), OMP_NUM_THREADS="1", ZEROPP_RANKS_PER_NODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
         "-m", "zeropp.bench.convergence", *OPTIONS, "--configs", "exact", "exact", str(out / "int4.json"),
         "--out", str(out), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def single_process() -> tuple[list[float], float]:
    """The exact run's numbers, computed without the engine: one process trains the tiny GPT on each step's whole
    global batch (AdamW, gradient clipping 1.0), then evaluates the held-out batches."""
    args = convergence.parse_args([*OPTIONS])
    train, held = convergence.split_corpus(convergence.corpus_of(args), SEQ)
    data = TextBatches(train, seq_len=SEQ, global_batch=MICRO * WORLD, seed=0)
    evals = TextBatches(held, seq_len=SEQ, global_batch=MICRO * WORLD, seed=10_000)
    model = GPT(GPTConfig.preset("tiny", block_size=SEQ), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        _, loss = model(*data.global_batch(step))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        ev = sum(model(*evals.global_batch(k))[1].item() for k in range(EVAL_BATCHES)) / EVAL_BATCHES
    return losses, ev


def test_results_against_single_process_and_each_other(run):
    out, stdout = run
    rows = {r["config"]: r for r in read_csv(out / "results.csv")}
    assert list(rows) == ["exact", "exact#2", "int4"]
    curves = read_csv(out / "curves.csv")
    train = {name: [float(c["train_loss"]) for c in curves if c["config"] == name] for name in rows}
    evals = {name: [(int(c["step"]), float(c["eval_loss"])) for c in curves if c["config"] == name and c["eval_loss"]]
             for name in rows}
    losses, ev = single_process()
    assert train["exact"] == pytest.approx(losses, rel=1e-5)
    assert float(rows["exact"]["eval_loss"]) == pytest.approx(ev, rel=1e-5)
    assert [s for s, _ in evals["exact"]] == [2, 4]
    # exact twice: the same numbers bit for bit
    assert train["exact#2"] == train["exact"] and evals["exact#2"] == evals["exact"]
    assert float(rows["exact#2"]["eval_diff"]) == 0.0 and float(rows["exact#2"]["eval_diff_pct"]) == 0.0
    assert rows["exact#2"]["inter_MB_step"] == rows["exact"]["inter_MB_step"]
    # int4 weights and gradients: another curve, fewer bytes across the nodes; one rank per node: nothing inside
    int4, exact = rows["int4"], rows["exact"]
    diff = float(int4["eval_diff"])
    assert math.isfinite(diff) and diff != 0.0
    assert diff == pytest.approx(float(int4["eval_loss"]) - float(exact["eval_loss"]), abs=1e-12)
    assert float(int4["eval_diff_pct"]) == pytest.approx(100 * diff / float(exact["eval_loss"]), rel=1e-9)
    assert 0 < float(int4["inter_MB_step"]) < 0.4 * float(exact["inter_MB_step"])
    assert float(int4["inter_vs_ref"]) == pytest.approx(float(int4["inter_MB_step"]) / float(exact["inter_MB_step"]))
    assert float(exact["intra_MB_step"]) == 0.0 and float(int4["intra_MB_step"]) == 0.0
    assert float(exact["step_s"]) > 0 and float(exact["speedup"]) == 1.0
    assert (out / "curves.png").stat().st_size > 10_000
    assert "| config" in stdout and "| int4" in stdout and "Reference: exact." in stdout


def test_config_helpers(tmp_path):
    """Named configs get the ranks per node for hpZ; a JSON file's own blocks win whole; batch keys come from the
    harness only when the file sets none; a different global batch is refused before training."""
    args = convergence.parse_args(["--micro-batch", "3", "--lr", "0.01", "--configs", "exact", "zeropp"])
    assert args.labels == ["exact", "zeropp"]
    zpp = convergence.config_dict("zeropp", args, 4)
    assert zpp["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert zpp["train_micro_batch_size_per_gpu"] == 3 and zpp["optimizer"]["params"]["lr"] == 0.01
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"train_batch_size": 12, "optimizer": {"type": "Adam", "params": {"lr": 0.5}},
                               "zero_optimization": {"stage": 3}}))
    cfg = convergence.config_dict(str(own), args, 2)
    assert cfg["optimizer"] == {"type": "Adam", "params": {"lr": 0.5}}
    assert "train_micro_batch_size_per_gpu" not in cfg and cfg["gradient_clipping"] == 1.0
    assert convergence.labels(["exact", "exact", str(own), "exact"]) == ["exact", "exact#2", "own", "exact#3"]
    with pytest.raises(SystemExit, match="same train_batch_size"):
        convergence.check_batches(["exact", str(own)], [convergence.config_dict("exact", args, 2), cfg], 2)
    with pytest.raises(SystemExit):
        convergence.parse_args(["--configs", "no-such-config"])
    bench_configs = sorted((Path(__file__).parents[2] / "bench" / "configs").glob("*.json"))
    assert bench_configs, "bench/configs/*.json (the configs of docs/results/accuracy.md) are missing"
    for spec in [*convergence.NAMED, *map(str, bench_configs)]:  # every named and committed config is valid
        load_config(convergence.config_dict(spec, args, 2), world_size=4)
    with pytest.raises(SystemExit, match="module:attr"):
        convergence.model_factory("nocolon", args)
    assert isinstance(convergence.model_factory("torch.nn:Identity", args)(), torch.nn.Identity)
    with pytest.raises(SystemExit, match="no attribute"):
        convergence.model_factory("torch.nn:NoSuchModel", args)
