"""ZeRO++ for FSDP2 (``torch.distributed.fsdp.fully_shard``) users: qwZ and qgZ through FSDP2's custom-comm hooks.

    model = GPT(...)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4)   # on every rank, before the first forward

hpZ: wrap the blocks with ``fully_shard(block, reshard_after_forward=N)`` (N = ranks per node, usually) and pass
``enable(model, ..., hpz=N)``; error feedback for qgZ: ``enable(..., error_feedback=True)``; qgZ's intra-node hop in
its own bits: ``gradient_bits_intra``; per-parameter formats: ``rules=[...]`` (``zeropp.fsdp.rules``); weight deltas
on hpZ: ``enable(..., hpz=N, weight_deltas=True)`` (``zeropp.fsdp.weight_deltas``); HSDP (``fully_shard`` on a 2-D
(replicate, shard) mesh): the same ``enable``, the cross-replica all-reduce in ``replicate_bits``
(``zeropp.fsdp.hsdp``).

* ``hook.py``: ``FlatBufferHook``, what the two hooks share;
* ``hpz.py``: how FSDP2's ``reshard_after_forward=<int>`` maps to hpZ, and the checks ``enable(hpz=N)`` makes;
* ``segments.py``: the parameters FSDP2 manages per group (one ``fully_shard`` call, of one module or several:
  ``fully_shard([a, b])``), in its all-gather order, their shard sizes, and the split of a group by format;
* ``rules.py``: per-parameter formats (``enable(rules=...)``) resolved per group;
* ``weight_deltas.py``: ``DeltaAllGather``, the forward gathers from a resident hpZ secondary refreshed by
  quantized weight deltas;
* ``enable``: installs a ``ZeroppAllGather`` per group (it knows the group's parameter segments: qwZ blocks
  never span two parameters) and a ``ZeroppReduceScatter`` per group (each holds its gradient buffer's
  error-feedback state), built on ``zeropp.comm``, on every FSDP2 group; 1-D meshes, HSDP's 2-D
  (replicate, shard) meshes and the dp dim of a 2-D / 3-D world mesh;
* ``mesh.py``: FSDP2 on one dim of a 2-D / 3-D world mesh (tensor parallel, pipeline stages): the dp group, each
  tensor-parallel parameter's segment, the dp group's nodes;
* ``hsdp.py``: HSDP: qwZ / qgZ on the shard dim, FSDP2's cross-replica gradient all-reduce routed to its
  ``set_all_reduce_hook`` and run exact or quantized (``replicate_bits``) over the replicate dim.
"""

from .all_gather import ZeroppAllGather
from .enable import check_enable_kwargs, enable
from .reduce_scatter import ZeroppReduceScatter
from .weight_deltas import DeltaAllGather, refresh_weight_deltas, weight_delta_hooks

__all__ = ["DeltaAllGather", "ZeroppAllGather", "ZeroppReduceScatter", "check_enable_kwargs", "enable",
           "refresh_weight_deltas", "weight_delta_hooks"]
