"""qgZ for DeepSpeed's ZeRO-3: ``all_to_all_quant_reduce`` on ``zeropp.comm.reduce_scatter(bits=4)``.

DeepSpeed's stage 3 (``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads``) calls
``all_to_all_quant_reduce(tensors, groups)`` on a bucket of full gradients (already cast to
``communication_data_type``) when ``zero_quantized_gradients`` is on and there is more than one node
(``world // accelerator.device_count() > 1``), else ``reduce_scatter_coalesced``. Both must return, for each
tensor of ``n`` elements, this rank's slice ``[r * S, min((r + 1) * S, n))``, ``S = ceil(n / P)``, of the mean
over the ``P`` ranks (``reduce_scatter_coalesced``'s layout; stage 3 pads it to the partition itself).

``all_to_all_quant_reduce`` here reduces over the world, as DeepSpeed's does (stage 3 does not pass its
partition group); it raises when DeepSpeed's data-parallel group is not the world (model or sequence
parallelism) rather than average over the wrong ranks. ``groups``, DeepSpeed's dict of all-to-all groups, is
unused: the node layout is zeropp's ``Topology``.

Layout: one flat bucket of ``P * A`` elements viewed as ``P`` rows of ``A``; tensor ``t`` occupies columns
``[o_t, o_t + S_t)`` of every row (row ``r`` holds its elements ``[r * S_t, (r + 1) * S_t)``, zeros past ``n``),
``o_t`` advancing by ``S_t`` rounded up to the block size; ONE ``zeropp.comm.reduce_scatter(bits=4, op=AVG)``
leaves row ``r`` of the mean on rank ``r``, so no block straddles two tensors, any size and 1-D tensors take
the quantized path (DeepSpeed falls back to an exact reduce-scatter for those), bf16 and fp32 are read and
written in their dtype (summed in float32), and the result is the mean (DeepSpeed's returns sum / nodes, which
is ``ranks per node`` times the mean by our reading of its kernels).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import groups as groups_module

from .. import comm
from ..quant import DEFAULT_BLOCK_SIZE
from .topology import topology_for

GRADIENT_BITS = 4
"""Code width of the gradient reduce-scatter: DeepSpeed's qgZ is int4."""


@torch.no_grad()
def all_to_all_quant_reduce(tensors: list[torch.Tensor], groups: Any) -> list[torch.Tensor]:
    """This rank's slice of the mean over the world of each tensor (see the module docstring for the layout).

    Args:
        tensors: the bucket's full gradients, one float dtype, on one device; every rank passes the same shapes.
        groups: DeepSpeed's all-to-all groups (unused).

    Returns:
        One flat tensor per input, in its dtype: elements ``[r * S, min((r + 1) * S, n))`` of the mean.
    """
    if not tensors:
        return []
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"a qgZ bucket mixes dtypes {sorted(map(str, dtypes))}; stage 3 casts it to one")
    dp_size = groups_module._get_data_parallel_world_size()
    if dp_size != dist.get_world_size():
        raise NotImplementedError(
            f"zeropp's qgZ for DeepSpeed reduces over the world ({dist.get_world_size()} ranks), and DeepSpeed's "
            f"data-parallel group has {dp_size}: turn zero_quantized_gradients off with model or sequence parallelism"
        )
    topology = topology_for(dist.group.WORLD)
    size, rank = topology.world_size, topology.rank
    block = DEFAULT_BLOCK_SIZE
    slices = [-(-t.numel() // size) for t in tensors]
    offsets: list[int] = []
    width = 0
    for s in slices:
        offsets.append(width)
        width += -(-s // block) * block
    flat = torch.zeros(size, width, dtype=tensors[0].dtype, device=tensors[0].device)
    for t, off, s in zip(tensors, offsets, slices):
        n = t.numel()
        if n == 0:
            continue
        full_rows, rest = divmod(n, s)
        src = t.reshape(-1)
        flat[:full_rows, off:off + s].copy_(src[: full_rows * s].view(full_rows, s))
        if rest:
            flat[full_rows, off:off + rest].copy_(src[full_rows * s:])
    mine = comm.reduce_scatter(flat.view(-1), bits=GRADIENT_BITS, op=comm.ReduceOp.AVG, topology=topology,
                               block_size=block)
    assert isinstance(mine, torch.Tensor)
    out = []
    for t, off, s in zip(tensors, offsets, slices):
        start = min(rank * s, t.numel())
        out.append(mine.narrow(0, off, min(start + s, t.numel()) - start))
    return out
