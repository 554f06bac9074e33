"""``zeropp.deepspeed``: DeepSpeed's own ZeRO-3 engine with ZeRO++ flags running on zeropp's collectives.

Real gloo processes, DeepSpeed's CPU accelerator (which cannot run DeepSpeed's own qwZ/qgZ: its quantizer op is
"not implemented on CPU backend"), 4 ranks as 2 emulated nodes (``LOCAL_SIZE`` for DeepSpeed,
``ZEROPP_RANKS_PER_NODE`` for zeropp), the byte-level GPT with a vocabulary of 251 (no size a multiple of 8).
Each launch trains DeepSpeed's exact ZeRO-3, then qwZ, then qwZ + hpZ + qgZ with zeropp installed, from one
seed on the same batches.
"""

from __future__ import annotations

import math
from importlib import metadata

import pytest

import zeropp.deepspeed
from deepspeed_launch import launch
from zeropp.deepspeed import versions


def _deepspeed_installed() -> bool:
    # Package metadata, not find_spec: this directory (tests/deepspeed) would pass for a namespace package.
    try:
        metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_deepspeed = pytest.mark.skipif(
    not _deepspeed_installed(),
    reason=f"deepspeed is not installed ({versions.INSTALL_HINT})",
)

WORLD, RANKS_PER_NODE = 4, 2
BLOCK = 128


def test_missing_and_unsupported_deepspeed_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"needs DeepSpeed, which is not installed: DS_BUILD_OPS=0 pip install"):
        zeropp.deepspeed.install()
    monkeypatch.setattr(versions.metadata, "version", lambda name: "0.14.0")
    with pytest.raises(zeropp.deepspeed.UnsupportedDeepSpeedVersion, match=r"supports DeepSpeed 0\.19\.8.*0\.14\.0"):
        zeropp.deepspeed.install()
    assert not zeropp.deepspeed.installed()


@needs_deepspeed
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepspeed_zero3_runs_zeropp(tmp_path, dtype: str) -> None:

    steps = 4
    results = launch(
        "deepspeed_workers:train", WORLD, tmp_path, timeout=600,
        env={"DS_ACCELERATOR": "cpu", "ZEROPP_RANKS_PER_NODE": str(RANKS_PER_NODE)},
        cases=["exact", "qwz", "zeropp"], steps=steps, vocab=251, dtype=dtype, ranks_per_node=RANKS_PER_NODE,
    )
    torch_dtype = "torch.float32" if dtype == "fp32" else "torch.bfloat16"
    nodes = WORLD // RANKS_PER_NODE
    for r in results:
        assert r["restored"]
        exact, qwz, full = r["exact"], r["qwz"], r["zeropp"]
        # The capture itself: DeepSpeed's exact gathers give the initial weights bit for bit.
        assert exact["params_equal"] == exact["params_seen"] == 29 and exact["dtypes"] == [torch_dtype]
        # qwZ at step 0: every weight within half its block's scale (blocks of one parameter's shard), not exact.
        assert qwz["worst_ratio"] <= 1.0 and qwz["differ"] > 0 and qwz["dtypes"] == [torch_dtype]
        # hpZ: step 0's forward reads the secondary shards DeepSpeed made at init, in the node, exactly.
        assert full["params_equal"] == full["params_seen"]
        for case in (qwz, full):  # (bf16 losses are too coarse to tell the runs apart; the weights and bytes do)
            for got, want in zip(case["losses"], exact["losses"]):
                assert math.isclose(got, want, rel_tol=0.01), (case["losses"], exact["losses"])
        # Cross-node bytes (zeropp's counters): forward qwZ gathers of steps 1.. (int8 codes + a float32 scale per
        # block, blocks per parameter shard) to the other node's ranks; qgZ's hop 2, int4, to the other node.
        padded = full["padded_shard_elems"]
        assert full["stats"]["all_gather"]["sent_inter"] == (steps - 1) * (WORLD - RANKS_PER_NODE) * (
            padded + 4 * padded // BLOCK)
        assert full["stats"]["reduce_scatter"]["sent_inter"] == steps * (nodes - 1) * (padded // 2 + 4 * padded // BLOCK)
        assert exact["stats"]["all_gather"]["calls"] == 0 and qwz["stats"]["reduce_scatter"]["calls"] == 0
