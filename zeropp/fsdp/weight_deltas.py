"""Weight deltas on hpZ for FSDP2 (``enable(weight_deltas=True, hpz=N)``): the forward all-gathers send each
rank's quantized weight *change* across nodes instead of its weights, and gather inside the node (SDP4Bit's
quantized weight differences on ZeRO-3's secondary partition, as ``zeropp.engine.weight_deltas`` does).

FSDP2's public hooks allow it inside the custom all-gather alone. The hook of a group keeps, resident between
steps, its hpZ *secondary*: the ``1/N`` of the group's gathered flat buffer that its position in its post-forward
group holds (FSDP2's post-forward groups: runs of ``N`` consecutive mesh positions, inside a node), and the
*reconstruction* of its own shard, what every holder of that shard has. At each forward all-gather over the shard
group FSDP2 hands the hook this rank's current compute shard ``w`` (after the optimizer step, cast to the
mixed-precision ``param_dtype``, padded): the hook packs ``Q(w - r)`` (``zeropp.comm.pack_delta``, ``delta_bits``,
``block_size`` elements per float32 scale), adds it to its own ``r`` and sends it with one ``zeropp.comm.exchange``
to the ranks whose secondary holds its shard, each of which adds it to its copy (``zeropp.comm.add_delta``: float32
sum, one rounding to the compute dtype): owner and holders hold the same bits, and the next delta is taken against
them, so the error never accumulates (after each update ``|w - r| <= scale / 2`` per block, ``scale = absmax(w -
r_old) / qmax``, plus one rounding of ``r``). Then it all-gathers the secondaries exactly over its post-forward
group (inside the node) into FSDP2's output. Backward gathers (over the post-forward group) stay hpZ's exact ones
(``ZeroppAllGather``).

Why at the gather and not after the optimizer step (``Optimizer.register_step_post_hook`` is public too): the
gather is where FSDP2 has made the compute shard (dtype cast, padding, any ``fsdp_pre_all_gather``), and every
change of the weights passes through it, whoever made it (optimizer, ``load_state_dict``, DCP, a manual edit): a
secondary can never go stale. The price: every forward gather sends a delta, also when nothing changed (under
gradient accumulation, each micro-batch after the first sends the pack of zeros: its bytes are the same).

Which ranks. ``P`` ranks, mesh position ``m``, ``G = P / N``: the secondary of post-forward position ``i = m % N``
holds the shards of mesh positions ``i G .. (i + 1) G - 1`` (elements ``[i G n, (i + 1) G n)`` of the output, ``n``
elements per shard), so owner ``o`` sends to the ``G`` ranks with ``j % N == o // G`` (itself possibly among them).

Memory per rank and group (``n`` elements per shard, ``b`` bytes per compute element): ``(G + 1) n b``, resident
from the first forward on (hpZ alone holds the post-forward ``G n`` only from forward to backward).

Bytes per forward gather and rank, ``D = packed_bytes(n)`` of ``delta_bits``: sent ``D`` to each holder but itself,
``(P - d) / N`` of them on other nodes with ``d`` ranks per node (``comm.stats()["exchange"]``); the gather itself
is all intra-node, ``(N - 1) G n b`` (``"all_gather"``). Refresh (the first forward, and the first after
``refresh_weight_deltas``): one all-gather over the shard group in ``weight_bits`` (exact: ``(P - d) n b`` across
nodes; qwZ: its packs), after which owner and holders hold what that gather delivered.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..quant import BlockFormat
from ..quant.format import FLOAT_DTYPES
from .all_gather import ZeroppAllGather

_HOOKS: weakref.WeakKeyDictionary[nn.Module, DeltaAllGather] = weakref.WeakKeyDictionary()


class DeltaAllGather(ZeroppAllGather):
    """``ZeroppAllGather`` whose gathers over the shard group run from the resident hpZ secondary, refreshed by
    quantized deltas (module docstring); over any other group (hpZ's backward) it is ``ZeroppAllGather``.

    The refresh (the first forward gather, and the first after ``refresh``) is ``ZeroppAllGather``'s gather over the
    shard group: exact with ``bits=None``, else qwZ (per parameter with rules); the reconstruction is then this
    rank's part of what every rank received, so owner and holders agree from the start and the next delta takes
    qwZ's error away too.

    Args:
        topology, bits, block_size, segments: as ``ZeroppAllGather`` (``bits``: the refresh gather's).
        hpz: ``N``, the size of FSDP2's post-forward groups (``reshard_after_forward``).
        order: the global ranks of the shard mesh in mesh order.
        delta_bits: 8, 4 or 2: the bits of the delta packs.

    Attributes:
        secondary: this rank's hpZ secondary (``G n`` elements, compute dtype), ``None`` before the first forward
            gather and after ``refresh``.
        reconstruction: this rank's shard as every holder has it (``n`` elements), ``None`` likewise.
    """

    def __init__(self, topology: comm.Topology, bits: int | None | Sequence[int | None], block_size: int,
                 segments: Sequence[int], *, hpz: int, order: Sequence[int], delta_bits: int) -> None:
        super().__init__(topology, bits, block_size, segments)
        self.fmt = BlockFormat(delta_bits, block_size)
        if list(order) != topology.ranks:
            raise ValueError(f"weight deltas need the shard mesh in ascending rank order (init_device_mesh's "
                             f"default); got the mesh {list(order)} over the group {topology.ranks}")
        world, me = len(order), topology.rank
        group = world // hpz
        position = me % hpz
        self.me = me
        self.partition = list(order[me - position:me - position + hpz])
        self.owners = list(range(position * group, (position + 1) * group))
        self.send_to = [j for j in range(world) if j % hpz == me // group and j != me]
        self.receive_from = [o for o in self.owners if o != me]
        self.secondary: torch.Tensor | None = None
        self.reconstruction: torch.Tensor | None = None

    def refresh(self) -> None:
        """Make the next forward gather an exact one that rebuilds the secondary and the reconstruction."""
        self.secondary = self.reconstruction = None

    @property
    def resident_bytes(self) -> int:
        """Bytes this hook keeps between steps: the secondary and the reconstruction."""
        return sum(t.nbytes for t in (self.secondary, self.reconstruction) if t is not None)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self.is_shard_group(group):
            return super().__call__(output_tensor, input_tensor, group, async_op)
        if input_tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"zeropp.fsdp weight deltas: FSDP2 all-gathers {input_tensor.dtype} parameters; deltas "
                            f"take {', '.join(map(str, FLOAT_DTYPES))}: enable with weight_deltas=False")
        n = input_tensor.numel()
        flat = input_tensor.reshape(-1)
        held = len(self.owners) * n
        if self.secondary is None or self.secondary.numel() != held or self.secondary.dtype != flat.dtype:
            super().__call__(output_tensor, input_tensor, group, async_op)  # the refresh: exact or qwZ
            gathered = output_tensor.reshape(-1)
            first = self.owners[0] * n
            self.secondary = gathered[first:first + held].clone()
            self.reconstruction = gathered[self.me * n:(self.me + 1) * n].clone()  # what every rank got
            return None
        assert self.reconstruction is not None
        pack = comm.pack_delta(flat, self.reconstruction, self.fmt)
        comm.add_delta(pack, self.reconstruction, self.fmt)
        rows = comm.exchange(pack, send_to=self.send_to, receive_from=self.receive_from, topology=self.topology)
        received = dict(zip(self.receive_from, rows))
        for k, owner in enumerate(self.owners):
            comm.add_delta(pack if owner == self.me else received[owner], self.secondary[k * n:(k + 1) * n],
                           self.fmt)
        comm.all_gather(self.secondary, None, group=self.topology.subgroup(self.partition), topology=self.topology,
                        out=output_tensor)
        return None


def register(module: nn.Module, hook: DeltaAllGather) -> None:
    """Remember ``hook`` as the weight-delta hook of ``module``'s FSDP2 group (for ``refresh_weight_deltas``)."""
    _HOOKS[module] = hook


def weight_delta_hooks(modules: nn.Module | Iterable[nn.Module]) -> list[DeltaAllGather]:
    """The weight-delta hooks of the FSDP2 groups in ``modules`` (searched like ``enable``'s), one per group."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    found = [_HOOKS[m] for root in roots for m in root.modules() if m in _HOOKS]
    return list(dict.fromkeys(found))


def refresh_weight_deltas(modules: nn.Module | Iterable[nn.Module]) -> None:
    """Make the next forward gather of every weight-delta group in ``modules`` exact (rebuilding its secondary and
    reconstruction): e.g. to drop a delta's quantization error at once after loading a checkpoint (a load is
    caught anyway: its change is sent as a delta, whose error the next steps' deltas correct). Call it on every
    rank, between steps."""
    hooks = weight_delta_hooks(modules)
    if not hooks:
        raise ValueError("refresh_weight_deltas found no module enabled with weight_deltas=True")
    for hook in hooks:
        hook.refresh()
