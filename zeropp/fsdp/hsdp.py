"""HSDP for FSDP2: modules sharded with ``fully_shard(mesh=<2-D (replicate, shard) DeviceMesh>)``, with qwZ and qgZ
on the shard dim and a quantized cross-replica gradient all-reduce on the replicate dim; that mesh may be the
``(replicate, shard)`` submesh of a 3-D world mesh whose third dim is tensor parallelism's (below).

How FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_reduce``) reduces an HSDP group's gradients: a reduce-scatter
over the shard dim (the custom reduce-scatter hook, ``ZeroppReduceScatter``), then a plain ``dist.all_reduce`` of
its output over the replicate dim, then the public ``set_all_reduce_hook`` hook (after that all-reduce). That
all-reduce has no custom-comm hook, and it is the traffic that crosses nodes when the replicas are on different
nodes (the usual HSDP layout: shard inside the node, replicate across). ``install`` therefore routes it: each
parameter group's FSDP2 mesh info becomes a plain shard-dim one (``zeropp._torch_internals.route_hsdp_all_reduce``,
the one private write), so FSDP2 reduce-scatters over the shard dim as before, skips its all-reduce, and runs the
public ``set_all_reduce_hook`` hook right after the reduce-scatter (FSDP2's own "custom HSDP" path), where
``ReplicaAllReduce`` averages over the replicate dim. The parameters are untouched: their DTensors stay
``(Replicate(), Shard(0))`` on the 2-D mesh, so ``state_dict`` and DCP checkpoints are those of plain HSDP.

Divide factors: routed, FSDP2 divides by the shard size only (AVG over the shard group for fp32/bf16, or its own
pre/post division for fp16 and ``set_force_sum_reduction_for_comms``); ``ReplicaAllReduce`` always averages over
the ``R`` replicas, so the gradient is the mean over all ``R * S`` ranks as with native HSDP (for fp32/bf16 with
exact comms bit for bit: the same reduce-scatter, then ``dist.all_reduce(AVG)`` over the same group).

The quantized all-reduce (``bits`` 8, 4 or 2) over ``R`` replicas of a reduce-scatter output of ``n`` elements is
``zeropp.comm.all_reduce(bits=...)`` over the replicate group's topology (its module docstring: a qgZ
reduce-scatter and a quantized all-gather, so the replicas end with the same values). Bytes sent (and received)
per rank and call: ``2 * (R - 1) * B(s)``, ``s = ceil(n / R)``, ``B`` the packed bytes
(``BlockFormat.packed_bytes``: ``ceil(s / block_size) * (block_size * bits / 8 + 4)``, codes and a float32 scale
per block): across nodes when each replica of the group is on its own node. Exact: ``dist.all_reduce``, counted
as a ring all-reduce, ``2 * (R - 1) * s * itemsize``. Both are counted in ``zeropp.comm.stats()`` as one
``"all_reduce"`` call.

Error bound of the quantized all-reduce, per element, with ``q = BlockFormat.qmax`` (127, 7, 1), blocks of each
slice, each replica on its own node (``zeropp.comm.all_reduce`` gives the two-hop bound otherwise): the
reduce-scatter's error is at most ``E1 = mean over r of A_r / (2 q)`` (``A_r`` the absmax of replica ``r``'s block
of its input); the all-gather adds at most ``(A + E1) / (2 q)`` (``A`` the absmax of the block of the exact mean):
``|out - mean| <= E1 * (1 + 1 / (2 q)) + A / (2 q)``, plus the rounding of the reduce dtype (bf16).

With tensor parallelism (torchtitan's recipe: ``parallelize_module`` on ``world["tp"]``, then
``fully_shard(mesh=world["replicate", "shard"])``): a tp parameter is a DTensor on the 3-D mesh with placements
``(Replicate(), Shard | _StridedShard, <tp>)``, one tp does not touch a DTensor on the 2-D submesh;
``zeropp.fsdp.mesh.fsdp_dims`` reads the first two as FSDP2's, so segments are shards of the tp-local tensors and
tp-replicated parameters are told from tp-sharded ones as on a dp x tp mesh. Where a group holds both kinds, the
quantized all-reduce (like qgZ) runs one part per kind, the elements of each gathered in order
(``ReplicaAllReduce``'s ``parts``): a block mixing them would get a scale that differs between the tp ranks, and
the tp copies of a replicated parameter would drift apart. Bytes and bound above then hold per part.

Topology: ``hsdp_topologies`` derives the node layout of the mesh's ranks from the hosts and ``ranks_per_node``
(one ``zeropp.comm.Topology`` over all of the mesh's ranks, made by ``zeropp.fsdp.mesh.shard_topology``: the
environment's ranks per node are the world's when the mesh is a submesh), then one topology for this rank's shard
group (qgZ's two hops and qwZ's accounting) and one for its replicate group, each with as many ranks per node as the
group has on each node.

Not served (``check_options`` refuses them at ``enable``): hpZ (``hpz``, ``weight_deltas``) on an HSDP mesh,
a given ``topology`` (the two are derived from the mesh), and with a quantized all-reduce: ``error_feedback``,
``stochastic_rounding``, ``gradient_rotation`` and ``rules`` (the all-reduce has no residual store, seeds,
rotation or per-parameter formats). FSDP2's ``set_requires_all_reduce(False)`` (accumulating without the
all-reduce) is refused at the first reduction that skips it. FSDP2's SPMD path (``dp_mesh_dims``: HSDP on a mesh of
more than 2 dims) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from .. import comm
from .._torch_internals import fsdp_all_reduce_hook, fsdp_hsdp_mesh, fsdp_requires_all_reduce, route_hsdp_all_reduce
from ..comm import accounting
from ..quant import DEFAULT_BLOCK_SIZE, BlockFormat, chunk_numel
from ..quant.format import SUPPORTED_BITS
from .mesh import shard_topology
from .segments import FormatPart, format_parts

GRADIENT_BITS = "gradient_bits"
"""``enable(replicate_bits=...)``'s default: the cross-replica all-reduce in ``gradient_bits``."""


