"""The Hugging Face ``transformers.Trainer`` on zeropp: DeepSpeed ZeRO-3 with ZeRO++ flags through
``zeropp.deepspeed.install()``, and accelerate's FSDP2 through ``zeropp.hf.ZeroppCallback``.

Real gloo processes, a GPT-2 of two layers built from a config (no download), 24 steps with a Trainer checkpoint at
step 12. Each launch trains the runs its worker lists (tests/hf/hf_workers.py) from one seed on the same data: the
reference run without zeropp, the zeropp runs, and a run resumed from the zeropp run's checkpoint.

Two launches: FSDP2 on 2 ranks as 2 emulated nodes of one rank each (so qgZ's cross-node hop runs), and hpZ through
both paths on 4 ranks as 2 emulated nodes of 2 (hpZ partitions of 2, inside a node): DeepSpeed's ZeRO-3 with qwZ,
hpZ and qgZ (24 steps, checkpoint resume), then FSDP2 sharded by the user with ``reshard_after_forward=2``.
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
HPZ_WORLD, HPZ, FSDP_HPZ_STEPS = 4, 2, 12
HPZ_ENV = {"ZEROPP_RANKS_PER_NODE": str(HPZ), "LOCAL_SIZE": str(HPZ), "DS_ACCELERATOR": "cpu"}


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
    _check_close_steps(got, want, rel, STEPS)


def _check_close_steps(got: dict, want: dict, rel: float, steps: int) -> None:
    """Per step within ``rel`` of ``want``, and the model learns: the last 4 steps' loss below the first 4's."""
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=rel), (step, got, want)
    assert sum(got[s] for s in range(steps - 3, steps + 1)) < sum(got[s] for s in range(1, 5)) - 0.1


@pytest.fixture(scope="module")
def hpz_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if not _installed("transformers", "accelerate", "deepspeed"):
        pytest.skip("needs transformers, accelerate and deepspeed (pip install -e '.[test]')")
    tmp = tmp_path_factory.mktemp("hpz")
    return launch("hf_workers:hpz_trainers", HPZ_WORLD, tmp, env=HPZ_ENV, timeout=900, steps=STEPS, save_at=SAVE_AT,
                  fsdp_steps=FSDP_HPZ_STEPS, tmp=str(tmp), hpz=HPZ)


def test_trainer_deepspeed_zeropp(hpz_runs: list[dict]) -> None:
    """Trainer(deepspeed=ZeRO-3 + qwZ + hpZ 2 + qgZ) after zeropp.deepspeed.install(), 4 ranks on 2 nodes: the hpZ
    partitions are each rank's node; trains within 1% of DeepSpeed's exact ZeRO-3 per step (DeepSpeed alone cannot
    run these flags on CPU), resumes from its checkpoint bit for bit, and save_model writes whole weights that
    from_pretrained loads equal to the ranks' partitions put together."""
    for rank, r in enumerate(hpz_runs):
        runs = r["deepspeed"]
        node = tuple(range(rank // HPZ * HPZ, (rank // HPZ + 1) * HPZ))
        assert runs["exact"]["hpz_groups"] == [()]
        assert runs["zeropp"]["hpz_groups"] == runs["resumed"]["hpz_groups"] == [node]
        assert runs["exact"]["zeropp_bytes"] == 0 and runs["zeropp"]["zeropp_bytes"] > 0
        _check_close(runs["zeropp"]["losses"], runs["exact"]["losses"], 0.01)
        assert runs["zeropp"]["losses"] != runs["exact"]["losses"]  # quantized: not the exact run
        _check_resumed(runs)
        assert not any(run["save_mismatches"] for run in runs.values()), runs
    assert all(r["deepspeed"]["zeropp"]["losses"] == hpz_runs[0]["deepspeed"]["zeropp"]["losses"] for r in hpz_runs)


def test_trainer_fsdp2_hpz(hpz_runs: list[dict]) -> None:
    """FSDP2 sharded by the user before the Trainer (GPT-2 blocks with reshard_after_forward=2, then the root;
    fsdp_config auto_wrap_policy NO_WRAP) and ZeroppCallback(hpz=2): accelerate trains that very model, wrapped as it was (no unit of its own, blocks
    resharded to the 2 ranks of a node after forward); qwZ + hpZ + qgZ train within 1% of the same model without
    zeropp; and the backward gathers stay in the node and exact: every gather over the 4 ranks sends one peer of
    its node half what it sends the two of the other node, so the in-node bytes beyond that half are the backward
    gathers', each rank sending its half of both blocks' fp32 weights to its one node peer per step."""
    for r in hpz_runs:
        plain, quant = r["fsdp"]["plain"], r["fsdp"]["zeropp"]
        for run in (plain, quant):
            assert run["same_model"]
            assert run["fsdp_modules"] == ["", "transformer.h.0", "transformer.h.1"]
            assert run["post_forward_mesh"] == {((2, 2),) * 12}  # every parameter of block 0, after each forward
        assert sorted(quant["losses"]) == sorted(plain["losses"]) == list(range(1, FSDP_HPZ_STEPS + 1))
        _check_close_steps(quant["losses"], plain["losses"], 0.01, FSDP_HPZ_STEPS)
        assert quant["losses"] != plain["losses"]
        gather = quant["stats"]["all_gather"]
        assert gather["calls"] == FSDP_HPZ_STEPS * (1 + 2 * 2)  # the root once; each block forward and backward
        assert gather["sent_intra"] - gather["sent_inter"] // 2 == FSDP_HPZ_STEPS * 2 * quant["block_numel"] * 4 // 2
        assert not any(s["calls"] for s in plain["stats"].values())


@pytest.mark.skipif(not _installed("transformers", "accelerate"),
                    reason="needs transformers and accelerate (pip install -e '.[test]')")
def test_trainer_fsdp2_zeropp(tmp_path: Path) -> None:
    """Trainer(fsdp=True, version 2) with ZeroppCallback: exact comms give plain FSDP2's losses bit for bit (zeropp's
    comms did run: counted bytes), int8/int4 train within 1% of them with fewer bytes, the int8/int4 run resumes
    from its checkpoint bit for bit (the callback enables on the resumed model too), and save_model writes whole
    weights that from_pretrained loads equal to the trained shards put together. accelerate shards the final norm,
    the embedding and the tied head as one fully_shard group: zeropp serves it without warning (per-parameter
    blocks)."""
    results = launch("hf_workers:fsdp_trainer", 2, tmp_path, env=ENV, timeout=600, steps=STEPS, save_at=SAVE_AT,
                     tmp=str(tmp_path))
    for runs in results:
        plain, exact, quant, resumed = runs["plain"], runs["exact"], runs["zeropp"], runs["resumed"]
        # accelerate's units: the blocks, one group of the final norm with the tied embedding and head, the root
        assert sorted(plain["fsdp_modules"]) == ["", "lm_head", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
                                         "transformer.wte"]
        # that group's qwZ blocks are per parameter: no "a block may span two parameters" warning
        assert all(run["zeropp_warnings"] == [] for run in runs.values()), runs
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
