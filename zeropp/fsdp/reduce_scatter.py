"""FSDP2's gradient reduce-scatter run by ``zeropp.comm.reduce_scatter``: exact, or two-hop qgZ.

Subclasses FSDP2's ``ReduceScatter``, the interface that the public ``FSDPModule.set_custom_reduce_scatter`` takes;
torch defines it only in a private module, so it comes from ``zeropp._torch_internals`` (where a test pins the
signature implemented here and that FSDP2 calls it).

What FSDP2 passes (torch 2.13, ``_fsdp_collectives.foreach_reduce``): ``input_tensor`` is a flat buffer of
``P * S`` elements in the reduce dtype (``MixedPrecisionPolicy.reduce_dtype``, else the gradients' dtype) that it
allocated with ``allocate``, rank ``i``'s ``S`` elements (the padded shards of every parameter's gradient) at
``[i * S, (i + 1) * S)``; ``output_tensor`` is ``S`` elements, this rank's slice of the reduction. ``op`` comes
from ``_get_gradient_divide_factors``: ``AVG`` (fp32/bf16, the default), ``SUM`` (fp16, or
``set_force_sum_reduction_for_comms(True)``, or a custom divide factor on those paths; FSDP2 then divides before
and/or after the call itself), or ``PREMUL_SUM(1 / factor)`` (``set_gradient_divide_factor`` with fp32/bf16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..quant.rotation import check_rotation_size
from .._torch_internals import FSDPReduceScatter
from .hook import FlatBufferHook


class ZeroppReduceScatter(FlatBufferHook, FSDPReduceScatter):
    """Reduce-scatter of FSDP2's flat gradient buffer through ``zeropp.comm.reduce_scatter`` over ``topology``.

    ``bits`` set: qgZ (intra-node all-to-all of quantized slices, reduce and requantize, inter-node all-to-all,
    reduce in float32), the layout ``reduce_scatter_tensor``'s, so ``output_tensor`` is exactly the slice FSDP2
    expects. ``bits=None``: exact. ``AVG`` divides by the group size once, ``SUM`` does not; ``PREMUL_SUM`` (a
    custom divide factor) cannot be read back through a public API and raises, naming the fix. The call always
    completes before returning (FSDP2 never asks for an asynchronous reduce-scatter) and returns ``None``.

    With ``error_feedback``, the hook holds one ``zeropp.comm.ErrorFeedback``: the residuals of ONE gradient
    buffer, so install one hook per FSDP2 module (``enable`` does; FSDP2 refuses a custom reduce-scatter on a
    module with several parameter groups, so one module has one buffer). FSDP2 reduces only the parameters that
    got a gradient; when that set changes, the buffer's size changes and the residuals are dropped (reset), since
    they describe another layout.

    Args:
        topology: the ``zeropp.comm.Topology`` of FSDP2's shard group.
        bits: 8 or 4 for qgZ, ``None`` for exact.
        block_size: elements per quantization block (each rank's slice is packed on its own).
        error_feedback: keep the quantization residuals of this buffer and add them back at the next reduction
            (qgZ only: ``ValueError`` with ``bits=None``).
        gradient_rotation: qgZ only: the block size of a Hadamard rotation of each rank's slice before it is
            quantized, undone after the reduction (``zeropp.comm.reduce_scatter``'s ``rotation``); ``None``: off.
    """

    def __init__(
        self, topology: comm.Topology, bits: int | None, block_size: int, error_feedback: bool = False,
        gradient_rotation: int | None = None,
    ) -> None:
        check_error_feedback(error_feedback, bits)
        check_gradient_rotation(gradient_rotation, bits, block_size)
        super().__init__(topology, bits, block_size)
        self.error_feedback: comm.ErrorFeedback | None = comm.ErrorFeedback() if error_feedback else None
        self.gradient_rotation = gradient_rotation

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self.is_shard_group(group):
            raise ValueError(
                f"zeropp.fsdp: FSDP2 reduce-scatters over ranks {dist.get_process_group_ranks(group)} but zeropp "
                f"was enabled for ranks {self.topology.ranks}; call zeropp.fsdp.enable after fully_shard, with the "
                "topology of the module's mesh"
            )
        if op == dist.ReduceOp.AVG:
            reduce_op = comm.ReduceOp.AVG
        elif op == dist.ReduceOp.SUM:
            reduce_op = comm.ReduceOp.SUM
        else:
            raise ValueError(
                f"zeropp.fsdp: FSDP2 asks for a reduce-scatter with op={op!r} (a custom gradient divide factor, "
                "set_gradient_divide_factor); its factor is not readable through a public API. Call "
                "module.set_force_sum_reduction_for_comms(True) as well: FSDP2 then passes SUM and divides itself"
            )
        ef = self.error_feedback
        if ef is not None and ef.key is not None and ef.key[0] != input_tensor.numel():
            ef.reset()  # the residuals (keyed by the input's numel first) describe another buffer layout
        comm.reduce_scatter(input_tensor, self.bits, op=reduce_op, topology=self.topology, out=output_tensor,
                            block_size=self.block_size, error_feedback=self.error_feedback,
                            rotation=self.gradient_rotation)
        return None


def check_error_feedback(error_feedback: bool, bits: int | None) -> None:
    """Raise unless ``error_feedback`` comes with quantized gradients (``bits`` 8 or 4)."""
    if error_feedback and bits is None:
        raise ValueError(
            "error_feedback=True needs quantized gradients: pass gradient_bits=8 or 4 (exact reduce-scatters "
            "drop nothing to feed back)"
        )


def check_gradient_rotation(gradient_rotation: int | None, bits: int | None, block_size: int) -> None:
    """Raise unless ``gradient_rotation`` is ``None`` or a rotation size dividing ``block_size`` that comes with
    quantized gradients (``bits`` 8 or 4)."""
    if gradient_rotation is None:
        return
    if bits is None:
        raise ValueError(f"gradient_rotation={gradient_rotation} needs quantized gradients: pass gradient_bits=8 or 4 "
                         "(an exact reduce-scatter has no quantization to protect)")
    check_rotation_size(gradient_rotation)
    if block_size % gradient_rotation:
        raise ValueError(f"gradient_rotation={gradient_rotation} must divide block_size={block_size}; use a smaller "
                         "rotation or a larger block size")
