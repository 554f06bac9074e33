"""The parameters an FSDP2 group manages, in the order FSDP2 lays them out in its flat all-gather input, and the
per-rank size of each one's segment there.

A group is what one ``fully_shard`` call made: ``fully_shard(m)`` makes the group ``(m,)``, ``fully_shard([a, b])``
(accelerate does this for a model's final norm and its tied embedding and head) makes ONE group ``(a, b)``: one
FSDP2 state, one flat all-gather input holding the parameters of both, one custom all-gather (setting it on ``a``
sets it for ``b``). ``fsdp_group`` finds a module's group (``zeropp._torch_internals.fsdp_group_modules``: nothing
public says which modules share a state); everything else here reads public state (``nn.Module`` children and
parameters, ``DTensor`` placements).

How FSDP2 (torch 2.13, ``_fsdp_init._get_managed_modules`` / ``_get_managed_states`` and
``_fsdp_collectives.foreach_all_gather``) builds a group's all-gather input: the managed modules are found by a
depth-first walk from each of the group's modules in turn (one visited set) that does not enter other
``fully_shard``-ed modules and lists each module AFTER its children (post-order); the managed parameters are each
managed module's own parameters (``recurse=False``) in that module order, a shared parameter once, ignored
parameters left out. On every rank the input is the concatenation, in that order, of every parameter's padded
shard: ``ceil(size[d] / P)`` slices of the sharded dim ``d`` (0 by default), zero-padded,
``ceil(size[d] / P) * numel / size[d]`` elements, nothing in between.
"""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .._torch_internals import fsdp_group_modules


def fsdp_group(module: nn.Module) -> tuple[nn.Module, ...]:
    """The group of the FSDP2 module ``module``: the modules of the ``fully_shard`` call that made it, in the order
    FSDP2 walks them (``(module,)`` unless it was ``fully_shard``-ed together with others)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDP2 module (no fully_shard applied to it)")
    return fsdp_group_modules(module)


def managed_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner, name, parameter)`` of every parameter that the FSDP2 state of ``module`` (an FSDP2 module) manages:
    those of its whole group (``fsdp_group``), other FSDP2 modules' excluded, in FSDP2's order; a parameter shared
    by several modules appears once, under its first owner. Parameters ``fully_shard`` ignored are included (they
    are not DTensors: ``shard_numels`` skips them)."""
    group = fsdp_group(module)
    order: list[nn.Module] = []
    visited: set[nn.Module] = set()

    def walk(m: nn.Module) -> None:
        visited.add(m)
        for child in m.children():
            if child not in visited and (child in group or not isinstance(child, FSDPModule)):
                walk(child)
        order.append(m)

    for root in group:
        walk(root)
    seen: set[int] = set()
    out = []
    for m in order:
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((m, name, p))
    return out


def shard_numels(module: nn.Module) -> list[int]:
    """Per-rank elements of each managed DTensor parameter's padded shard in the group of the FSDP2 module
    ``module``, in FSDP2's all-gather order: the segments of the flat input FSDP2 passes to the group's custom
    all-gather (see the module docstring)."""
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
