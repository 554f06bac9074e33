"""Which group FSDP2 shards over when the world is a 2-D or 3-D ``DeviceMesh`` (data x tensor x pipeline parallel),
how large each parameter's segment of FSDP2's flat all-gather input is there, and the node layout of that group.

The recipe served (torchtitan's; torch 2.13)::

    world = init_device_mesh("cuda", (dp, tp, pp), mesh_dim_names=("dp", "tp", "pp"))   # any order of the names
    parallelize_module(stage, world["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(stage, mesh=world["dp"])       # each pp rank holds its own stage
    zeropp.fsdp.enable(stage, weight_bits=8, gradient_bits=4)

How FSDP2 lays such a parameter out (``_fsdp_param.FSDPParam._init_sharding_spec_tp``): a tensor-parallel DTensor
parameter (on the tp mesh) keeps its tp local tensor, and FSDP2 shards THAT on the FSDP dim (``Shard(0)`` by
default: ``ceil(L / dp)`` slices of the tp-local length ``L``, zero-padded). The sharded parameter is a DTensor on
``DeviceMesh._concatenate([dp_mesh, tp_mesh])``: the FSDP placement first (``Shard`` or ``_StridedShard`` when tp
shards the same dim), then the tp placement. A parameter tp does not touch (a plain LayerNorm) is a 1-D DTensor on
the dp mesh. FSDP2's all-gather and reduce-scatter run over the dp mesh's group only: the qwZ blocks of one rank's
segment lie inside its own tp shard (dp peers share their tp coordinate, so they gather the same tp shard), and
blocks never span two parameters (``ZeroppAllGather``). The pipeline dim never appears in a parameter: each pp rank
has its own modules and its own dp group; ``torch.distributed.pipelining`` (a ``PipelineStage`` around the
stage module, any schedule) changes only when FSDP2 calls the hooks: one reduce-scatter per group and step, of the
gradients summed over the micro-batches (``docs/fsdp_meshes.md``). qgZ's blocks keep tp-replicated and
tp-sharded parameters' gradients apart (``is_tp_sharded``), so that every tp replica of a replicated parameter gets
the same update.

HSDP (a ``(replicate, shard)`` dp mesh: ``Replicate()`` first) is ``zeropp.fsdp.hsdp``'s, found before this module's
``shard_mesh`` (which refuses it); so is FSDP2's SPMD
path (``fully_shard(..., dp_mesh_dims=...)``), which this module cannot tell from public state: the hooks then refuse
at the first collective, since FSDP2 passes them another group than the one derived here. An HSDP parameter with
tensor parallelism (``fully_shard(mesh=world["replicate", "shard"])``) has TWO placements of FSDP2's first
(``fsdp_dims``), which ``segment_numel`` and ``is_tp_sharded`` skip.

Node layout of the dp group: its ranks per node come from ``ranks_per_node`` (the GROUP's ranks per node, as
``comm.Topology``'s), else, for a group that is not the whole world, from the WORLD's ranks per node in
``$ZEROPP_RANKS_PER_NODE`` / ``$LOCAL_WORLD_SIZE`` (nodes are runs of that many consecutive global ranks, as torchrun
numbers them; the group must hold as many ranks on each node), else from the hosts (``comm.Topology``'s default: the
group's ranks on this host); ``comm.Topology`` checks the result against the hosts.
"""

from __future__ import annotations

import math
import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import comm
from ..comm.topology import ENV_RANKS_PER_NODE


