"""qgZ on one node: stage 3's gradient average-and-scatter without DeepSpeed's "more than one node" condition.

DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` runs ``all_to_all_quant_reduce`` only when
``world // accelerator.device_count() > 1``; on one node (``LOCAL_SIZE`` = world on the CPU accelerator, all GPUs of
one host) a config with ``zero_quantized_gradients`` silently gets an exact reduce-scatter. ``avg_scatter_grads`` is
that method with the condition reduced to "qgZ is on" (``all2all_process_group``, set by the engine exactly when
``zero_quantized_gradients`` is): zeropp's ``reduce_scatter(bits=4)`` then does one quantized hop inside the node
(``zeropp.comm.reduce_scatter``: one node skips the inter-node hop). Everything else is DeepSpeed's code, line for
line (Apache-2.0, DeepSpeed 0.19.8 ``runtime/zero/stage3.py``): the cast to ``communication_data_type``,
``gradient_predivide_factor``, the AutoEP averaging scale, the cast to ``gradient_accumulation_dtype``.
``patches.install`` sets it as the name-mangled attribute ``_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads``.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
from torch.nn import Parameter

from .reduce_scatter import all_to_all_quant_reduce

MANGLED_NAME = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
"""The attribute of ``DeepSpeedZeroOptimizer_Stage3`` that ``__avg_scatter_grads`` is stored under."""


def avg_scatter_grads(self: Any, params_to_reduce: list[Parameter],
                      communication_data_type: torch.dtype) -> list[torch.Tensor]:
    """Average the bucket's gradients over the partition group and return this rank's partition of each
    (DeepSpeed's method; qgZ whenever it is on, one node included)."""
    self._assert_same_partition_group(params_to_reduce)
    process_group = self._get_param_partition_group(params_to_reduce[0])

    full_grads_for_rank = [p.grad for p in params_to_reduce]
    if communication_data_type != self.dtype:
        full_grads_for_rank = [g.to(communication_data_type) for g in full_grads_for_rank]

    if self.postscale_gradients and self.gradient_predivide_factor != 1.0:
        full_grads_for_rank = [g.div(self.gradient_predivide_factor) for g in full_grads_for_rank]

    if self.all2all_process_group is not None:
        grad_partitions_for_rank = all_to_all_quant_reduce(full_grads_for_rank, self.all2all_process_group)
    else:
        grad_partitions_for_rank = reduce_scatter_coalesced(full_grads_for_rank, process_group)

    if (self.postscale_gradients and self.gradient_predivide_factor != 1.0
            and self.gradient_predivide_factor != dist.get_world_size(process_group)):
        grad_partitions_for_rank = [g.mul(self.gradient_predivide_factor) for g in grad_partitions_for_rank]

    partition_world_size = dist.get_world_size(group=process_group)
    averaging_world_size = self._gradient_averaging_world_size(params_to_reduce, partition_world_size)
    if averaging_world_size != partition_world_size:
        scale = partition_world_size / float(averaging_world_size)
        grad_partitions_for_rank = [g.mul(scale) for g in grad_partitions_for_rank]

    if communication_data_type != self.gradient_accumulation_dtype:
        grad_partitions_for_rank = [g.to(self.gradient_accumulation_dtype) for g in grad_partitions_for_rank]

    return grad_partitions_for_rank