@dataclass(frozen=True)
class HSDPMesh:
    """The 2-D mesh FSDP2 runs native HSDP on: ``mesh`` with parameters sharded over dim ``shard_dim`` and
    replicated over dim ``replicate_dim``."""

    mesh: DeviceMesh
    shard_dim: int
    replicate_dim: int

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_dim)

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.replicate_dim)


def find_hsdp(fsdp_modules: Sequence[FSDPModule]) -> HSDPMesh | None:
    """The HSDP mesh of ``fsdp_modules`` if FSDP2 runs native HSDP on them, ``None`` if on none of them.

    Raises:
        ValueError: some run HSDP and others not, they run it on different meshes, or on a mesh of more than
            2 dims (``dp_mesh_dims``).
    """
    found: list[tuple[Any, int, int, bool]] = []
    plain = False
    for m in fsdp_modules:
        for info in fsdp_hsdp_mesh(m):
            if info is None:
                plain = True
            elif all(info[0] is not f[0] or info[1:] != f[1:] for f in found):
                found.append(info)
    if not found:
        return None
    if plain:
        raise ValueError("zeropp.fsdp.enable: some of the modules are sharded with HSDP (a (replicate, shard) mesh) "
                         "and others without; call enable once per mesh with that mesh's modules")
    keys = {(tuple(f[0].mesh.flatten().tolist()), f[1], f[2]) for f in found}
    if len(keys) > 1:
        raise ValueError(f"zeropp.fsdp.enable: the modules are sharded with HSDP on different meshes (ranks, shard "
                         f"dim, replicate dim) {sorted(keys)}; call enable once per mesh with that mesh's modules")
    mesh, shard_dim, replicate_dim, spmd = found[0]
    if spmd or mesh.ndim != 2:
        raise ValueError(
            f"zeropp.fsdp.enable serves HSDP on a 2-D (replicate, shard) mesh; got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} (names {mesh.mesh_dim_names}, given with dp_mesh_dims: {spmd}): FSDP2's SPMD path "
            "(fully_shard(..., dp_mesh_dims=...)) is not served. Pass fully_shard the 2-D data-parallel submesh "
            "(world['replicate', 'shard']; tensor parallelism on world['tp'] before it is served)")
    return HSDPMesh(mesh, shard_dim, replicate_dim)


def check_options(*, replicate_bits: int | None, hpz: int | None, weight_deltas: bool,
                  topology: comm.Topology | None, error_feedback: bool | str, stochastic_rounding: bool,
                  gradient_rotation: int | None, rules: object) -> None:
    """Raise ``ValueError`` naming what ``enable`` cannot serve on an HSDP mesh with these options (see the module
    docstring), and for ``replicate_bits`` not 8, 4, 2 or ``None``."""
    if replicate_bits is not None and (isinstance(replicate_bits, bool) or replicate_bits not in SUPPORTED_BITS):
        raise ValueError(f"replicate_bits={replicate_bits!r} is not supported; use one of {SUPPORTED_BITS} or None "
                         "(an exact cross-replica all-reduce)")
    if hpz is not None or weight_deltas:
        raise ValueError("zeropp.fsdp.enable: hpz / weight_deltas are not served on an HSDP mesh (FSDP2's "
                         "post-forward groups of a (replicate, shard) mesh are not checked by zeropp); leave them out")
    if topology is not None:
        raise ValueError("zeropp.fsdp.enable: on an HSDP mesh the shard and replicate topologies are derived from the "
                         "mesh and the hosts; pass ranks_per_node (or set $ZEROPP_RANKS_PER_NODE) instead of topology")
    if replicate_bits is None:
        return
    for name, value in (("error_feedback", error_feedback), ("stochastic_rounding", stochastic_rounding),
                        ("gradient_rotation", gradient_rotation), ("rules", rules)):
        if value:
            raise ValueError(
                f"zeropp.fsdp.enable: {name}={value!r} is not served with a quantized cross-replica all-reduce "
                f"(replicate_bits={replicate_bits}): that all-reduce has no residual store, seeds, rotation or "
                f"per-parameter formats. Pass replicate_bits=None (exact all-reduce; {name} then applies to the "
                "shard dim's reduce-scatter), or leave it out")


