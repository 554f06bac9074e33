"""The parameters an FSDP2 module manages, in the order FSDP2 lays them out in its flat all-gather input, and the
per-rank size of each one's segment there.

How FSDP2 (torch 2.13, ``_fsdp_init._get_managed_modules`` / ``_get_managed_states`` and
``_fsdp_collectives.foreach_all_gather``) builds a module's all-gather input: the managed modules are found by a
depth-first walk from the ``fully_shard``-ed module that does not enter nested ``fully_shard``-ed modules and lists
each module AFTER its children (post-order); the managed parameters are each managed module's own parameters
(``recurse=False``) in that module order, a shared parameter once, ignored parameters left out. On every rank the
input is the concatenation, in that order, of every parameter's padded shard: ``ceil(size[d] / P)`` slices of the
sharded dim ``d`` (0 by default), zero-padded, ``ceil(size[d] / P) * numel / size[d]`` elements, nothing in
between. Everything here reads public state (``nn.Module`` children and parameters, ``DTensor`` placements).
"""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard


def managed_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner, name, parameter)`` of every parameter ``module``'s own FSDP2 state manages (nested FSDP2 modules'
    excluded), in FSDP2's order; a parameter shared by several modules appears once, under its first owner.
    Parameters ``fully_shard`` ignored are included (they are not DTensors: ``shard_numels`` skips them)."""
    order: list[nn.Module] = []
    visited: set[nn.Module] = set()

    def walk(m: nn.Module) -> None:
        visited.add(m)
        for child in m.children():
            if child not in visited and not isinstance(child, FSDPModule):
                walk(child)
        order.append(m)

    walk(module)
    seen: set[int] = set()
    out = []
    for m in order:
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((m, name, p))
    return out


def shard_numels(module: nn.Module) -> list[int]:
    """Per-rank elements of each managed DTensor parameter's padded shard, in FSDP2's all-gather order: the
    segments of the flat input FSDP2 passes to the module's custom all-gather (see the module docstring)."""
    sizes = []
    for _, _, p in managed_parameters(module):
        if not isinstance(p, DTensor):
            continue
        placement = p.placements[0]
        dim = placement.dim if isinstance(placement, Shard) else 0
        length = p.shape[dim]
        if length == 0:
            sizes.append(0)
            continue
        sizes.append(math.ceil(length / p.device_mesh.size()) * (p.numel() // length))
    return sizes
