"""zeropp.comm on real processes over gloo: topology, exact and quantized all-gather / reduce-scatter, byte
counters, async handles, error feedback, bad input, and one run of the Triton kernels (interpreter on CPU).

Each test launches one process group and runs a batch of checks in it (see comm_workers.py); the workers use the
torch reference backend of zeropp.quant except ``test_kernels_through_collectives``.
"""

from __future__ import annotations

import importlib.util

import pytest
from comm_launch import launch, launch_cases
from conftest import exact_triton


@pytest.mark.parametrize(
    "world, layouts",
    [
        (2, [{"d": 1}, {"d": 2}]),
        (4, [{"d": 1}, {"d": 2}, {"d": 4},
             # hosts that interleave the global ranks: nodes {0, 2} and {1, 3} (qgZ must reorder its packs)
             {"d": 2, "hosts": ["h0", "h1", "h0", "h1"], "nodes": [[0, 2], [1, 3]]},
             # local index 1's inter-node group {2, 3} lists the nodes in the opposite order to index 0's {0, 1}
             {"d": 2, "hosts": ["a", "b", "b", "a"], "nodes": [[0, 3], [1, 2]]}]),
        (8, [{"d": 1}, {"d": 2}, {"d": 4}]),
    ],
    ids=["world2", "world4", "world8"],
)
def test_collectives(tmp_path, world, layouts):
    results = launch("comm_workers:collectives", world, tmp_path, timeout=300, layouts=layouts)
    # Sanity on the quantization error (the per-element bounds are checked in the workers): int8 well below
    # int4, both far from useless.
    for summary in results:
        for layout, rels in summary.items():
            # heavy-tailed inputs (an outlier in every block): the rotation lowers int4's error
            assert rels.pop("rotation_gain") < 0.7, (layout, rels)
            # int8 on the intra-node hop: less error than int4 on both hops; with one rank per node there is no
            # intra-node hop and intra_bits changes nothing
            gain = rels.pop("hop_gain")
            if layout == "d=1":
                assert gain == 1.0, (layout, gain)
            else:
                assert gain < 0.95, (layout, gain)
            assert rels.pop("int2_vs_int4") > 1.5, (layout, rels)  # int2 codes are coarser than int4
            for key, rel in rels.items():
                if "-8-" in key:
                    assert rel < 0.03, (layout, key, rel)
                elif "-4-" in key:
                    assert rel < 0.5, (layout, key, rel)


def test_dp_subgroups_and_single_rank(tmp_path):
    launch("comm_workers:dp_subgroups", 4, tmp_path)


def test_errors(tmp_path):
    messages = launch("comm_workers:errors", 4, tmp_path)[0]
    # the messages name the bad value and the fix
    assert "ZEROPP_RANKS_PER_NODE" in messages["not_multiple"]
    assert "'a'" in messages["hosts"] and "3 ranks" in messages["hosts"]
    assert ".contiguous()" in messages["noncontig"]
    assert "[1, 2, 3] must be distinct members of the group [0, 1, 2, 3] and include this rank (0)" in \
        messages["subgroup"]
    assert "pass bits=8 or 4, or rotation=None" in messages["rotation_exact"]
    assert "(16, 32, 64, 128)" in messages["rotation_size"]
    assert "use a smaller rotation" in messages["rotation_block"]
    assert "pass bits=8, 4 or 2, or intra_bits=None" in messages["intra_exact"]
    assert "use None (exact), 8, 4 or 2" in messages["intra_bits"]


def test_error_feedback_lowers_accumulated_error(tmp_path):
    """One node of 4 and 2 nodes of 2, in one launch."""
    runs = launch_cases("comm_workers:error_feedback", 4, tmp_path, {"d1": {"d": 1}, "d2": {"d": 2}}, steps=16)
    for name, results in runs.items():
        for r in results:
            assert r["feedback"] * 4 < r["plain"] and r["feedback_rotated"] * 4 < r["plain"], (name, r)
            assert r["feedback_g2"] * 3 < r["plain_g2"], (name, r)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_through_collectives(tmp_path, kernel_device):
    if kernel_device != "cpu":
        pytest.skip("gloo runs on CPU tensors; the GPU kernels are covered by tests/quant")
    exact_triton("cpu")
    launch("comm_workers:kernels", 4, tmp_path, env={"TRITON_INTERPRET": "1"}, timeout=300)
