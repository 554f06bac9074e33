"""The unit layout that keeps quantization blocks inside one parameter (no processes: a stand-in for the engine's
``Collectives`` gives the world size and rank).

With qwZ or qgZ on, the collectives quantize each rank's shard (each reduce-scatter slice, the same ranges) as
one pack whose blocks start at the shard start. The unit pads every parameter's offset and the shard size to
multiples of the block size, so those blocks are the global grid and none holds two parameters' elements.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zeropp.engine import Unit
from zeropp.quant import BlockFormat, dequantize_chunks, quantize_chunks


class FakeCollectives:
    """What ``Unit`` needs from ``Collectives`` to lay itself out (one process: no communication)."""

    def __init__(self, world_size: int, rank: int, alignment: int) -> None:
        self.world_size, self.rank, self.alignment = world_size, rank, alignment
        self.hpz, self.partition_rank, self.error_feedback = 1, 0, False

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def make_unit(sizes: list[int], world: int, rank: int, align: int, values: list[float] | None = None) -> Unit:
    params = []
    for i, n in enumerate(sizes):
        data = torch.full((n,), values[i]) if values is not None else torch.randn(n)
        params.append((f"p{i}", nn.Parameter(data)))
    return Unit("u", params, FakeCollectives(world, rank, align), sharded=False)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    world=st.sampled_from([1, 2, 3, 4, 8]),
    block=st.sampled_from([16, 32, 128]),
)
def test_no_grid_block_holds_two_parameters(sizes, world, block):
    unit = make_unit(sizes, world, 0, block)
    S = unit.shard_numel
    assert all(off % block == 0 for off in unit.offsets)
    assert S % block == 0 and unit.full.numel() == world * S >= unit.numel
    # parameters in order, not overlapping, each whole inside the buffer
    ends = [off + n for off, n in zip(unit.offsets, sizes)]
    assert all(e <= o for e, o in zip(ends, unit.offsets[1:])) and ends[-1] == unit.numel
    owner = torch.full((world * S,), -1)
    for i, (off, n) in enumerate(zip(unit.offsets, sizes)):
        owner[off : off + n] = i
    # the blocks each rank's pack holds: [r * S + j * block, ... + block), j < S / block
    for r in range(world):
        for j in range(S // block):
            lo = r * S + j * block
            held = set(owner[lo : lo + block].tolist()) - {-1}
            assert len(held) <= 1, (r, j, held)
    # the cost: under one block per parameter, plus under one block per rank for the shard rounding
    assert world * S - sum(sizes) < block * (len(sizes) + world)


def test_exact_layout_is_phase_1s():
    """Without quantization the parameters stay back to back and the shard is ceil(numel / P)."""
    unit = make_unit([5, 7, 300], 4, 1, 1)
    assert unit.offsets == [0, 5, 12] and unit.numel == 312 and unit.shard_numel == 78 and unit.start == 78


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_shards_keep_a_tiny_parameter_next_to_a_huge_one(bits):
    """End to end through the real pack format: a parameter of 1e-6s between parameters of 1e3s survives each
    rank's shard quantization (one scale per parameter); were a block shared, its codes would round to zero."""
    block, world = 32, 4
    sizes, values = [45, 3, 70, 1, 33], [1e3, -1e-6, 2e2, 1e-6, -1e3]
    for rank in range(world):
        unit = make_unit(sizes, world, rank, block, values)
        fmt = BlockFormat(bits, block)
        back = torch.empty(unit.shard_numel)
        dequantize_chunks(quantize_chunks(unit.shard, fmt), fmt, 1, unit.shard_numel, back)
        expect = unit.full[unit.start : unit.start + unit.shard_numel]
        torch.testing.assert_close(back, expect, rtol=1e-6, atol=0.0)
    # the same buffer laid out back to back (align 1) loses the tiny parameter: the check above has teeth
    unit = make_unit(sizes, 1, 0, 1, values)
    back = torch.empty(unit.shard_numel)
    fmt = BlockFormat(bits, block)
    dequantize_chunks(quantize_chunks(unit.shard, fmt), fmt, 1, unit.shard_numel, back)
    assert torch.all(back[45:48] == 0)