def hsdp_topologies(hsdp: HSDPMesh, ranks_per_node: int | None) -> tuple[comm.Topology, comm.Topology]:
    """The topologies of this rank's shard group and replicate group, on the node layout of all the mesh's ranks.

    A collective over the mesh's ranks: a ``zeropp.comm.Topology`` over all of them (``ranks_per_node``: the
    mesh's ranks per node; else ``$ZEROPP_RANKS_PER_NODE`` / ``$LOCAL_WORLD_SIZE``, the world's ranks per node;
    ``zeropp.fsdp.mesh.shard_topology``, checked against the hosts), then one over each group with as many ranks
    per node as the group has on every node.

    Raises:
        ValueError: a group has different numbers of ranks on different nodes (bad ranks per node, or a mesh
            that cuts nodes unevenly), or a group's topology does not see the nodes the mesh's one does.
    """
    ranks = sorted(hsdp.mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        whole_group = dist.group.WORLD
    else:
        whole_group = dist.new_group(ranks, use_local_synchronization=True)
    whole = shard_topology(whole_group, ranks_per_node)
    out = []
    for name, group in (("shard", hsdp.shard_group), ("replicate", hsdp.replicate_group)):
        members = dist.get_process_group_ranks(group)
        nodes = [[r for r in node if r in members] for node in whole.nodes]
        nodes = [node for node in nodes if node]
        counts = {len(node) for node in nodes}
        if len(counts) != 1:
            raise ValueError(
                f"zeropp.fsdp.enable: the HSDP {name} group {members} has {[len(n) for n in nodes]} ranks on the "
                f"nodes {whole.nodes} (ranks_per_node={whole.ranks_per_node}); give every node the same number of "
                "each group's ranks (init_device_mesh over node-contiguous ranks) or fix ranks_per_node")
        topo = comm.Topology(group, counts.pop())
        if topo.nodes != nodes:
            raise ValueError(f"zeropp.fsdp.enable: the HSDP {name} group's topology sees nodes {topo.nodes}, but the "
                             f"mesh's nodes hold them as {nodes}; pass ranks_per_node matching the hosts")
        out.append(topo)
    return out[0], out[1]


class ReplicaAllReduce:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) averaging one group's reduce-scatter output over
    the replicate group: exact (``dist.all_reduce``, FSDP2's own HSDP call) or quantized (a qgZ reduce-scatter and a
    quantized all-gather, ``zeropp.comm``; see the module docstring for the bytes and the error bound).

    Args:
        topology: the ``zeropp.comm.Topology`` of the replicate group (``hsdp_topologies``).
        bits: 8, 4 or 2 to quantize, ``None`` for exact.
        block_size: elements per quantization block.
        module: the FSDP2 module it is installed on (to refuse FSDP2 skipping the all-reduce).
        segments: with tensor parallelism, the group's per-parameter segments of the output
            (``zeropp.fsdp.segments.shard_numels``), and
        tp_sharded: 1 per segment whose parameter tp shards, 0 per one it replicates
            (``zeropp.fsdp.segments.tp_sharded``): when both occur and ``bits`` quantizes, the two kinds are
            all-reduced as separate parts, so that no quantization block mixes them (a shared block's scale would
            differ between the tp ranks, and so would the tp-replicated parameters).
    """

    def __init__(self, topology: comm.Topology, bits: int | None, block_size: int = DEFAULT_BLOCK_SIZE,
                 module: nn.Module | None = None, segments: Sequence[int] = (),
                 tp_sharded: Sequence[int] = ()) -> None:
        if bits is not None:
            BlockFormat(bits, block_size)  # raises naming bad bits or block size
        self.topology, self.bits, self.block_size, self.module = topology, bits, block_size, module
        self.segments = tuple(int(n) for n in segments)
        self.parts: list[FormatPart] | None = None
        if bits is not None and len({c for c, n in zip(tp_sharded, self.segments) if n}) > 1:
            self.parts = format_parts(self.segments, [bits] * len(self.segments), 1, align=False,
                                      classes=tuple(tp_sharded))

    def __call__(self, output: torch.Tensor) -> None:
        """Replace ``output`` (this rank's reduce-scatter output, flat, in the reduce dtype) by its mean over the
        replicas, in place."""
        if self.module is not None and not fsdp_requires_all_reduce(self.module):
            raise ValueError(
                "zeropp.fsdp: set_requires_all_reduce(False) is not served with zeropp on HSDP: FSDP2 would keep "
                "accumulating the reduce-scatter output without the cross-replica all-reduce, which zeropp runs as "
                "its all-reduce hook. Use set_requires_gradient_sync(False) for the accumulation steps instead")
        if self.topology.world_size == 1 or output.numel() == 0:
            return
        flat = output.view(-1)
        if self.parts is None:
            self._all_reduce(flat)
            return
        if flat.numel() != sum(self.segments):
            raise ValueError(
                f"zeropp.fsdp: FSDP2 all-reduces {flat.numel()} gradient elements across replicas for a group whose "
                f"tensor-parallel-replicated and -sharded parameters (segments {list(self.segments)}, "
                f"{sum(self.segments)} elements) are all-reduced apart: some of them got no gradient this backward, "
                "and the buffer no longer says which elements are whose. Wrap the modules whose parameters may get "
                "no gradient with their own fully_shard, or pass replicate_bits=None")
        for part in self.parts:
            staged = flat.new_empty(part.numel)
            for src, dst, length in part.runs:
                staged[dst:dst + length].copy_(flat[src:src + length])
            self._all_reduce(staged)
            for src, dst, length in part.runs:
                flat[src:src + length].copy_(staged[dst:dst + length])

    def _all_reduce(self, flat: torch.Tensor) -> None:
        """Average the contiguous 1-D ``flat`` over the replicas in place (exact or in ``bits``)."""
        topo = self.topology
        size, n = topo.world_size, flat.numel()
        if self.bits is None:
            s = chunk_numel(n, size)
            once = accounting.gather_traffic(s * flat.element_size(), size, topo.same_node_count(topo.group))
            accounting.record("all_reduce", once + once)
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=topo.group)
            return
        comm.all_reduce(flat, topology=topo, op=comm.ReduceOp.AVG, bits=self.bits, block_size=self.block_size)


def install(groups: Sequence[tuple[nn.Module, ...]], topology: comm.Topology, bits: int | None,
            block_size: int, layouts: Sequence[tuple[Sequence[int], Sequence[int]]] = ()) -> list[ReplicaAllReduce]:
    """Route each FSDP2 group's cross-replica all-reduce to a ``ReplicaAllReduce`` over ``topology`` (the replicate
    group's): one hook per group, set with the public ``set_all_reduce_hook`` on its first module. That slot is
    zeropp's from then on: a hook already in it is refused here, and one set later (which would leave the gradients
    unreduced across replicas) is refused at the module's next forward. ``layouts``: per group, its segments and
    tp-sharded flags (``ReplicaAllReduce``'s ``segments`` and ``tp_sharded``; default none).

    Raises:
        ValueError: a group already has an all-reduce hook.
    """
    hooks = []
    for k, group in enumerate(groups):
        first = group[0]
        if fsdp_all_reduce_hook(first) is not None:
            raise ValueError(
                f"zeropp.fsdp.enable: {type(first).__name__} already has a set_all_reduce_hook hook; on HSDP zeropp "
                "runs the cross-replica all-reduce in that hook: run your hook's work after backward instead")
        route_hsdp_all_reduce(first)
        segments, sharded = layouts[k] if layouts else ((), ())
        hook = ReplicaAllReduce(topology, bits, block_size, module=first, segments=segments, tp_sharded=sharded)
        first.set_all_reduce_hook(hook)  # type: ignore[operator]
        first.register_forward_pre_hook(_check_kept(hook))
        hooks.append(hook)
    return hooks


def _check_kept(hook: ReplicaAllReduce) -> Any:
    """A forward pre-hook refusing a module whose all-reduce hook is no longer zeropp's ``hook``."""
    def check(module: nn.Module, args: Any) -> None:
        if fsdp_all_reduce_hook(module) is not hook:
            raise ValueError(
                f"zeropp.fsdp: the set_all_reduce_hook hook of {type(module).__name__} was replaced after "
                "zeropp.fsdp.enable; on HSDP zeropp runs the cross-replica gradient all-reduce in it, so the "
                "gradients would not be averaged across replicas: run your hook's work after backward instead")
    return check
