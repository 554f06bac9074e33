"""bench/torchtitan_configs.py, what bench/torchtitan_gpu.sh runs on GPUs, checked on the CPU: torchtitan's
command line makes its three configs (zeropp's hook in two, the same settings in all), its synthetic dataloader
gives each data-parallel rank its own next-token batches, and its summary reads torchtitan's step lines and fails
what it should."""

from __future__ import annotations

import csv
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed("torchtitan"),
                                reason="needs torchtitan (pip install -e '.[torchtitan]')")


@pytest.fixture(scope="module")
def configs() -> ModuleType:
    """bench/torchtitan_configs.py, imported as torchtitan's command line imports it (``--module
    torchtitan_configs``), which then finds it imported."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import torchtitan_configs
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return torchtitan_configs


def test_command_line_configs(configs: ModuleType) -> None:
    from torchtitan.config import ConfigManager

    made = {name: ConfigManager().parse_args(["--module", "torchtitan_configs", "--config", f"llama3_debugmodel_{name}",
                                              "--training.steps", "7"])
            for name in configs.CONFIGS}
    for name, config in made.items():
        assert (config.training.steps, config.training.disable_cuda_graphs, config.parallelism.spmd_backend,
                config.debug.seed, config.debug.deterministic) == (7, True, "partial_dtensor", 0, True), name
        assert isinstance(config.dataloader, configs.SyntheticDataLoader.Config)
        assert (config.model_spec.post_optimizer_build_fn is None) == (name == "baseline")


def test_synthetic_batches(configs: ModuleType) -> None:
    import torch

    tokenizer = configs.SyntheticTokenizer.Config().build(tokenizer_path="unused")
    batches = []
    for rank in (0, 1):
        loader = configs.SyntheticDataLoader.Config().build(dp_world_size=2, dp_rank=rank, tokenizer=tokenizer,
                                                           seq_len=16, local_batch_size=3)
        batches.append(next(iter(loader)))
    for inputs, labels in batches:
        assert inputs["input"].shape == labels.shape == inputs["positions"].shape == (3, 16)
        assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])  # next-token labels
        assert torch.equal(inputs["positions"], torch.arange(16).expand(3, 16))
        assert 0 <= int(inputs["input"].min()) and int(inputs["input"].max()) < tokenizer.get_vocab_size()
    assert not torch.equal(batches[0][0]["input"], batches[1][0]["input"])


def _log(path: Path, losses: list[float], all_gather_bytes: int | None = None) -> None:
    """A rank-0 log as torchrun --tee writes it, with torchtitan's step line (MetricsProcessor.log's format,
    colors included) and the zeropp configs' stats line."""
    lines = [f"[rank0]:[titan] INFO - \x1b[31mstep: {s:2}  \x1b[32mloss: {loss:8.5f}  \x1b[33mgrad_norm:  1.0000  "
             f"\x1b[36mmemory:  1.00GiB(1.00%)  \x1b[34mtps: {12_000 + s:,}  \x1b[36mtflops: 1.00  "
             f"\x1b[35mmfu: 0.10%\x1b[39m" for s, loss in enumerate(losses, 1)]
    if all_gather_bytes is not None:
        stats = {kind: {"calls": 8, "sent_intra": all_gather_bytes, "sent_inter": 0, "recv_intra": 0, "recv_inter": 0}
                 for kind in ("all_gather", "reduce_scatter")}
        lines.append(f"[rank0]:zeropp.comm.stats rank 0: {stats}")
    path.write_text("\n".join(lines) + "\n")


def test_summary(configs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("NGPU", "8")
    base = [8.1, 7.8, 7.2, 6.9, 6.5, 6.1, 5.8]
    _log(tmp_path / "baseline.log", base)
    _log(tmp_path / "zeropp_exact.log", base, 1000)
    _log(tmp_path / "zeropp.log", [x * 1.01 for x in base], 520)
    assert configs.summarize(str(tmp_path)) == 0
    assert "all checks passed" in capsys.readouterr().out
    with open(tmp_path / "summary.csv") as f:
        rows = {row["config"]: row for row in csv.DictReader(f)}
    assert float(rows["zeropp"]["max_rel_diff_vs_baseline"]) == pytest.approx(0.01)
    assert rows["zeropp"]["all_gather_bytes"] == "520" and rows["zeropp_exact"]["median_tps"] == "12006.5"
    _log(tmp_path / "zeropp_exact.log", [*base[:-1], 5.79], 1000)  # one step off
    _log(tmp_path / "zeropp.log", [x * 1.03 for x in base], 1000)  # 3% off, no fewer bytes
    assert configs.summarize(str(tmp_path)) == 3
    _log(tmp_path / "zeropp.log", base[:3])  # cut short, no stats line
    assert configs.summarize(str(tmp_path)) >= 3