def shard_mesh(param: DTensor) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards the FSDP2-managed ``param`` over: its own mesh if 1-D, else (FSDP + tensor
    parallel) the first dim of its 2-D/3-D mesh, sliced by name.

    Raises:
        ValueError: HSDP (``Replicate()`` first: a replicate dim), a multi-dim mesh without dim names, or a first
            placement that is not FSDP's shard.
    """
    mesh = param.device_mesh
    if mesh.ndim == 1:
        return mesh
    first = param.placements[0]
    names = mesh.mesh_dim_names
    if isinstance(first, Replicate):
        raise ValueError(
            f"zeropp.fsdp.enable: a parameter lives on the {mesh.ndim}-D mesh {tuple(mesh.shape)} (names {names}) "
            f"with placements {param.placements}: HSDP (a replicate dim before the shard dim) is not served by this "
            "mesh path; shard over one dim (fully_shard(mesh=world['dp'])) or use zeropp's HSDP support"
        )
    if not _is_shard(first):
        raise ValueError(
            f"zeropp.fsdp.enable: a parameter on the mesh {tuple(mesh.shape)} has placements {param.placements}; "
            "FSDP2's shard placement should come first. Wrap with fully_shard(mesh=world['dp']) after "
            "parallelize_module"
        )
    if names is None:
        raise ValueError(
            f"zeropp.fsdp.enable: a parameter lives on a {mesh.ndim}-D mesh {tuple(mesh.shape)} without dim names; "
            "build the world mesh with init_device_mesh(..., mesh_dim_names=(...)) so the dp dim can be sliced"
        )
    return mesh[names[0]]


def segment_numel(param: DTensor) -> int:
    """Elements of ``param``'s padded shard in FSDP2's flat all-gather input on this rank: the tensor-parallel
    local tensor (the global shape cut by every placement after FSDP's, at this rank's mesh coordinate) cut into
    ``ceil(L / P)`` slices along FSDP's dim (length ``L`` there, ``P`` ranks in the shard group), zero-padded. An HSDP
    parameter (``(Replicate(), Shard(d), *tp)`` on the (replicate, shard[, tp]) mesh: ``fsdp_dims``) is cut the same
    way over the shard dim."""
    mesh = param.device_mesh
    fsdp = fsdp_dims(param)
    shape = list(param.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"zeropp.fsdp: this rank is not on the mesh {mesh} of a parameter it manages")
    for dim in range(fsdp, mesh.ndim):
        placement = param.placements[dim]
        if isinstance(placement, (Replicate, Partial)):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(
                f"zeropp.fsdp.enable: a parameter has placement {placement} on mesh dim {dim} "
                f"({param.placements}); tensor parallelism with Shard, Replicate or Partial placements is served"
            )
        n, length = mesh.size(dim), shape[placement.dim]
        chunk = math.ceil(length / n)
        shape[placement.dim] = max(0, min(chunk, length - coordinate[dim] * chunk))
    fsdp_dim = getattr(param.placements[fsdp - 1], "dim", 0)
    length = shape[fsdp_dim]
    if length == 0:
        return 0
    return math.ceil(length / mesh.size(fsdp - 1)) * (math.prod(shape) // length)


def fsdp_dims(param: DTensor) -> int:
    """How many of the FSDP2-managed ``param``'s leading mesh dims are FSDP2's: 2 for HSDP (``Replicate()`` on the
    replicate dim, then the shard placement), else 1; the dims after them are tensor parallelism's."""
    return 2 if param.device_mesh.ndim > 1 and isinstance(param.placements[0], Replicate) else 1


def is_tp_sharded(param: DTensor) -> bool:
    """Whether a placement after FSDP's (tensor parallelism's) shards ``param``: its tp ranks hold different
    values. A parameter tp replicates (a row-parallel bias, a plain LayerNorm) is held, and updated, by every tp rank
    alike; qgZ reduces its gradient in blocks of its own so that the replicas stay bit-identical (a block shared with
    a tp-sharded gradient would get a scale that differs between the tp ranks)."""
    return any(_is_shard(p) for p in param.placements[fsdp_dims(param):])


def shard_topology(group: dist.ProcessGroup, ranks_per_node: int | None) -> comm.Topology:
    """The ``comm.Topology`` of the dp ``group`` (see the module docstring for where its ranks per node come
    from); a collective over ``group``.

    Raises:
        ValueError: the world's ranks per node do not divide the world, or the group holds different numbers of
            ranks on different nodes (no node layout for qgZ's two hops), or ``comm.Topology``'s checks.
    """
    ranks = dist.get_process_group_ranks(group)
    world = dist.get_world_size()
    if ranks_per_node is not None or len(ranks) == world:
        return comm.Topology(group, ranks_per_node)
    source = ENV_RANKS_PER_NODE if os.environ.get(ENV_RANKS_PER_NODE) else "LOCAL_WORLD_SIZE"
    value = os.environ.get(source)
    if not value:
        return comm.Topology(group)
    per_node = int(value)
    if per_node < 1 or world % per_node:
        raise ValueError(f"${source}={value} must be a positive divisor of the world size {world}")
    counts = {node: 0 for node in range(world // per_node)}
    for r in ranks:
        counts[r // per_node] += 1
    held = {node: count for node, count in counts.items() if count}
    if len(set(held.values())) > 1:
        raise ValueError(
            f"the data-parallel group {ranks} holds {held} ranks on the nodes of ${source}={value} (node: ranks); "
            "qgZ needs as many on each node: lay the mesh out so every dp group spans its nodes evenly"
        )
    topology = comm.Topology(group, next(iter(held.values())))
    expected = sorted(sorted(r for r in ranks if r // per_node == node) for node in held)
    if sorted(topology.nodes) != expected:
        raise ValueError(
            f"the data-parallel group {ranks} has nodes {topology.nodes} by host, but {expected} by ${source}="
            f"{value}; set ${source} to the world's ranks per node"
        )
    return topology


def _is_shard(placement: object) -> bool:
    """FSDP2's shard placement: ``Shard``, or ``_StridedShard`` (no ``Shard`` subclass in torch 2.13) when tensor
    parallelism shards the same dim."""
    return isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard"
