"""The plan space: how parameters (P), gradients (G) and optimizer states (OS) are sharded (AMSP's three factors),
which ZeRO++ options ride on it, and which plans the engine runs today.

A sharding factor is the number of ranks one copy is spread over: 1 (a full replica on every rank), ``k`` ranks of
a node-aligned group (``k`` divides the ranks per node, or is a multiple of it dividing the world), the node
(``k = d``) or the world (``k = P``). Constraints, with ``p``, ``g``, ``o`` the factors of P, G and OS:

* ``p <= g <= o``, each dividing the next: a rank's optimizer shard lies inside its gradient shard (no gradient
  moves between the reduction and the step) and its gradient shard inside its parameter shard's span (the backward
  gathers bring every parameter whose gradient it reduces);
* ``g == 1`` means gradients stay whole and unreduced through the accumulation window and are reduce-scattered
  straight to the OS layout at its end (ZeRO-1).

Named points: ZeRO-1 ``(1, 1, P)``, ZeRO-2 ``(1, P, P)``, ZeRO-3 ``(P, P, P)``, MiCS over ``k`` ranks ``(k, k, k)``
with the cross-group gradient all-reduce once per accumulation window; hpZ is ZeRO-3 with a secondary copy of the
parameters over ``h`` ranks of a node. The engine runs stages 1-3 with hpZ, qwZ/qgZ bits (``gradient_bits_intra``
and int2 gradients included), weight deltas and the offload tiers, and the grouped points: MiCS
(``mics_shard_size``) with qwZ, qgZ (its cross-group all-reduce quantized too) and, for groups of whole nodes, hpZ;
``(1, 1, k)``, ``(1, k, k)`` and ``(1, g, o)`` with ``g < o`` (``zeropp.partition`` at stage 1 / 2, exact
collectives; see ``Partition.grouped_stage``); and the resident point ``(p, P, P)`` (``Partition.resident``:
ZeRO-3's shards with the parameters kept over ``p`` ranks, hpZ's secondary made permanent and rebuilt by one exact
exchange after each step) with qwZ, qgZ and the offload tiers for ``p`` dividing the ranks per node, and the grouped
resident points ``(p, g, o)``, ``1 < p < o`` (``Partition.grouped_resident``: that copy on the groups of
``(1, g, o)`` or MiCS over ``o``) with exact collectives, ``(p, k, k)`` also with qwZ and qgZ; with ``p`` whole
nodes (a multiple of the ranks per node) every resident point with exact collectives only; other plans are the
planner's alone (``Plan.unsupported`` says why a plan cannot run).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

OFFLOAD_TIERS = ("none", "cpu", "nvme")
"""Where the optimizer states live (``zero_optimization.offload_optimizer.device``)."""


@dataclass(frozen=True)
class Partition:
    """Sharding factors of parameters, gradients and optimizer states (ranks per copy; see the module docstring)."""

    params: int
    grads: int
    optimizer: int

    def label(self, world: int, ranks_per_node: int) -> str:
        """``"ZeRO-3"``, ``"MiCS-8"`` or ``"P8/G16/OS16"``."""
        p, g, o = self.params, self.grads, self.optimizer
        named = {(1, 1, world): "ZeRO-1", (1, world, world): "ZeRO-2", (world, world, world): "ZeRO-3"}
        if (p, g, o) in named:
            return named[(p, g, o)]
        if p == g == o:
            return f"MiCS-{p}"
        return f"P{p}/G{g}/OS{o}"

    def mics_size(self, world: int) -> int | None:
        """``k`` when this is MiCS over ``k`` ranks (``(k, k, k)``, ``1 < k < world``), else None."""
        p = self.params
        return p if p == self.grads == self.optimizer and 1 < p < world else None

    def grouped_stage(self, world: int) -> int | None:
        """The stage whose engine runs this partition inside groups of ``k`` ranks, ``1 < k < world``
        (``zeropp.engine.partition``): 1 for ``(1, 1, k)``, 2 for ``(1, k, k)``, 3 for MiCS ``(k, k, k)``; and 2 for
        ``(1, g, o)`` with ``1 < g < o`` (``o`` up to the world: gradients over ``g``, optimizer states over
        ``o``); None otherwise."""
        k = self.optimizer
        if self.params == 1 and 1 < self.grads < k:
            return 2
        if not 1 < k < world:
            return None
        return {(1, 1, k): 1, (1, k, k): 2, (k, k, k): 3}.get((self.params, self.grads, k))

    def resident(self, world: int) -> int | None:
        """``p`` when this is a resident point ``(p, g, o)``, ``1 < p < o``: the parameters kept over ``p`` ranks
        (of a node, or whole nodes) as hpZ's secondary of units laid out over the ``o`` ranks (``zeropp.config.partition
        .resident_size``), else None."""
        p = self.params
        return p if 1 < p < self.optimizer <= world else None

    def grouped_resident(self, world: int) -> bool:
        """Whether this is a resident point with groups: optimizer states below the world or gradients below the
        optimizer states (``zeropp.engine.partition``: ``MicsGroups`` / ``SplitGroups`` with the resident copy)."""
        return self.resident(world) is not None and (self.optimizer < world or self.grads < self.optimizer)

    def stage(self, world: int) -> int | None:
        """The ZeRO stage this partition is, or None for the points the engine does not have yet."""
        return {(1, 1, world): 1, (1, world, world): 2, (world, world, world): 3}.get(
            (self.params, self.grads, self.optimizer))


def shard_factors(world: int, ranks_per_node: int) -> list[int]:
    """The node-aligned sharding factors of a cluster: 1, the divisors of the ranks per node, and the multiples of
    the ranks per node that divide the world."""
    d = ranks_per_node
    return sorted({k for k in range(1, d + 1) if d % k == 0} | {d * m for m in range(1, world // d + 1)
                                                                 if world % (d * m) == 0})


def partitions(world: int, ranks_per_node: int) -> list[Partition]:
    """Every partition of the space on this cluster (the constraints of the module docstring)."""
    ks = shard_factors(world, ranks_per_node)
    out = []
    for o in ks:
        for g in ks:
            for p in ks:
                if p <= g <= o and g % p == 0 and o % g == 0 and o > 1:
                    out.append(Partition(p, g, o))
    return out


@dataclass(frozen=True)
class Plan:
    """One point of the space with its options.

    Args:
        partition: sharding factors.
        weight_bits: qwZ bits of the parameter gathers (8 or 4), None: exact.
        gradient_bits: qgZ bits across nodes (8, 4 or 2), None: exact reduce-scatter.
        gradient_bits_intra: qgZ bits of the intra-node hop (``zeropp.gradient_bits_intra``), None: as
            ``gradient_bits``.
        hpz: hpZ secondary partition size (1: off).
        weight_deltas: ``zeropp.weight_deltas`` (hpZ secondaries kept and updated by int4 deltas).
        offload: optimizer-state tier, one of ``OFFLOAD_TIERS``.
    """

    partition: Partition
    weight_bits: int | None = None
    gradient_bits: int | None = None
    gradient_bits_intra: int | None = None
    hpz: int = 1
    weight_deltas: bool = False
    offload: str = "none"

    def label(self, world: int, ranks_per_node: int) -> str:
        parts = [self.partition.label(world, ranks_per_node)]
        if self.weight_bits:
            parts.append(f"qwZ{self.weight_bits}")
        if self.gradient_bits:
            hop1 = f"{self.gradient_bits_intra}/" if self.gradient_bits_intra else ""
            parts.append(f"qgZ{hop1}{self.gradient_bits}")
        if self.hpz > 1:
            parts.append(f"hpZ{self.hpz}")
        if self.weight_deltas:
            parts.append("deltas")
        if self.offload != "none":
            parts.append(f"offload:{self.offload}")
        return " ".join(parts)

    def secondary(self, world: int) -> int:
        """Ranks of the hpZ secondary partition the engine runs: ``p`` at the resident point, else ``hpz``."""
        return self.partition.resident(world) or self.hpz

    def unsupported(self, world: int, ranks_per_node: int) -> str | None:
        """Why the engine cannot run this plan today, or None when it can."""
        stage = self.partition.stage(world)
        resident = self.partition.resident(world)
        if resident is not None:
            if resident > ranks_per_node:  # the copy over whole nodes (zeropp.config.partition.spanning_refusals)
                refused = [name for name, on in (("qwZ", self.weight_bits), ("qgZ", self.gradient_bits),
                                                 ("hpZ", self.hpz > 1), ("weight deltas", self.weight_deltas),
                                                 ("offload", self.offload != "none")) if on]
                if refused:
                    return (f"parameters resident over whole nodes run with exact collectives only; "
                            f"{', '.join(refused)} refused (docs/partition.md)")
                return None
            if self.partition.grouped_resident(world):
                split = self.partition.grads < self.partition.optimizer  # (p, k, k) quantizes as MiCS
                refused = [name for name, on in (("qwZ", split and self.weight_bits),
                                                 ("qgZ", split and self.gradient_bits),
                                                 ("hpZ", self.hpz not in (1, resident)),
                                                 ("weight deltas", self.weight_deltas),
                                                 ("offload", self.offload != "none")) if on]
                if refused:
                    return (f"a grouped resident point runs with exact collectives (qwZ and qgZ at (p, k, k)); "
                            f"{', '.join(refused)} refused (docs/partition.md)")
                return None
            if self.hpz not in (1, resident) or self.weight_deltas:
                return "the resident point runs with qwZ, qgZ and offload; hpZ and weight deltas are its own copy"
            return None
        grouped = self.partition.grouped_stage(world)
        if grouped == 3:
            hpz_refused = self.hpz > 1 and self.partition.params <= ranks_per_node
            refused = [name for name, on in (("hpZ inside a node's group", hpz_refused),
                                             ("weight deltas", self.weight_deltas),
                                             ("offload", self.offload != "none")) if on]
            if refused:
                return f"MiCS runs with qwZ, qgZ and hpZ (groups of whole nodes) but not {', '.join(refused)} " \
                       "(docs/partition.md)"
            return None
        if grouped is not None:
            lossy = [name for name, on in (("qwZ", self.weight_bits), ("qgZ", self.gradient_bits),
                                           ("hpZ", self.hpz > 1), ("weight deltas", self.weight_deltas),
                                           ("offload", self.offload != "none")) if on]
            if lossy:
                return (f"a grouped stage-1/2 partition runs with exact collectives only; {', '.join(lossy)} refused "
                        "(docs/partition.md)")
            return None
        if stage is None:
            return (f"partition {self.partition.label(world, ranks_per_node)} is not in the engine yet (issue 25 "
                    f"section 1: zero_optimization.zeropp.partition)")
        if self.hpz > 1 and stage != 3:
            return "hpZ needs stage 3"
        if self.weight_deltas and stage != 3:
            return "weight deltas need stage 3"
        return None

    def zero_config(self, world: int, nvme_path: str = "/local_nvme") -> dict[str, Any]:
        """The ``zero_optimization`` section that runs this plan (DeepSpeed's keys, ``zeropp`` for the rest);
        ``nvme_path`` is the swap directory of the NVMe tier (DeepSpeed's example path: put your drive's there).

        Raises:
            ValueError: for a partition the engine does not have yet.
        """
        stage = self.partition.stage(world)
        grouped = self.partition.grouped_stage(world)
        if stage is None and grouped is None and self.partition.resident(world) is None:
            raise ValueError(f"partition {self.partition} has no zero_optimization config yet: "
                             f"only stages 1-3, MiCS, (1, 1, k), (1, k, k), (1, g, o) and (p, g, o) with p < o run "
                             f"today")
        extra: dict[str, Any] = {}
        if self.partition.resident(world) is not None:
            zero: dict[str, Any] = {"stage": 3}
            extra["partition"] = {"parameters": self.partition.params,
                                  **{key: "world" if f == world else f for key, f in
                                     (("gradients", self.partition.grads), ("optimizer", self.partition.optimizer))}}
        elif grouped == 3:
            zero = {"stage": 3, "mics_shard_size": self.partition.mics_size(world)}
        elif grouped is not None:
            zero = {"stage": grouped}
            extra["partition"] = {"parameters": self.partition.params, "gradients": self.partition.grads,
                                  "optimizer": self.partition.optimizer}
        else:
            zero = {"stage": stage}
        if self.weight_bits:
            zero["zero_quantized_weights"] = True
            extra["weight_bits"] = self.weight_bits
        if self.gradient_bits:
            zero["zero_quantized_gradients"] = True
            extra["gradient_bits"] = self.gradient_bits
            if self.gradient_bits_intra:
                extra["gradient_bits_intra"] = self.gradient_bits_intra
        if self.hpz > 1:
            zero["zero_hpz_partition_size"] = self.hpz
        if self.weight_deltas:
            extra["weight_deltas"] = True
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": self.offload, **({"nvme_path": nvme_path}
                                                                     if self.offload == "nvme" else {})}
        if extra:
            zero["zeropp"] = extra
        return zero


GRADIENT_BITS = ((None, None), (4, None), (4, 8), (2, 8))
"""qgZ options the planner tries: (across-node bits, intra-node bits): exact, int4, int8 inside / int4 across,
int8 inside / int2 across."""

LOSSY = ("none", "standard", "all")
"""Which lossy options ``plans`` offers: none (exact plans only), standard (qwZ int8/int4, qgZ int4 and int8/int4,
weight deltas), all (also int2 gradients, which learn markedly slower: 73% of the exact run's loss drop in
tests/engine/test_zeropp.py)."""


def plans(world: int, ranks_per_node: int, offload: tuple[str, ...] = OFFLOAD_TIERS,
          lossy: str = "standard") -> Iterator[Plan]:
    """Every plan of the space on this cluster: each partition with qwZ off/int8/int4 where parameters are gathered,
    the qgZ options where gradients are reduced across nodes (a reduce-scatter, or the all-reduce across gradient
    groups), hpZ over the node and weight deltas where the parameters are sharded across nodes, and each offload
    tier in ``offload``; lossy options as ``lossy`` allows (``LOSSY``)."""
    if lossy not in LOSSY:
        raise ValueError(f"lossy={lossy!r} must be one of {LOSSY}")
    for plan in _all_plans(world, ranks_per_node, offload):
        lossless = not (plan.weight_bits or plan.gradient_bits or plan.weight_deltas)
        if lossy == "all" or lossless or (lossy == "standard" and plan.gradient_bits != 2):
            yield plan


def _all_plans(world: int, ranks_per_node: int, offload: tuple[str, ...]) -> Iterator[Plan]:
    d = ranks_per_node
    multinode = world > d
    for part in partitions(world, ranks_per_node):
        gathers = part.params > 1 or part.optimizer > 1  # ZeRO-1/2 gather the stepped shards too
        for wbits in (None, 8, 4) if gathers else (None,):
            # gradients reduced across nodes: by the reduce-scatter, or by the all-reduce across G groups (MiCS's)
            cross_node_reduce = part.grads > d or (part.grads == 1 and part.optimizer > d) or \
                (1 < part.grads < world and multinode)
            if 1 < part.grads < part.optimizer:  # the boundary's reduce-scatter across the G groups is exact fp32
                cross_node_reduce = part.grads > d or (part.optimizer < world and multinode)
            for gbits, gintra in GRADIENT_BITS if cross_node_reduce else GRADIENT_BITS[:1]:
                hpzs = [1] + ([d] if part.params > d and d > 1 and multinode else [])
                for hpz in hpzs:
                    for deltas in (False, True) if hpz > 1 else (False,):
                        if deltas and wbits:  # no quantized gather left to use the bits (refreshes are exact)
                            continue
                        for tier in offload:
                            yield Plan(part, wbits, gbits, gintra, hpz, deltas, tier)
