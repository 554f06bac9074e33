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

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..config.blocks import LOCO_BETA
from .._torch_internals import FSDPReduceScatter
from ..quant.format import SUPPORTED_BITS
from ..quant.rotation import check_rotation_size
from .hook import FlatBufferHook
from .segments import FormatPart, format_parts


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

    ``error_feedback="loco"``: the residuals kept as LoCo's 8-bit moving average (``comm.ErrorFeedback("loco",
    error_feedback_beta)``, ``1 + 4 / block_size`` bytes per element instead of 4). ``stochastic_rounding``: every
    qgZ call rounds its codes stochastically, seeded by ``seed`` and the hook's call count (``comm.reduce_scatter``'s
    ``seed``; one seed per per-format part), so a run that makes the same calls reproduces bit for bit.

    ``intra_bits``: qgZ's intra-node hop in its own width (``zeropp.comm.reduce_scatter``'s ``intra_bits``: e.g.
    8 inside the node, ``bits`` 4 across, as SDP4Bit); the inter-node bytes are those of ``bits``.

    Per-parameter formats (``bits`` a sequence, one per segment of ``segments``, from ``enable(rules=...)``): when
    they differ, FSDP2's ``P x S`` buffer is split by columns into one ``P x S_f`` buffer per format
    (``zeropp.fsdp.segments.format_parts``: each format's segments back to back, in order of first appearance),
    each reduce-scattered by its own ``zeropp.comm.reduce_scatter`` (exact, or qgZ with this hook's rotation,
    ``intra_bits`` and one ``ErrorFeedback`` per quantized part), and the slices are copied back to their columns.
    An exact part is reduced as FSDP2 reduces it: its values are plain FSDP2's bit for bit. It needs the whole
    buffer: FSDP2 reduces only the parameters that got a gradient, and when some did not, the buffer no longer
    says which columns are whose, so the call raises, naming the fix.

    Args:
        topology: the ``zeropp.comm.Topology`` of FSDP2's shard group.
        bits: 8, 4 or 2 for qgZ, ``None`` for exact; or a sequence of those, one per segment (needs ``segments``).
        block_size: elements per quantization block (each rank's slice is packed on its own).
        error_feedback: keep the quantization residuals of this buffer and add them back at the next reduction
            (qgZ only: ``ValueError`` with ``bits=None``): ``True`` in float32, ``"loco"`` in 8 bits.
        error_feedback_beta: LoCo's moving-average coefficient in ``[0, 1)`` (``error_feedback="loco"`` only).
        stochastic_rounding: qgZ's codes rounded stochastically (unbiased), deterministic from ``seed``.
        seed: this hook's stochastic-rounding seed (``enable`` gives each FSDP2 group its index).
        gradient_rotation: qgZ only: the block size of a Hadamard rotation of each rank's slice before it is
            quantized, undone after the reduction (``zeropp.comm.reduce_scatter``'s ``rotation``); ``None``: off.
        intra_bits: qgZ only: 8, 4 or 2 bits for the intra-node hop; ``None``: ``bits``.
        segments: per-rank elements of each parameter's padded gradient shard, in FSDP2's order
            (``zeropp.fsdp.segments.shard_numels``), for per-parameter ``bits``.
        names: the parameters' qualified names, one per segment (messages only).
        tp_sharded: with tensor parallelism, 1 per segment whose parameter tp shards, 0 per segment it replicates
            (``zeropp.fsdp.segments.tp_sharded``): when both occur, the two kinds are reduced as separate parts
            (as per-parameter formats are), so no qgZ block mixes them and the tp replicas of a replicated
            parameter get bit-identical gradients (exact parts need no split).
    """

    def __init__(
        self, topology: comm.Topology, bits: int | None | Sequence[int | None], block_size: int,
        error_feedback: bool | str = False, gradient_rotation: int | None = None, intra_bits: int | None = None,
        segments: Sequence[int] = (), names: Sequence[str] = (), error_feedback_beta: float = LOCO_BETA,
        stochastic_rounding: bool = False, seed: int = 0, tp_sharded: Sequence[int] = (),
    ) -> None:
        self.parts: list[FormatPart] | None = None
        self.segments = tuple(int(s) for s in segments)
        self.names = tuple(names)
        classes = None
        if len(set(c for c, n in zip(tp_sharded, self.segments) if n)) > 1:
            classes = tuple(tp_sharded)
            if not isinstance(bits, Sequence):
                bits = [bits] * len(self.segments)
        if isinstance(bits, Sequence):
            parts = format_parts(self.segments, bits, block_size, align=False, classes=classes)
            quantized = [part.bits for part in parts if part.bits is not None]
            if len(parts) > 1:
                self.parts = parts
            bits = parts[0].bits if len(parts) == 1 else None
        else:
            quantized = [bits] if bits is not None else []
        any_bits = quantized[0] if quantized else None
        check_error_feedback(error_feedback, any_bits, error_feedback_beta)
        if stochastic_rounding and any_bits is None:
            raise ValueError("stochastic_rounding=True needs quantized gradients: pass gradient_bits=8, 4 or 2 (an "
                             "exact reduce-scatter rounds nothing)")
        check_gradient_rotation(gradient_rotation, any_bits, block_size)
        check_intra_bits(intra_bits, any_bits)
        super().__init__(topology, bits, block_size)
        store, beta = ("loco", error_feedback_beta) if error_feedback == "loco" else ("fp32", 0.0)
        self.error_feedback: comm.ErrorFeedback | None = (comm.ErrorFeedback(store, beta)
                                                          if error_feedback and self.parts is None else None)
        self.part_feedback = [comm.ErrorFeedback(store, beta) if error_feedback and part.bits is not None else None
                              for part in self.parts or []]
        self.stochastic_rounding, self.seed, self.calls = stochastic_rounding, seed, 0
        self.gradient_rotation = gradient_rotation
        self.intra_bits = intra_bits

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
        self.calls += 1
        if self.parts is not None:
            self._reduce_parts(output_tensor, input_tensor, reduce_op)
            return None
        ef = self.error_feedback
        if ef is not None and ef.key is not None and ef.key[0] != input_tensor.numel():
            ef.reset()  # the residuals (keyed by the input's numel first) describe another buffer layout
        self._reduce(input_tensor, self.bits, reduce_op, output_tensor, ef, 0)
        return None

    def call_seed(self, part: int = 0) -> int:
        """The stochastic-rounding seed (``[0, 2**32)``) of this call's part ``part``: the first 4 bytes,
        little-endian, of SHA-256 of ``f"{seed}/{calls}/{part}"`` (``calls`` counts this hook's calls from 1)."""
        return comm.derive_seed(self.seed, self.calls, part)

    def _reduce(self, full: torch.Tensor, bits: int | None, op: comm.ReduceOp, out: torch.Tensor,
                ef: comm.ErrorFeedback | None, part: int) -> None:
        quantized = bits is not None
        comm.reduce_scatter(full, bits, op=op, topology=self.topology, out=out, block_size=self.block_size,
                            error_feedback=ef, rotation=self.gradient_rotation if quantized else None,
                            intra_bits=self.intra_bits if quantized else None,
                            seed=self.call_seed(part) if quantized and self.stochastic_rounding else None)

    def _reduce_parts(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: comm.ReduceOp) -> None:
        """The per-format path: one reduce-scatter per format part of the ``P x S`` buffer's columns."""
        assert self.parts is not None
        size, width = self.topology.world_size, sum(self.segments)
        if input_tensor.numel() != size * width:
            names = ", ".join(self.names) or f"segments {list(self.segments)}"
            raise ValueError(
                f"zeropp.fsdp: FSDP2 reduce-scatters {input_tensor.numel()} gradient elements for a group whose "
                f"parameters ({names}) are reduced in parts (per-parameter gradient formats, or tensor-parallel-"
                f"replicated and -sharded parameters apart) and have {size} x {width} elements in all: "
                "some of them got no gradient this backward, and the buffer no longer says which columns are "
                "whose. Give the group's parameters one gradient format (rules), or wrap the modules whose "
                "parameters may get no gradient with their own fully_shard"
            )
        grid = input_tensor.view(size, width)
        out = output_tensor.view(-1)
        for index, (part, ef) in enumerate(zip(self.parts, self.part_feedback)):
            full = torch.empty(size, part.numel, dtype=input_tensor.dtype, device=input_tensor.device)
            for src, dst, length in part.runs:
                full[:, dst:dst + length].copy_(grid[:, src:src + length])
            mine = torch.empty(part.numel, dtype=output_tensor.dtype, device=output_tensor.device)
            self._reduce(full.view(-1), part.bits, op, mine, ef, index)
            for dst, src, length in part.runs:
                out[dst:dst + length].copy_(mine[src:src + length])


def check_error_feedback(error_feedback: bool | str, bits: int | None, beta: float = LOCO_BETA) -> None:
    """Raise unless ``error_feedback`` is ``False``, or ``True`` / ``"loco"`` with quantized gradients (``bits``
    8, 4 or 2), and ``beta`` keeps its default unless ``error_feedback="loco"`` (as the config's
    ``zeropp.error_feedback_beta``)."""
    if error_feedback not in (False, True, "loco"):
        raise ValueError(f"error_feedback={error_feedback!r} must be False, True (float32 residuals) or 'loco' "
                         "(LoCo's 8-bit moving average)")
    if beta != LOCO_BETA and error_feedback != "loco":
        raise ValueError(f"error_feedback_beta={beta!r} is LoCo's moving-average coefficient: pass "
                         "error_feedback='loco' with it, or leave it out")
    if error_feedback and bits is None:
        raise ValueError(
            "error_feedback=True needs quantized gradients: pass gradient_bits=8 or 4 (or 2; exact reduce-scatters "
            "drop nothing to feed back)"
        )


def check_intra_bits(intra_bits: int | None, bits: int | None) -> None:
    """Raise unless ``intra_bits`` is ``None`` or 8, 4 or 2 that comes with quantized gradients."""
    if intra_bits is None:
        return
    if isinstance(intra_bits, bool) or intra_bits not in SUPPORTED_BITS:
        raise ValueError(f"gradient_bits_intra={intra_bits!r} is not supported; use one of {SUPPORTED_BITS} or None "
                         "(the intra-node hop in gradient_bits)")
    if bits is None:
        raise ValueError(f"gradient_bits_intra={intra_bits} needs quantized gradients: pass gradient_bits=8, 4 or 2 "
                         "(an exact reduce-scatter has no hops to give bits)")


def check_gradient_rotation(gradient_rotation: int | None, bits: int | None, block_size: int) -> None:
    """Raise unless ``gradient_rotation`` is ``None`` or a rotation size dividing ``block_size`` that comes with
    quantized gradients (``bits`` 8 or 4)."""
    if gradient_rotation is None:
        return
    if bits is None:
        raise ValueError(f"gradient_rotation={gradient_rotation} needs quantized gradients: pass gradient_bits=8, 4 "
                         "or 2 (an exact reduce-scatter has no quantization to protect)")
    check_rotation_size(gradient_rotation)
    if block_size % gradient_rotation:
        raise ValueError(f"gradient_rotation={gradient_rotation} must divide block_size={block_size}; use a smaller "
                         "rotation or a larger block size")
