"""torchtitan config registry for bench/torchtitan_gpu.sh: torchtitan's ``llama3_debugmodel`` on synthetic data,
without zeropp and with ``zeropp.torchtitan.configure``.

    torchrun --nproc_per_node=N -m torchtitan.train --module torchtitan_configs --config llama3_debugmodel_zeropp

(with bench/ and the repository root on ``PYTHONPATH``); ``python bench/torchtitan_configs.py OUTDIR`` summarizes
the runs' logs (OUTDIR/<config>.log, rank 0's output) and exits non-zero when a check fails.

The data are arithmetic token sequences mod the model's vocabulary (2048), one document per sequence, drawn per
data-parallel rank from a fixed seed, so the runs need no dataset or tokenizer files (torchtitan's own debug run
reads ``tests/assets`` of a torchtitan checkout, which the wheel lacks) and every config trains on the same
batches. Every config sets what ``configure`` sets (``spmd_backend="partial_dtensor"``, no CUDA graphs), a seed
and deterministic algorithms, so the runs differ only in zeropp. Under torchrun the zeropp configs print
``zeropp.comm.stats()`` at exit, one line per rank (``zeropp.comm.stats rank R: {...}``).
"""

from __future__ import annotations

import atexit
import ast
import dataclasses
import os
import re
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

import zeropp.torchtitan
from zeropp import comm
from zeropp.bench.report import markdown_table, write_csv

VOCAB = 2048  # llama3_debugmodel's


class SyntheticTokenizer(BaseTokenizer):
    """A tokenizer that only knows its vocabulary size (the synthetic data are token ids already)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("SyntheticTokenizer holds no vocabulary: the synthetic data are token ids")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("SyntheticTokenizer holds no vocabulary: the synthetic data are token ids")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _Sequences(IterableDataset):
    """Endless ``({"input": ids, "positions": 0..seq_len-1}, labels)`` samples: arithmetic sequences mod ``vocab``
    with a stride from 1 to 8, from a generator seeded by the data-parallel rank."""

    def __init__(self, vocab: int, seq_len: int, dp_rank: int) -> None:
        self.vocab, self.seq_len, self.dp_rank = vocab, seq_len, dp_rank

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        g = torch.Generator().manual_seed(1000 + self.dp_rank)
        positions = torch.arange(self.seq_len)
        while True:
            start = torch.randint(0, self.vocab, (1,), generator=g)
            stride = torch.randint(1, 9, (1,), generator=g)
            ids = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
            yield {"input": ids[:-1], "positions": positions}, ids[1:]


class SyntheticDataLoader(ParallelAwareDataloader):
    """torchtitan's data-parallel dataloader over ``_Sequences``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "synthetic"
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs: Any) -> None:
        super().__init__(_Sequences(config.vocab_size, seq_len, dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size)


def _debugmodel() -> Trainer.Config:
    config = llama3_debugmodel()
    return dataclasses.replace(
        config,
        tokenizer=SyntheticTokenizer.Config(),
        dataloader=SyntheticDataLoader.Config(),
        training=dataclasses.replace(config.training, steps=50, disable_cuda_graphs=True),
        parallelism=dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor"),
        debug=dataclasses.replace(config.debug, seed=0, deterministic=True),
    )


def _zeropp(**enable_kwargs: Any) -> Trainer.Config:
    if "RANK" in os.environ:  # under torchrun; at exit torchtitan has destroyed the process group
        rank = os.environ["RANK"]
        atexit.register(lambda: print(f"zeropp.comm.stats rank {rank}: {comm.stats()}", flush=True))
    return zeropp.torchtitan.configure(_debugmodel(), **enable_kwargs)


def llama3_debugmodel_baseline() -> Trainer.Config:
    """torchtitan's FSDP2 on its own (NCCL) collectives."""
    return _debugmodel()


def llama3_debugmodel_zeropp_exact() -> Trainer.Config:
    """zeropp's comms, exact: the baseline's numbers."""
    return _zeropp(weight_bits=None, gradient_bits=None)


def llama3_debugmodel_zeropp() -> Trainer.Config:
    """qwZ (int8 weights) and qgZ (int4 gradients)."""
    return _zeropp(weight_bits=8, gradient_bits=4)


CONFIGS = ("baseline", "zeropp_exact", "zeropp")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eE]+).*?tps:\s*([0-9,]+)")
_STATS = re.compile(r"zeropp\.comm\.stats rank 0: (\{.*\})")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _read_log(path: str) -> dict[str, Any]:
    """Per-step losses and tokens/s, and rank 0's ``zeropp.comm.stats`` line, from a run's rank-0 output."""
    losses, tps, stats = {}, {}, None
    with open(path, errors="replace") as f:
        for line in f:
            line = _ANSI.sub("", line)
            if (m := _STEP.search(line)) is not None:
                losses[int(m[1])] = float(m[2])
                tps[int(m[1])] = int(m[3].replace(",", ""))
            elif (m := _STATS.search(line)) is not None:
                stats = ast.literal_eval(m[1])
    return {"losses": losses, "tps": tps, "stats": stats}


