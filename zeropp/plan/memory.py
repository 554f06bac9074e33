"""Memory per rank of a plan, in bytes, by what holds it.

* ``params``: the compute-dtype parameters a rank keeps between uses: its P shard (``S_p`` elements per unit) when
  parameters are sharded, else the whole padded flat buffer and a copy of the rank's own shard (stages 1 and 2
  keep ``(o + 1) S_o`` elements per unit: the optimizer step writes the shard, the post-step gather fills the
  buffer);
* ``gathered``: stage 3's working set of whole units, the two largest (the one computing and the one prefetched);
* ``secondary``: hpZ's secondary partition (``p S_p / h`` per unit, held from the first gather to the step), plus
  weight deltas' reconstruction (``S_p``, kept for good) and, with qwZ, the secondary's qwZ pack (the intra-node
  gathers send it; made once per step); at the resident points ``(p, g, o)``, ``1 < p < o``, the units are laid
  out over the ``o`` ranks (``S_p`` is ``S_o``; ZeRO-3's at ``(p, P, P)``) and the secondary over ``h = p`` ranks,
  ``o S_o / p`` elements, is kept for good (with its qwZ pack under qwZ; no reconstruction);
* ``grads``: the float32 gradient shards the optimizer reads (``S_o`` per unit; ``zeropp.engine.unit``'s
  ``grad_shard``), and with gradients sharded over fewer ranks than the optimizer (``(1, g, o)``, ``g < o``) the
  float32 rows accumulated between boundaries (``(o / g) S_o`` per unit, ``Unit.grad_accumulator``). The grouped
  points' cross-group reductions work in place on these (``zeropp.engine.partition``: the shards are views of one
  buffer), so they add no temporary;
* ``grad_accum``: ZeRO-1's whole gradients (compute dtype) kept unreduced through the accumulation window;
* ``optimizer``: the float32 master (``S_o``) and AdamW's two moments (``2 S_o``) per unit: 0 on the device when
  offloaded (``offload_optimizer`` cpu or nvme);
* ``activations``: ``ModelSpec.activation_bytes`` of one micro-batch.

The first five and ``optimizer`` are what the engine allocates; tests/plan compares them with a real engine's tensors.
"""

from __future__ import annotations

from .model import ModelSpec
from .space import Plan
from .traffic import alignment, pack_bytes, shard_numel

OPTIMIZER_STATES = 2
"""AdamW's float32 states per element (``exp_avg``, ``exp_avg_sq``)."""


def memory(model: ModelSpec, plan: Plan, world: int, micro: int, seq: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes per rank by holder (see the module docstring)."""
    part = plan.partition
    align = alignment(plan)
    resident = part.resident(world) is not None
    h = plan.secondary(world)
    b = dtype_bytes
    out = dict.fromkeys(("params", "gathered", "secondary", "grads", "grad_accum", "optimizer", "activations"), 0)
    whole = []
    for unit, count in model.groups():  # identical units once, times their count
        so = shard_numel(unit, align, part.optimizer)
        ranks = part.optimizer if resident else part.params
        sp = shard_numel(unit, align, ranks)
        if part.params > 1:
            out["params"] += count * sp * b
            whole += [ranks * sp * b] * min(count, 2)
            if h > 1:
                secondary = ranks * sp // h
                out["secondary"] += count * secondary * b
                if plan.weight_deltas or resident:
                    packed = pack_bytes(secondary, plan.weight_bits, b) if plan.weight_bits else 0
                    out["secondary"] += count * ((0 if resident and not plan.weight_deltas else sp * b) + packed)
        else:
            out["params"] += count * (part.optimizer + 1) * so * b
        out["grads"] += count * 4 * so
        if 1 < part.grads < part.optimizer:
            out["grads"] += count * 4 * (part.optimizer // part.grads) * so
        if part.grads == 1:
            out["grad_accum"] += count * unit.numel * b
        if plan.offload == "none":
            out["optimizer"] += count * 4 * so * (1 + OPTIMIZER_STATES)
    out["gathered"] = sum(sorted(whole)[-2:])
    out["activations"] = model.activation_bytes(micro, seq, b)
    return out
