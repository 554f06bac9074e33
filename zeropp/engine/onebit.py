"""1-bit Adam on ZeRO stages 1-3: exact Adam until ``freeze_step``, then frozen variance and 1-bit momentum.

``"optimizer": {"type": "OneBitAdam", "params": {"lr", "betas", "eps", "weight_decay", "freeze_step", ...}}`` with
DeepSpeed's names (``cuda_aware`` and ``comm_backend_name`` are accepted and have no effect). docs/onebit.md has the
design in full; in short, with ``P`` ranks, a unit's flat buffer of ``P * S`` elements, ``b1, b2`` the betas:

**Warmup** (optimizer steps ``1 .. freeze_step``): the engine's AdamW step, unchanged: exact gradient reduce-scatter,
each rank steps its shard of ``m`` (``exp_avg``) and ``v`` (``exp_avg_sq``). Bit for bit ``"type": "AdamW"`` with the
same hyperparameters.

**Compressed phase** (step ``t > freeze_step``), per unit:

1. backward does not reduce-scatter: each rank adds its own gradient ``g_k`` into a full-size fp32 buffer;
2. at the first compressed step each rank's local momentum starts as the averaged one: ``m_k = all-gather(exp_avg)``
   (one exact fp32 all-gather, once), worker errors ``e_k = 0``;
3. ``m_k <- b1 m_k + (1 - b1) g_k`` (the whole buffer, local);
4. ``x_k = m_k + e_k``; ``x_k`` is compressed to signs and per-block RMS scales (``zeropp.quant.onebit``), slice
   ``r`` sent to rank ``r`` (``zeropp.comm.onebit``); ``e_k <- x_k - C(x_k)``;
5. the owner ``r`` averages the ``P`` decoded slices: ``m_hat = mean_k C(x_k)[r]``, set to 0 where the frozen ``v`` is
   0 (no gradient in the whole warmup: 1 bit cannot send a zero, and ``scale / eps`` would be the step), stored as its
   ``exp_avg`` shard;
6. the owner steps its master shard with ``v`` frozen at step ``freeze_step``: torch's AdamW arithmetic with
   ``m_hat`` for the momentum, ``p <- p (1 - lr wd) - lr / (1 - b1^t) * m_hat / (sqrt(v) / sqrt(1 - b2^freeze_step)
   + eps)``; then the engine publishes the shard as after any step (stages 1/2: the all-gather of the weights).

No server error and no second compression: DeepSpeed's ``compressed_allreduce`` recompresses the mean and
all-gathers it because every rank needs the whole averaged momentum (its next local momentum starts from it). Here
each rank keeps its *own* momentum ``m_k``, which is linear in its gradients, so ``mean_k m_k`` is exactly the
momentum of the averaged gradients and only the owner of a slice needs its mean: half the bytes of DeepSpeed's
two-phase exchange. Error feedback: ``m_hat_t = mean_k (m_k,t + e_k,t-1 - e_k,t)``, so the sum over steps of
``m_hat - m_true`` telescopes to ``mean_k (e_k,0 - e_k,T)``, bounded by the per-block compression error.

Memory per rank, per element of the model (compressed phase): 12 bytes in fp32 (local gradient, local momentum,
worker error), full size on every rank: ZeRO's ``1/P`` scaling of the momentum is given up, which is the price of
compressing it. Bytes per step per rank: ``(P - 1) * (S / 8 + 4 * S / B)`` per unit (``B``:
``zero_optimization.zeropp.block_size``) sent and received, counted under ``"reduce_scatter"``, against ``(P - 1) * 4
S`` for the exact fp32 reduce-scatter. One rank: nothing is compressed (as DeepSpeed): ``exp_avg`` is the momentum of
the rank's gradient, the variance frozen all the same.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .collectives import Collectives
from .unit import Unit

if TYPE_CHECKING:
    from .optimizer import PartitionedOptimizer


class OneBitAdam:
    """The compressed phase of OneBitAdam for ``optimizer`` (a ``PartitionedOptimizer`` of type ``"OneBitAdam"``,
    which calls ``begin`` and ``step_unit``; the engine calls ``take``, ``gradients`` and ``zero_grad``).

    Attributes (one entry per unit, ``None`` until the compressed phase needs it; fp32, ``P * S`` elements, more
    than one rank):
        grads: this rank's own gradient, accumulated over the window's micro-batches.
        momentum: this rank's local momentum ``m_k``.
        error: this rank's worker error ``e_k``.
    """

    def __init__(self, optimizer: PartitionedOptimizer, units: list[Unit], comm: Collectives) -> None:
        betas = {tuple(group["betas"]) for group in optimizer.param_groups}
        if len(betas) > 1:
            raise ValueError(f"OneBitAdam takes one betas for all parameter groups (its local momentum spans the "
                             f"groups), got {sorted(betas)}; set betas in the optimizer block only")
        self.optimizer = optimizer
        self.units = units
        self.comm = comm
        self.freeze_step: int = optimizer.defaults["freeze_step"]
        self._index = {id(unit): u for u, unit in enumerate(units)}
        n = len(units)
        self.grads: list[torch.Tensor | None] = [None] * n
        self.momentum: list[torch.Tensor | None] = [None] * n
        self.error: list[torch.Tensor | None] = [None] * n

    @property
    def compressing(self) -> bool:
        """Whether the next optimizer step is a compressed one (``freeze_step`` steps applied already)."""
        return self.optimizer.steps[0] >= self.freeze_step

    @property
    def diverts(self) -> bool:
        """Whether backward keeps the gradients local (``take``) instead of reduce-scattering them: compressed and
        more than one rank."""
        return self.compressing and self.comm.world_size > 1

    def take(self, unit: Unit, grads: list[torch.Tensor | None]) -> None:
        """Add ``grads`` (``Unit.take_gradients``) into the unit's local gradient buffer, in its flat layout."""
        u = self._index[id(unit)]
        world = self.comm.world_size
        packed = unit.reduce_buffers.take(world * unit.shard_numel, unit.full.device)
        unit.pack_gradients(grads, packed.view(world, unit.shard_numel))
        if self.grads[u] is None:
            self.grads[u] = packed.clone()
        else:
            self.grads[u].add_(packed)
        unit.reduce_buffers.give(packed)

    def gradients(self) -> list[torch.Tensor]:
        """Each unit's gradient as this rank holds it for this step: its local full buffer when ``diverts`` (zeros
        for a unit that got none), else its reduced ``grad_shard``."""
        if not self.diverts:
            return [unit.grad_shard for unit in self.units]
        for u, unit in enumerate(self.units):
            if self.grads[u] is None:
                self.grads[u] = torch.zeros(self.comm.world_size * unit.shard_numel, device=unit.full.device)
        return [g for g in self.grads if g is not None]

    def zero_grad(self) -> None:
        """Drop the local gradients (after a step, applied or skipped)."""
        for g in self.grads:
            if g is not None:
                g.zero_()

    def begin(self) -> None:
        """Before a compressed step: start each unit's local momentum (more than one rank) from the averaged one,
        an exact all-gather of the ``exp_avg`` shards, and its worker error at zero, unless held already (a
        checkpoint may have restored them)."""
        if self.comm.world_size == 1:
            return
        for u, unit in enumerate(self.units):
            if self.momentum[u] is None:
                exp_avg = self.optimizer.state["exp_avg"][u]
                whole = exp_avg.new_empty(self.comm.world_size * unit.shard_numel)
                self.comm.gather_exact(exp_avg, whole)
                self.momentum[u] = whole
                self.error[u] = torch.zeros_like(whole)

    @torch.no_grad()
    def step_unit(self, u: int) -> None:
        """One compressed step of unit ``u`` (``optimizer.steps`` already counts it): the momentum exchange (steps
        3-5 of the module docstring; one rank: ``exp_avg`` updated with the gradient shard), then the master update
        with the frozen variance, per parameter group."""
        unit = self.units[u]
        beta1, beta2 = self.optimizer.param_groups[0]["betas"]
        m_hat = self.optimizer.state["exp_avg"][u]
        v = self.optimizer.state["exp_avg_sq"][u]
        if self.comm.world_size == 1:
            m_hat.mul_(beta1).add_(unit.grad_shard, alpha=1 - beta1)
        else:
            m, e, g = self.momentum[u], self.error[u], self.grads[u]
            assert m is not None and e is not None and g is not None  # begin() and gradients() ran
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            self.comm.reduce_scatter_onebit(m + e, m_hat, e)
        m_hat.masked_fill_(v == 0, 0.0)  # DeepSpeed's exp_avg_mask, where the warmup never saw a gradient
        bias2_sqrt = math.sqrt(1 - beta2**self.freeze_step)
        for g_index, segments in self.optimizer.segments_of(u).items():
            group = self.optimizer.param_groups[g_index]
            step_size = group["lr"] / (1 - beta1 ** self.optimizer.steps[g_index])
            for seg in segments:
                p = unit.master[seg.start : seg.stop]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = v[seg.start : seg.stop].sqrt().div_(bias2_sqrt).add_(group["eps"])
                p.addcdiv_(m_hat[seg.start : seg.stop], denom, value=-step_size)
