"""``enable``: turn ZeRO++'s quantized collectives on for modules already wrapped with FSDP2's ``fully_shard``."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .. import comm
from ..quant import DEFAULT_BLOCK_SIZE, BlockFormat
from .all_gather import ZeroppAllGather
from .hpz import check_hpz, install_check
from .reduce_scatter import ZeroppReduceScatter, check_error_feedback, check_gradient_rotation
from .segments import fsdp_group, shard_numels


def enable(
    modules: nn.Module | Iterable[nn.Module],
    *,
    weight_bits: int | None = 8,
    gradient_bits: int | None = 4,
    hpz: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    error_feedback: bool = False,
    gradient_rotation: int | None = None,
    topology: comm.Topology | None = None,
    ranks_per_node: int | None = None,
) -> comm.Topology:
    """Install zeropp's all-gather (qwZ) and reduce-scatter (qgZ) on every FSDP2 module in ``modules``.

    Call it on every rank, after ``fully_shard`` and before the first forward: it is a collective over the shard
    group when it creates the topology. ``modules`` may be the root model: every ``fully_shard``-ed module inside it
    (itself included) gets the comms, one set per FSDP2 group: ``fully_shard([a, b])`` (as accelerate wraps a model's
    final norm with its tied embedding and head) is one group, gathered as one, with per-parameter qwZ blocks like
    any other. Byte counts land in ``zeropp.comm.stats()``.

    hpZ is FSDP2's own ``reshard_after_forward=<int>``, which only ``fully_shard`` accepts (torch 2.13's
    ``set_reshard_after_forward`` takes a bool): wrap every module but the root with
    ``fully_shard(m, reshard_after_forward=hpz)`` and pass the same ``hpz`` here, which checks it (see
    ``zeropp.fsdp.hpz``). The backward all-gathers then run exact over ``hpz`` ranks of one node, on the weights
    forward gathered.

    Args:
        modules: a module (searched for FSDP2 modules) or several.
        weight_bits: 8 or 4: parameter all-gathers over the shard group are block-quantized (qwZ), each
            parameter's shard on its own (blocks never span two parameters); ``None``: exact.
        gradient_bits: 8 or 4: gradient reduce-scatters run the two-hop qgZ; ``None``: exact.
        hpz: ranks of a secondary (post-forward) partition, usually the ranks per node; must divide the ranks per
            node and equal the modules' ``reshard_after_forward``. Checked now (divisibility, FSDP2's post-forward
            groups inside nodes) and at each module's first forward (how it was wrapped). ``None``: no check;
            gathers over any post-forward group run exact anyway.
        block_size: elements per quantization block (a positive multiple of 2 the quantizer accepts).
        error_feedback: with ``gradient_bits``: each FSDP2 module keeps its gradient buffer's quantization
            residuals (``zeropp.comm.ErrorFeedback``: float32, the module's whole flat gradient, ``P`` shards,
            plus one shard per node) and adds them to its next reduction, so the error summed over steps stays
            bounded instead of growing with the number of steps.
        gradient_rotation: with ``gradient_bits``: the block size (16, 32, 64 or 128, dividing ``block_size``)
            of a Hadamard rotation of each rank's gradient slice before qgZ quantizes it, undone after the
            reduction (``zeropp.comm.reduce_scatter``'s ``rotation``; ``docs/rotation.md``); ``None``: off.
        topology: the ``zeropp.comm.Topology`` of the modules' shard group (default: made here from that group,
            with ``ranks_per_node`` or ``$ZEROPP_RANKS_PER_NODE`` / ``$LOCAL_WORLD_SIZE``, checked against hosts).
        ranks_per_node: ranks per node when the topology is made here.

    Returns:
        The topology used.

    Raises:
        ValueError: unsupported bits or block size, no FSDP2 module, a mesh that is not 1-D (HSDP, or FSDP
            inside a 2-D mesh: refused, not served wrongly), modules on different meshes, a ``topology`` whose
            ranks are not the shard group's, an ``hpz`` that does not divide the ranks per node or whose FSDP2
            groups would span nodes, or ``error_feedback`` or ``gradient_rotation`` without ``gradient_bits``, or a
            ``gradient_rotation`` that is no rotation size dividing ``block_size``.
    """
    for name, bits in (("weight_bits", weight_bits), ("gradient_bits", gradient_bits)):
        if bits is not None and (isinstance(bits, bool) or bits not in (8, 4)):
            raise ValueError(f"{name}={bits!r} is not supported; use 8, 4 or None (exact)")
    BlockFormat(8, block_size)  # raises naming a bad block size
    check_error_feedback(error_feedback, gradient_bits)
    check_gradient_rotation(gradient_rotation, gradient_bits, block_size)
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    fsdp_modules: list[FSDPModule] = []
    for root in roots:
        if not isinstance(root, nn.Module):
            raise TypeError(f"modules must be nn.Module(s), got {type(root).__name__}")
        fsdp_modules.extend(m for m in root.modules() if isinstance(m, FSDPModule) and m not in fsdp_modules)
    if not fsdp_modules:
        raise ValueError(
            "zeropp.fsdp.enable found no FSDP2 module: wrap the model with torch.distributed.fsdp.fully_shard "
            "first, then call enable on it"
        )
    mesh = _shard_mesh(fsdp_modules)
    group = mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    if topology is None:
        topology = comm.Topology(group, ranks_per_node)
    elif topology.ranks != ranks:
        raise ValueError(
            f"topology covers ranks {topology.ranks} but the modules are sharded over ranks {ranks}; pass the "
            "topology of the fully_shard mesh's group (comm.Topology(mesh.get_group())) or none"
        )
    if hpz is not None:
        check_hpz(hpz, mesh, topology)
        # the post-forward group's twin with zeropp's timeout (ZeroppAllGather), made now, not in the first backward
        order = mesh.mesh.flatten().tolist()
        start = order.index(topology.global_rank) // hpz * hpz
        topology.subgroup(order[start : start + hpz])
    groups = list(dict.fromkeys(fsdp_group(m) for m in fsdp_modules))  # type: ignore[arg-type]
    for group in groups:
        # one per group (fully_shard call; setting a comm on one of its modules sets it for the group): the
        # all-gather knows the group's parameter segments (blocks never span two), the reduce-scatter holds the
        # group's gradient buffer's error-feedback residuals
        first: FSDPModule = group[0]  # type: ignore[assignment]
        first.set_custom_all_gather(ZeroppAllGather(topology, weight_bits, block_size, shard_numels(first)))
        first.set_custom_reduce_scatter(ZeroppReduceScatter(topology, gradient_bits, block_size, error_feedback,
                                                            gradient_rotation))
    if hpz is not None:
        install_check(groups, hpz)
    return topology


def _shard_mesh(fsdp_modules: list[FSDPModule]) -> DeviceMesh:
    """The one 1-D mesh that every FSDP2-managed parameter of ``fsdp_modules`` is sharded over."""
    meshes = []
    for m in fsdp_modules:
        for p in m.parameters():  # type: ignore[attr-defined]
            if isinstance(p, DTensor) and all(p.device_mesh is not q for q in meshes):
                meshes.append(p.device_mesh)
    if not meshes:
        raise ValueError("zeropp.fsdp.enable: the FSDP2 modules hold no sharded (DTensor) parameters")
    for mesh in meshes:
        if mesh.ndim != 1:
            raise ValueError(
                f"zeropp.fsdp.enable serves 1-D meshes only; got a {mesh.ndim}-D mesh of shape "
                f"{tuple(mesh.shape)} (names {mesh.mesh_dim_names}): HSDP and FSDP combined with tensor/other "
                "parallelism are not supported yet. Use fully_shard with a 1-D mesh over the data-parallel ranks"
            )
    groups = {tuple(dist.get_process_group_ranks(mesh.get_group())) for mesh in meshes}
    if len(groups) > 1:
        raise ValueError(
            f"zeropp.fsdp.enable: the modules are sharded over different groups {sorted(groups)}; call enable "
            "once per group with that group's modules"
        )
    return meshes[0]


def check_enable_kwargs(caller: str, enable_kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` naming ``caller`` if ``enable_kwargs`` holds a keyword ``enable`` does not take (for the
    integrations that pass ``enable``'s keyword arguments through: ``zeropp.hf``, ``zeropp.torchtitan``)."""
    accepted = frozenset(inspect.signature(enable).parameters) - {"modules"}
    bad = sorted(set(enable_kwargs) - accepted)
    if bad:
        raise TypeError(f"{caller} got {bad}, which zeropp.fsdp.enable does not take; it takes {sorted(accepted)}")
