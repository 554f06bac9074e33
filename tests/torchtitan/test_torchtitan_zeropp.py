"""torchtitan's FSDP2 on zeropp through ``zeropp.torchtitan.configure``: torchtitan's llama3 ``parallelize_fn`` and
the model spec's ``post_optimizer_build_fn`` hook on real gloo processes (2 ranks as 2 emulated nodes of one rank
each, so qgZ's cross-node hop runs). One launch trains every run of tests/torchtitan/torchtitan_workers.py from one
seed on the same data: torchtitan's parallelization alone, with zeropp's exact comms, and with int8 weights /
int4 gradients; rank 0 also collects the hook's refusals and parses a config registry function through
torchtitan's command-line parser.

torchtitan's ``Trainer`` itself cannot run on CPU (see ``zeropp.torchtitan``); bench/torchtitan_gpu.sh runs it on GPUs.
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
STEPS = 8
ENV = {"ZEROPP_RANKS_PER_NODE": "1"}


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("torchtitan"), reason="needs torchtitan (pip install -e '.[torchtitan]')")
def test_torchtitan_llama3_zeropp(tmp_path: Path) -> None:
    """Exact comms give torchtitan's own losses and weights bit for bit (zeropp's comms did run: counted calls),
    int8/int4 trains within 1% of them per step with about half the all-gather bytes (of bf16 weights) and an
    eighth of the reduce-scatter bytes (of fp32 gradients), the config survives torchtitan's command
    line, and the hook refuses what zeropp.fsdp does not serve."""
    import torch

    results = launch("torchtitan_workers:train", 2, tmp_path, env=ENV, timeout=600, steps=STEPS)
    for runs in results:
        plain, exact, quant = runs["plain"], runs["exact"], runs["zeropp"]
        # torchtitan's units: embeddings, norm and lm_head (one unit), 2 blocks, the root; one 1-D CPU mesh of 2 ranks
        assert plain["fsdp_modules"] == exact["fsdp_modules"] == 6
        assert plain["fsdp_meshes"] == exact["fsdp_meshes"] == [(1, 2, "cpu")]
        assert not any(s["calls"] for s in plain["stats"].values())
        assert exact["losses"] == plain["losses"]
        assert exact["shards"].keys() == plain["shards"].keys()
        assert all(torch.equal(exact["shards"][k], plain["shards"][k]) for k in plain["shards"])
        for step, (got, want) in enumerate(zip(quant["losses"], plain["losses"])):
            assert math.isclose(got, want, rel_tol=0.01), (step, quant["losses"], plain["losses"])
        assert quant["losses"] != plain["losses"]  # quantized: not the exact run
        # torchtitan's mixed precision gathers bf16 weights (int8: about half the bytes) and reduces fp32
        # gradients (int4: about an eighth)
        for kind, ratio in (("all_gather", 0.53), ("reduce_scatter", 0.15)):
            assert exact["stats"][kind]["calls"] == quant["stats"][kind]["calls"] > 0
            assert quant["stats"][kind]["sent_inter"] < ratio * exact["stats"][kind]["sent_inter"]
    refusals = results[0]["refusals"]
    for name in ("hsdp", "tp", "pp", "cp"):
        assert refusals[name].startswith("ValueError: zeropp.torchtitan serves FSDP over a 1-D"), refusals
    assert "data_parallel_replicate_degree (HSDP)=2" in refusals["hsdp"]
    assert "tensor_parallel_degree=2" in refusals["tp"]
    assert "needs parallelism.spmd_backend=partial_dtensor" in refusals["spmd_types"]
    # torchtitan's command line keeps configure's hook and settings, and an override of them is refused
    assert refusals["command_line"] == ("_post_optimizer_build_fn.<locals>.post_optimizer_build_fn",
                                        "partial_dtensor", True)
    assert "needs parallelism.spmd_backend=partial_dtensor" in refusals["command_line_spmd_types"]
    assert refusals["bad_kwarg"].startswith("TypeError: zeropp.torchtitan.configure got ['bits']")
    assert refusals["no_spec"].startswith("ValueError: zeropp.torchtitan.configure needs a torchtitan Trainer.Config")
