"""``enable``: turn ZeRO++'s quantized collectives on for modules already wrapped with FSDP2's ``fully_shard``."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .. import comm
from ..config import Rule
from ..config.blocks import LOCO_BETA
from ..quant import DEFAULT_BLOCK_SIZE, BlockFormat
from ..quant.format import SUPPORTED_BITS
from .all_gather import ZeroppAllGather
from . import hsdp as _hsdp
from .hpz import check_hpz, install_check
from .mesh import shard_mesh, shard_topology
from .reduce_scatter import ZeroppReduceScatter, check_error_feedback, check_gradient_rotation, check_intra_bits
from .rules import group_formats, resolve_rules
from .segments import fsdp_group, shard_numels, tp_sharded
from .weight_deltas import DeltaAllGather, register


def enable(
    modules: nn.Module | Iterable[nn.Module],
    *,
    weight_bits: int | None = 8,
    gradient_bits: int | None = 4,
    hpz: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    error_feedback: bool | str = False,
    error_feedback_beta: float = LOCO_BETA,
    stochastic_rounding: bool = False,
    gradient_rotation: int | None = None,
    gradient_bits_intra: int | None = None,
    rules: Sequence[Rule | Mapping[str, Any]] | None = None,
    weight_deltas: bool = False,
    delta_bits: int = 4,
    topology: comm.Topology | None = None,
    ranks_per_node: int | None = None,
    replicate_bits: int | None | str = _hsdp.GRADIENT_BITS,
) -> comm.Topology:
    """Install zeropp's all-gather (qwZ) and reduce-scatter (qgZ) on every FSDP2 module in ``modules``.

    Call it on every rank, after ``fully_shard`` and before the first forward: it is a collective over the shard
    group when it creates the topology. The shard group is FSDP2's dp group: the modules' 1-D mesh, or, with tensor
    parallelism (``parallelize_module`` on ``world["tp"]``, then ``fully_shard(mesh=world["dp"])``, pipeline stages
    on a ``pp`` dim), the dp dim of a 2-D / 3-D world mesh; qwZ and qgZ run over it only (``zeropp.fsdp.mesh``,
    ``docs/fsdp_meshes.md``). ``modules`` may be the root model: every ``fully_shard``-ed module inside it
    (itself included) gets the comms, one set per FSDP2 group: ``fully_shard([a, b])`` (as accelerate wraps a model's
    final norm with its tied embedding and head) is one group, gathered as one, with per-parameter qwZ blocks like
    any other. Byte counts land in ``zeropp.comm.stats()``.

    hpZ is FSDP2's own ``reshard_after_forward=<int>``, which only ``fully_shard`` accepts (torch 2.13's
    ``set_reshard_after_forward`` takes a bool): wrap every module but the root with
    ``fully_shard(m, reshard_after_forward=hpz)`` and pass the same ``hpz`` here, which checks it (see
    ``zeropp.fsdp.hpz``). The backward all-gathers then run exact over ``hpz`` ranks of one node, on the weights
    forward gathered.

    HSDP (``fully_shard(mesh=<2-D (replicate, shard) DeviceMesh>)``): qwZ and qgZ act on the shard dim, and the
    cross-replica gradient all-reduce runs in ``replicate_bits`` (a qgZ reduce-scatter plus a quantized
    all-gather over the replicate dim; ``zeropp.fsdp.hsdp``, ``docs/fsdp_hsdp.md``). The shard and replicate
    topologies are derived from the mesh and the hosts. With tensor parallelism, ``parallelize_module`` on
    ``world["tp"]`` then ``fully_shard(mesh=world["replicate", "shard"])`` of a 3-D world mesh is served the same
    way (tp-replicated and -sharded gradients reduced apart, as on a dp x tp mesh).

    Args:
        modules: a module (searched for FSDP2 modules) or several.
        weight_bits: 8 or 4: parameter all-gathers over the shard group are block-quantized (qwZ), each
            parameter's shard on its own (blocks never span two parameters); ``None``: exact.
        gradient_bits: 8, 4 or 2: gradient reduce-scatters run the two-hop qgZ (the bits of the inter-node hop,
            and of both unless ``gradient_bits_intra``); ``None``: exact.
        hpz: ranks of a secondary (post-forward) partition, usually the ranks per node; must divide the ranks per
            node and equal the modules' ``reshard_after_forward``. Checked now (divisibility, FSDP2's post-forward
            groups inside nodes) and at each module's first forward (how it was wrapped). ``None``: no check;
            gathers over any post-forward group run exact anyway.
        block_size: elements per quantization block (a positive multiple of 2 the quantizer accepts).
        error_feedback: with ``gradient_bits``: each FSDP2 module keeps its gradient buffer's quantization
            residuals (``zeropp.comm.ErrorFeedback``: float32, the module's whole flat gradient, ``P`` shards,
            plus one shard per node) and adds them to its next reduction, so the error summed over steps stays
            bounded instead of growing with the number of steps. ``"loco"``: the residuals as LoCo's 8-bit moving
            average (1 + 4 / ``block_size`` bytes per element instead of 4; ``zeropp.comm.ErrorFeedback``).
        error_feedback_beta: LoCo's moving-average coefficient, in ``[0, 1)`` (``error_feedback="loco"``).
        stochastic_rounding: with ``gradient_bits``: qgZ rounds its codes stochastically (unbiased), seeded by the
            FSDP2 group's index and its call count, so a run reproduces bit for bit.
        gradient_rotation: with ``gradient_bits``: the block size (16, 32, 64 or 128, dividing ``block_size``)
            of a Hadamard rotation of each rank's gradient slice before qgZ quantizes it, undone after the
            reduction (``zeropp.comm.reduce_scatter``'s ``rotation``; ``docs/rotation.md``); ``None``: off.
        gradient_bits_intra: with quantized gradients: 8, 4 or 2 bits for qgZ's intra-node hop (e.g. 8 inside
            the node, ``gradient_bits=4`` across, as SDP4Bit; ``zeropp.comm.reduce_scatter``'s ``intra_bits``);
            ``None``: ``gradient_bits``. Applies to every quantized gradient part, rules' included.
        rules: per-parameter formats (``zeropp.fsdp.rules``): an ordered list of ``{"match": <regex>,
            "weight_bits": ..., "gradient_bits": ...}`` (or ``zeropp.config.Rule``), the schema and matching of
            ``zero_optimization.zeropp.rules`` (``docs/rules.md``): the first rule whose pattern ``re.search`` finds
            in a parameter's qualified name (from ``modules``' ``named_parameters()``) gives its formats, ``None``
            exact, a left-out key ``weight_bits`` / ``gradient_bits``. A group whose parameters get several
            formats runs one collective per format. ``None`` or ``[]``: every parameter has the global formats.
        topology: the ``zeropp.comm.Topology`` of the modules' shard group (default: made here from that group,
            with ``ranks_per_node`` or ``$ZEROPP_RANKS_PER_NODE`` / ``$LOCAL_WORLD_SIZE``, checked against hosts).
        ranks_per_node: ranks of the shard group per node when the topology is made here (default: for a group
            that is the world, ``$ZEROPP_RANKS_PER_NODE`` / ``$LOCAL_WORLD_SIZE``; for a dp group of a larger mesh,
            counted from those, read as the WORLD's ranks per node; else from the hosts:
            ``zeropp.fsdp.mesh.shard_topology``). On HSDP: the HSDP mesh's ranks per node.
        replicate_bits: HSDP only: 8, 4 or 2 to quantize the cross-replica gradient all-reduce, ``None`` for
            exact (FSDP2's own ``all_reduce``); default: ``gradient_bits``. Refused on a 1-D mesh unless left out.

    Returns:
        The topology used (HSDP: the shard group's).

    Raises:
        ConfigError: a bad rule, or a rule that takes no parameter (a ``ValueError``).
        ValueError: unsupported bits or block size, no FSDP2 module, on HSDP what
            ``zeropp.fsdp.hsdp.check_options`` refuses (and ``replicate_bits`` without HSDP), hpZ with
            tensor-parallel parameters, modules on different meshes, a ``topology`` whose
            ranks are not the shard group's, an ``hpz`` that does not divide the ranks per node or whose FSDP2
            groups would span nodes, or ``error_feedback``, ``gradient_rotation`` or ``gradient_bits_intra``
            without quantized gradients, a ``gradient_rotation`` that is no rotation size dividing
            ``block_size``, rules giving one group several weight formats where it holds a tensor subclass
            that cannot be split (``zeropp.fsdp.rules``), or ``weight_deltas`` without ``hpz`` or with
            unsupported ``delta_bits`` or a mesh not in ascending rank order.
    """
    for name, bits, allowed in (("weight_bits", weight_bits, (8, 4)), ("gradient_bits", gradient_bits, (8, 4, 2))):
        if bits is not None and (isinstance(bits, bool) or bits not in allowed):
            raise ValueError(f"{name}={bits!r} is not supported; use {', '.join(map(str, allowed))} or None (exact)")
    BlockFormat(8, block_size)  # raises naming a bad block size
    resolved = resolve_rules(rules, (weight_bits, gradient_bits))
    some_bits = gradient_bits if gradient_bits is not None else next(
        (r.gradient_bits for r in resolved if r.gradient_bits is not None), None)  # any quantized gradients at all
    check_error_feedback(error_feedback, some_bits, error_feedback_beta)
    check_gradient_rotation(gradient_rotation, some_bits, block_size)
    check_intra_bits(gradient_bits_intra, some_bits)
    if weight_deltas:
        if hpz is None:
            raise ValueError("weight_deltas=True needs hpz=N (and fully_shard(..., reshard_after_forward=N) for every "
                             "module but the root): the deltas refresh hpZ's secondary partition")
        if isinstance(delta_bits, bool) or delta_bits not in SUPPORTED_BITS:
            raise ValueError(f"delta_bits={delta_bits!r} is not supported; use one of {SUPPORTED_BITS}")
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
    hsdp = _hsdp.find_hsdp(fsdp_modules)
    if replicate_bits == _hsdp.GRADIENT_BITS:
        replicate_bits = gradient_bits
    elif hsdp is None:
        raise ValueError(f"replicate_bits={replicate_bits!r} applies to HSDP (fully_shard with a 2-D (replicate, "
                         "shard) mesh); these modules are not sharded with HSDP: leave it out")
    replica_topology = None
    if hsdp is not None:
        assert not isinstance(replicate_bits, str)
        _hsdp.check_options(replicate_bits=replicate_bits, hpz=hpz, weight_deltas=weight_deltas, topology=topology,
                            error_feedback=error_feedback, stochastic_rounding=stochastic_rounding,
                            gradient_rotation=gradient_rotation, rules=rules)
        mesh = hsdp.mesh
        topology, replica_topology = _hsdp.hsdp_topologies(hsdp, ranks_per_node)
    else:
        mesh, ndim = _shard_mesh(fsdp_modules)
        if hpz is not None and ndim > 1:
            raise ValueError(
                f"zeropp.fsdp.enable(hpz={hpz}): the parameters live on a {ndim}-D mesh (tensor parallelism); hpZ "
                "is served on 1-D meshes only (FSDP2's post-forward reshard of a tensor-parallel parameter is not "
                "checked here): enable with hpz=None"
            )
    group = topology.group if hsdp is not None else mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    if topology is None:
        topology = shard_topology(group, ranks_per_node)
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
    formats = group_formats(roots, groups, resolved, (weight_bits, gradient_bits)) if resolved else None
    for k, group in enumerate(groups):
        # one per group (fully_shard call; setting a comm on one of its modules sets it for the group): the
        # all-gather knows the group's parameter segments (blocks never span two), the reduce-scatter holds the
        # group's gradient buffer's error-feedback residuals
        first: FSDPModule = group[0]  # type: ignore[assignment]
        segments = shard_numels(first)
        wbits: int | None | list[int | None] = weight_bits
        gbits: int | None | list[int | None] = gradient_bits
        names: list[str] = []
        if formats is not None:
            names = [name for name, _ in formats[k]]
            wbits, gbits = [fmt[0] for _, fmt in formats[k]], [fmt[1] for _, fmt in formats[k]]
        if weight_deltas:
            assert hpz is not None
            gather = DeltaAllGather(topology, wbits, block_size, segments, hpz=hpz, order=mesh.mesh.flatten().tolist(),
                                    delta_bits=delta_bits)
            register(first, gather)  # type: ignore[arg-type]
        else:
            gather = ZeroppAllGather(topology, wbits, block_size, segments)
        first.set_custom_all_gather(gather)
        quantized = _quantizes(gbits)  # a group whose gradients are all exact takes no qgZ options
        first.set_custom_reduce_scatter(ZeroppReduceScatter(
            topology, gbits, block_size, error_feedback=error_feedback if quantized else False,
            error_feedback_beta=error_feedback_beta, stochastic_rounding=stochastic_rounding and quantized, seed=k,
            gradient_rotation=gradient_rotation if quantized else None,
            intra_bits=gradient_bits_intra if quantized else None, segments=segments, names=names,
            tp_sharded=tp_sharded(first) if quantized else ()))
    if hpz is not None:
        install_check(groups, hpz)
    if replica_topology is not None:
        layouts = [(shard_numels(g[0]), tp_sharded(g[0])) for g in groups]
        _hsdp.install(groups, replica_topology, replicate_bits, block_size, layouts)  # type: ignore[arg-type]
    return topology


def _quantizes(bits: int | None | list[int | None]) -> bool:
    """Whether a group's gradient bits (one value, or one per parameter) quantize any of them."""
    return any(b is not None for b in bits) if isinstance(bits, list) else bits is not None


def _shard_mesh(fsdp_modules: list[FSDPModule]) -> tuple[DeviceMesh, int]:
    """The one 1-D mesh that every FSDP2-managed parameter of ``fsdp_modules`` is sharded over (FSDP2's dp mesh;
    ``zeropp.fsdp.mesh.shard_mesh``), and the most dims of the parameters' meshes (2 or 3 with tensor parallelism)."""
    meshes, ndim = [], 0
    for m in fsdp_modules:
        for p in m.parameters():  # type: ignore[attr-defined]
            if isinstance(p, DTensor):
                ndim = max(ndim, p.device_mesh.ndim)
                shard = shard_mesh(p)
                if all(shard is not q for q in meshes):
                    meshes.append(shard)
    if not meshes:
        raise ValueError("zeropp.fsdp.enable: the FSDP2 modules hold no sharded (DTensor) parameters")
    groups = {tuple(dist.get_process_group_ranks(mesh.get_group())) for mesh in meshes}
    if len(groups) > 1:
        raise ValueError(
            f"zeropp.fsdp.enable: the modules are sharded over different groups {sorted(groups)}; call enable "
            "once per group with that group's modules"
        )
    return meshes[0], ndim


def check_enable_kwargs(caller: str, enable_kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` naming ``caller`` if ``enable_kwargs`` holds a keyword ``enable`` does not take (for the
    integrations that pass ``enable``'s keyword arguments through: ``zeropp.hf``, ``zeropp.torchtitan``)."""
    accepted = frozenset(inspect.signature(enable).parameters) - {"modules"}
    bad = sorted(set(enable_kwargs) - accepted)
    if bad:
        raise TypeError(f"{caller} got {bad}, which zeropp.fsdp.enable does not take; it takes {sorted(accepted)}")
