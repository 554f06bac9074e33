"""The tests' own account of FSDP2's flat all-gather layout for the GPT as the workers wrap it (``fully_shard`` per
block, then the root), written from the layout's definition rather than from ``zeropp.fsdp.segments``, so that the
byte formulas and per-parameter references in the tests check the library instead of repeating it."""

from __future__ import annotations

import math

import torch

from zeropp.models import GPT


def padded_shard_numel(p: torch.Tensor, world: int) -> int:
    """Elements of one rank's zero-padded dim-0 shard of ``p`` (FSDP2's all-gather input for that parameter)."""
    return math.ceil(p.shape[0] / world) * math.prod(p.shape[1:])


def gpt_units(model: GPT) -> list[list[tuple[str, torch.Tensor]]]:
    """The parameters of each FSDP2 unit, blocks first, the root (the rest, the tied ``lm_head`` once) last. FSDP2
    orders a unit's parameters by a post-order walk of its modules; in this GPT only leaf modules hold parameters,
    so that is ``named_parameters``' order."""
    units = [[(f"blocks.{i}.{n}", p) for n, p in block.named_parameters()] for i, block in enumerate(model.blocks)]
    in_blocks = {name for unit in units for name, _ in unit}
    units.append([(n, p) for n, p in model.named_parameters() if n not in in_blocks])
    return units


def gpt_unit_segments(model: GPT, world: int) -> list[list[int]]:
    """Per unit (``gpt_units``' order), the per-rank elements of each parameter's padded shard."""
    return [[padded_shard_numel(p, world) for _, p in unit] for unit in gpt_units(model)]