def summarize(out_dir: str) -> int:
    """Print the runs' table (last loss, largest per-step loss difference from the baseline, median tokens/s after
    5 steps, zeropp's bytes), write it to OUTDIR/summary.csv, and check: every run logged the baseline's steps,
    the exact run's losses are the baseline's at the printed precision (1e-5), the int8/int4 run's within 2%;
    zeropp's comms ran (calls > 0) unless FSDP2 had one rank, and int8/int4 sent fewer bytes than exact.
    Returns the number of failed checks."""
    runs = {name: _read_log(os.path.join(out_dir, f"{name}.log")) for name in CONFIGS}
    base = runs["baseline"]["losses"]
    failures = []
    if not base:
        failures.append("the baseline logged no step")
    rows = []
    for name, run in runs.items():
        losses, tps, stats = run["losses"], run["tps"], run["stats"] or {}
        if sorted(losses) != sorted(base):
            failures.append(f"{name} logged steps {sorted(losses)}, the baseline {sorted(base)}")
        diff = max((abs(losses[s] - base[s]) / abs(base[s]) for s in base if s in losses), default=float("nan"))
        rows.append({
            "config": name,
            "steps": len(losses),
            "last_loss": losses[max(losses)] if losses else float("nan"),
            "max_rel_diff_vs_baseline": diff,
            "median_tps": statistics.median([v for s, v in tps.items() if s > 5] or [float("nan")]),
            "all_gather_calls": stats.get("all_gather", {}).get("calls", ""),
            "all_gather_bytes": sum(stats.get("all_gather", {}).get(k, 0) for k in ("sent_intra", "sent_inter")),
            "reduce_scatter_bytes": sum(stats.get("reduce_scatter", {}).get(k, 0)
                                        for k in ("sent_intra", "sent_inter")),
        })
    exact, quant = runs["zeropp_exact"], runs["zeropp"]
    if any(abs(exact["losses"].get(s, float("inf")) - base[s]) > 1e-5 for s in base):
        failures.append("zeropp_exact's losses are not the baseline's")
    if any(not abs(quant["losses"].get(s, float("inf")) - base[s]) <= 0.02 * abs(base[s]) for s in base):
        failures.append("zeropp's (int8/int4) losses are not within 2% of the baseline's")
    for name in ("zeropp_exact", "zeropp"):
        if runs[name]["stats"] is None:
            failures.append(f"{name} printed no zeropp.comm.stats line for rank 0")
    calls = [runs[n]["stats"]["all_gather"]["calls"] for n in ("zeropp_exact", "zeropp") if runs[n]["stats"]]
    world = int(os.environ.get("NGPU", "0"))
    if world > 1 and not all(calls):
        failures.append(f"zeropp's all-gather ran {calls} times on {world} GPUs")
    if world > 1 and rows[2]["all_gather_bytes"] >= rows[1]["all_gather_bytes"]:
        failures.append("int8/int4 sent no fewer all-gather bytes than exact")
    write_csv(rows, os.path.join(out_dir, "summary.csv"))
    columns = list(rows[0])
    print(markdown_table(columns, [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in columns]
                                   for r in rows]))
    for failure in failures:
        print(f"FAILED: {failure}")
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return len(failures)


if __name__ == "__main__":
    sys.exit(min(summarize(sys.argv[1]), 1))
