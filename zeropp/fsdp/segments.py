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
shard: ``ceil(size[d] / P)`` slices of the sharded dim ``d`` (0 by default; ``P`` the shard group's size, HSDP's
shard dim), zero-padded,
``ceil(size[d] / P) * numel / size[d]`` elements, nothing in between.

``staging`` and ``format_parts`` lay segments out for the hooks: block-aligned for qwZ (blocks never span two
parameters), and split by format where per-parameter rules give one group several (``zeropp.fsdp.rules``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .._torch_internals import fsdp_group_modules
from ..quant.format import ceil_div
from .mesh import is_tp_sharded, segment_numel


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
    all-gather (see the module docstring; a tensor-parallel parameter's segment is a slice of its tp-local
    tensor: ``zeropp.fsdp.mesh.segment_numel``)."""
    return [segment_numel(p) for _, _, p in managed_parameters(module) if isinstance(p, DTensor)]


Run = tuple[int, int, int]
"""``(flat offset, staged offset, length)``: a stretch of segments contiguous in both layouts."""


def staging(segments: Sequence[int], block_size: int, picked: Sequence[bool] | None = None) -> tuple[int, list[Run]]:
    """The staged layout of the ``picked`` segments (default: all) of a flat buffer laid out as ``segments``: each
    non-empty picked segment starts at a multiple of ``block_size`` (1: packed back to back), the last one is not
    padded. Returns the staged numel and the copy runs, each run a maximal stretch of consecutive picked segments
    that is contiguous in both layouts."""
    runs: list[Run] = []
    flat = staged = end = 0
    for i, length in enumerate(segments):
        if length == 0 or (picked is not None and not picked[i]):
            flat += length
            continue
        if runs and runs[-1][0] + runs[-1][2] == flat and runs[-1][1] + runs[-1][2] == staged:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((flat, staged, length))
        flat += length
        staged += length
        end = staged
        staged = ceil_div(staged, block_size) * block_size
    return end, runs


@dataclass(frozen=True)
class FormatPart:
    """The segments of one group that share one format (per-parameter rules): moved by one collective of ``bits``
    (``None``: exact) on a staged buffer of ``numel`` elements per rank, copied to and from the group's flat
    buffer by ``runs`` (``staging``)."""

    bits: int | None
    numel: int
    runs: list[Run]


def format_parts(segments: Sequence[int], bits: Sequence[int | None], block_size: int, *,
                 align: bool, classes: Sequence[int] | None = None) -> list[FormatPart]:
    """One ``FormatPart`` per distinct value of ``bits`` (one per segment), in order of first appearance among the
    non-empty segments; with ``classes`` (one per segment), one per distinct ``(bits, class)`` instead (qgZ keeps
    tensor-parallel-replicated and -sharded parameters apart: ``tp_sharded``). With ``align`` a quantized part
    starts each segment at a block boundary (qwZ: blocks never span two parameters), else (and for exact parts) its
    segments are packed back to back."""
    if len(bits) != len(segments):
        raise ValueError(f"{len(bits)} formats for {len(segments)} segments: give one per segment")
    keys = list(zip(bits, classes if classes is not None else [0] * len(bits)))
    parts = []
    for key in dict.fromkeys(k for k, s in zip(keys, segments) if s):
        fmt = key[0]
        numel, runs = staging(segments, block_size if align and fmt is not None else 1, [k == key for k in keys])
        parts.append(FormatPart(fmt, numel, runs))
    return parts


def tp_sharded(module: nn.Module) -> list[int]:
    """Per managed DTensor parameter of the FSDP2 module ``module``'s group (``shard_numels``' order): 1 if tensor
    parallelism shards it (its tp ranks hold different values), else 0 (every tp rank holds the same values and
    must keep them so: ``zeropp.fsdp.mesh.is_tp_sharded``)."""
    return [int(is_tp_sharded(p)) for _, _, p in managed_parameters(module) if isinstance(p, DTensor)]
