"""The Hugging Face ``transformers.Trainer`` on zeropp: DeepSpeed ZeRO-3 with ZeRO++ flags through
``zeropp.deepspeed.install()``, and accelerate's FSDP2 through ``zeropp.hf.ZeroppCallback``.

Real gloo processes (2 ranks as 2 emulated nodes of one rank each, so qgZ's cross-node hop runs), a GPT-2 of two
layers built from a config (no download), 24 steps with a Trainer checkpoint at step 12. Each launch trains the
runs its worker lists (tests/hf/hf_workers.py) from one seed on the same data: the reference run without zeropp,
the zeropp runs, and a run resumed from the zeropp run's checkpoint.
"""

from __future__ import annotations

import functools
import math
import sys
from importlib import metadata
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "comm"))

from comm_launch import launch as _launch

launch = functools.partial(_launch, worker_dirs=[HERE])
STEPS, SAVE_AT = 24, 12
ENV = {"ZEROPP_RANKS_PER_NODE": "1", "LOCAL_SIZE": "1", "DS_ACCELERATOR": "cpu"}


def _installed(*names: str) -> bool:
    try:
        for name in names:
            metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _check_resumed(runs: dict) -> None:
    """The resumed run's steps after the checkpoint are the uninterrupted run's, bit for bit (its log history
    before the checkpoint is the checkpoint's own)."""
    resumed, full = runs["resumed"]["losses"], runs["zeropp"]["losses"]
    assert sorted(resumed) == sorted(full) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in range(SAVE_AT + 1, STEPS + 1)] == [full[s] for s in range(SAVE_AT + 1, STEPS + 1)]


def _check_close(got: dict, want: dict, rel: float) -> None:
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=rel), (step, got, want)
    # the model learns: the last steps' loss is below the first steps'
    assert sum(got[s] for s in range(STEPS - 3, STEPS + 1)) < sum(got[s] for s in range(1, 5)) - 0.1


@pytest.mark.skipif(not _installed("transformers", "accelerate", "deepspeed"),
                    reason="needs transformers, accelerate and deepspeed (pip install -e '.[test]')")
def test_trainer_deepspeed_zeropp(tmp_path: Path) -> None:
    """Trainer(deepspeed=ZeRO-3 + qwZ + qgZ) after zeropp.deepspeed.install(): trains within 1% of DeepSpeed's exact
    ZeRO-3 per step (DeepSpeed alone cannot run these flags on CPU), resumes from its checkpoint bit for bit, and
    save_model writes whole weights that from_pretrained loads equal to the ranks' partitions put together."""
    results = launch("hf_workers:deepspeed_trainer", 2, tmp_path, env=ENV, timeout=600, steps=STEPS,
                     save_at=SAVE_AT, tmp=str(tmp_path))
    for runs in results:
        assert runs["exact"]["zeropp_bytes"] == 0 and runs["zeropp"]["zeropp_bytes"] > 0
        _check_close(runs["zeropp"]["losses"], runs["exact"]["losses"], 0.01)
        assert runs["zeropp"]["losses"] != runs["exact"]["losses"]  # quantized: not the exact run
        _check_resumed(runs)
        assert not any(run["save_mismatches"] for run in runs.values()), runs
    assert results[0] == results[1]


@pytest.mark.skipif(not _installed("transformers", "accelerate"),
                    reason="needs transformers and accelerate (pip install -e '.[test]')")
def test_trainer_fsdp2_zeropp(tmp_path: Path) -> None:
    """Trainer(fsdp=True, version 2) with ZeroppCallback: exact comms give plain FSDP2's losses bit for bit (zeropp's
    comms did run: counted bytes), int8/int4 train within 1% of them with fewer bytes, the int8/int4 run resumes
    from its checkpoint bit for bit (the callback enables on the resumed model too), and save_model writes whole
    weights that from_pretrained loads equal to the trained shards put together."""
    results = launch("hf_workers:fsdp_trainer", 2, tmp_path, env=ENV, timeout=600, steps=STEPS, save_at=SAVE_AT,
                     tmp=str(tmp_path))
    for runs in results:
        plain, exact, quant, resumed = runs["plain"], runs["exact"], runs["zeropp"], runs["resumed"]
        assert plain["fsdp_modules"] >= 4
        assert not any(s["calls"] for s in plain["stats"].values())
        assert exact["losses"] == plain["losses"]
        _check_close(quant["losses"], plain["losses"], 0.01)
        assert quant["losses"] != plain["losses"]
        for kind in ("all_gather", "reduce_scatter"):
            assert exact["stats"][kind]["calls"] == quant["stats"][kind]["calls"] > 0
            # int8 weights (+ a scale per block) and int4 gradients: well under half the exact bytes
            assert quant["stats"][kind]["sent_inter"] < 0.3 * exact["stats"][kind]["sent_inter"]
            # the resumed run enabled zeropp too: half the steps, half the traffic
            assert 2 * resumed["stats"][kind]["sent_inter"] == quant["stats"][kind]["sent_inter"]
        _check_resumed(runs)
        assert not any(run["save_mismatches"] for run in runs.values()), runs
    assert results[0]["zeropp"]["losses"] == results[1]["zeropp"]["losses"]


@pytest.mark.skipif(not _installed("transformers"), reason="needs transformers (pip install -e '.[test]')")
def test_callback_names_bad_use() -> None:
    import torch

    from zeropp.hf import ZeroppCallback

    with pytest.raises(TypeError, match=r"\['bits'\], which zeropp.fsdp.enable does not take"):
        ZeroppCallback(bits=8)
    with pytest.raises(ValueError, match=r"holds no FSDP2 module.*zeropp.deepspeed.install\(\)"):
        ZeroppCallback(weight_bits=8).on_train_begin(None, None, None, model=torch.nn.Linear(2, 2))
