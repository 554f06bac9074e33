"""``zero_optimization.zeropp.partition`` and DeepSpeed's ``mics_shard_size``: over how many ranks the parameters
(P), gradients (G) and optimizer states (OS) are sharded (AMSP's three factors; the space: ``zeropp.plan.space``).

A factor is ``"world"`` (the data-parallel world, ``W`` ranks), ``"node"`` (the ranks per node, ``d``) or a rank
count ``k``; a copy sharded over ``k < W`` ranks is replicated across the ``W / k`` groups. The constraints, with
``p``, ``g``, ``o`` the factors of P, G and OS:

* each factor divides ``W`` and is node-aligned: ``k`` divides ``d``, or is a multiple of ``d`` (whole nodes);
  a group then never straddles a node boundary, so its traffic has one link class per hop;
* ``p <= g <= o``, each dividing the next: a rank's optimizer shard lies inside its gradient shard (no gradient
  moves between the reduction and the step) and its gradient shard inside its parameter shard's span.

``stage`` is the shorthand: stage 1 is ``(1, 1, W)``, stage 2 ``(1, W, W)``, stage 3 ``(W, W, W)``. The engine
also runs, for ``2 <= k < W``, the *grouped* points, its stage inside each group of ``k`` ranks with the groups'
gradient shards averaged once per accumulation boundary (``zeropp.engine.partition``): ``(1, 1, k)`` at stage 1,
``(1, k, k)`` at stage 2 and ``(k, k, k)`` at stage 3, MiCS (DeepSpeed's ``mics_shard_size = k``), and at stage 2
``(1, g, o)`` with ``1 < g < o`` (``o`` up to the world): gradients reduce-scattered over groups of ``g`` every
micro-batch, then across the ``o / g`` groups of an ``o`` group at the boundary, optimizer states over ``o``; and at
stage 3 the *resident* point ``(p, W, W)``: ZeRO-3's gradients and optimizer states with the parameters kept over
``p`` ranks (hpZ's secondary made permanent: ``p`` ranks of a node, or ``p / d`` whole nodes), rebuilt exactly from
the stepped shards after each step (``resident_size``); and at stage 3 the *grouped resident* points ``(p, g, o)``,
``2 <= p < o``, with ``o`` below the world or ``g`` below ``o``: ``(1, g, o)``'s (or MiCS over ``o``'s) groups with
that parameter copy, e.g. ``(k, k, o)`` and ``(p, k, k)``. A ``partition`` must be one of its ``stage``'s points
(``engine_stage``); what is left (everything replicated) is refused naming why (``unbuilt_reason``,
``partition_problems``) and what runs. ``mics_refusals``, ``grouped_refusals``, ``resident_refusals``,
``grouped_resident_refusals`` and ``spanning_refusals`` (parameters over whole nodes) name the options those points
do not combine with.

``"partition": "auto"`` (without ``mics_shard_size``) leaves the choice to the planner among the points the engine
runs at ``stage`` or below (the stage is a ceiling: stage 3 lets it pick any point, stage 2 never shards the
parameters, stage 1 shards only the optimizer states): ``zeropp.initialize`` replaces it, and the stage, by the point
``zeropp.engine.auto_partition`` picks for the model, the world, the memory limit and the options given, before
anything else reads it (``partition_point`` refuses an unresolved ``"auto"``).

Checks that need the ranks per node (``"node"``, node alignment) run at ``zeropp.initialize``
(``partition_point``); the rest when the config is parsed, for its world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, Problems
from .readers import check_keys, get_bool

PARTITION_KEYS = ("parameters", "gradients", "optimizer")
"""The keys of ``zeropp.partition``, in the order P, G, OS."""

NAMED_FACTORS = ("world", "node")
"""Factors named by the cluster's shape: the whole data-parallel world, the ranks of one node."""

MICS_OFF = -1
"""DeepSpeed's ``mics_shard_size`` default: MiCS off."""

AUTO = "auto"
"""``zeropp.partition: "auto"``: the planner picks the point, at the stage or below (module docstring)."""

_WHERE = "zero_optimization.zeropp.partition"


@dataclass(frozen=True)
class PartitionConfig:
    """``zeropp.partition`` as given: each factor ``"world"``, ``"node"`` or a positive rank count."""

    parameters: int | str
    gradients: int | str
    optimizer: int | str

    def factors(self, world: int, ranks_per_node: int | None) -> tuple[int | None, int | None, int | None]:
        """``(p, g, o)`` in ranks for a world of ``world`` ranks with ``ranks_per_node`` per node; ``"node"`` is
        None while the ranks per node are unknown (``None``)."""
        return tuple(world if v == "world" else ranks_per_node if v == "node" else v  # type: ignore[return-value]
                     for v in (self.parameters, self.gradients, self.optimizer))


def parse_partition(value: Any, p: Problems) -> PartitionConfig | str | None:
    """``zeropp.partition``: null, ``"auto"`` (``AUTO``), or ``{"parameters": f, "gradients": f, "optimizer": f}``
    with each ``f`` ``"world"``, ``"node"`` or a positive integer."""
    if value is None or value == AUTO:
        return value
    if not isinstance(value, Mapping):
        p.add(_WHERE, f"{_WHERE} must be an object {{\"parameters\": f, \"gradients\": f, \"optimizer\": f}} (each f "
                      f"\"world\", \"node\" or a rank count) or \"auto\" (the planner picks), got {value!r}")
        return None
    check_keys(p, value, _WHERE, list(PARTITION_KEYS))
    factors: list[int | str] = []
    for key in PARTITION_KEYS:
        name = f"{_WHERE}.{key}"
        if key not in value:
            p.add(name, f"{_WHERE} needs \"{key}\": \"world\", \"node\" or a rank count")
            continue
        given = value[key]
        if given in NAMED_FACTORS or (isinstance(given, int) and not isinstance(given, bool) and given >= 1):
            factors.append(given)
        else:
            p.add(name, f"{name}={given!r} must be \"world\", \"node\" or a positive rank count")
    if len(factors) != len(PARTITION_KEYS):
        return None  # each bad factor is reported above
    return PartitionConfig(*factors)


def stage_point(stage: int, world: int) -> tuple[int, int, int]:
    """The partition ``(p, g, o)`` of a ZeRO stage at ``world`` ranks."""
    return {1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}[stage]


def _label(point: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("node" if f is None else str(f) for f in point) + ")"


def _aligned(k: int, ranks_per_node: int) -> bool:
    return ranks_per_node % k == 0 or k % ranks_per_node == 0


def resident_size(point: tuple[int, int, int], world: int) -> int | None:
    """``p`` when ``point`` ``(p, g, o)`` (one that satisfies the constraints) keeps its parameters *resident* over
    ``2 <= p < o`` ranks (module docstring): the resident point ``(p, W, W)`` and the grouped resident points
    ``(p, g, o)`` with ``o`` below the world or ``g`` below ``o``; None for every other point (``world = W`` is
    kept for the callers' symmetry with ``engine_stage``)."""
    p, _, o = point
    return p if 2 <= p < o <= world else None


def resident_given(partition: PartitionConfig | str | None, world: int) -> bool:
    """Whether ``partition`` (as parsed, the ranks per node unknown) asks for a resident point: parameters over more
    than one rank and fewer than the optimizer states (``"node"`` counts unless both are ``"node"``; on one node,
    where ``"node"`` is the world, ``partition_point`` then runs ZeRO-3 or refuses)."""
    if not isinstance(partition, PartitionConfig):
        return False
    p, _, o = partition.factors(world, None)
    return p not in (1, o)


def engine_stage(point: tuple[int, int, int], world: int) -> int | None:
    """The stage whose engine runs ``point`` ``(p, g, o)`` (one that satisfies the constraints) at ``world`` ranks:
    the stages' own points, for ``2 <= k < world`` the grouped points ``(1, 1, k)`` (1), ``(1, k, k)`` (2) and
    ``(k, k, k)`` (3, MiCS), ``(1, g, o)`` with ``1 < g < o`` (2; ``o`` may be the world) and every resident point
    ``(p, g, o)``, ``2 <= p < o`` (3, ``resident_size``); None for the points the engine does not run (everything
    replicated, ``o = 1``)."""
    p, g, o = point
    for stage in (1, 2, 3):
        if point == stage_point(stage, world):
            return stage
    if p == 1 and 1 < g < o and o % g == 0:
        return 2
    if resident_size(point, world) is not None:
        return 3
    if not 2 <= o < world:
        return None
    return {(1, 1, o): 1, (1, o, o): 2, (o, o, o): 3}.get(point)


def unbuilt_reason(point: tuple[int, int, int], world: int) -> str:
    """Why the engine does not run ``point`` ``(p, g, o)`` (one that satisfies the constraints, ``engine_stage``
    None) at ``world`` ranks: only the replicated point ``o = 1`` is left."""
    return (f"{_label(point)} at {world} ranks replicates everything on every rank (plain data parallelism), which is "
            "not supported")


def partition_problems(stage: int, partition: PartitionConfig | str | None, mics_shard_size: int, world: int,
                       ranks_per_node: int | None) -> list[tuple[str, str]]:
    """``(key, message)`` for each way the partition (``zeropp.partition`` and ``mics_shard_size``, at ``stage``)
    breaks the module docstring's constraints at ``world`` ranks, ``ranks_per_node`` per node (None: not known
    yet, the checks that need it are left out)."""
    out: list[tuple[str, str]] = []
    w = "zero_optimization"
    runs = (f"the engine runs stage 1 = (1, 1, {world}), stage 2 = (1, {world}, {world}), stage 3 = "
            f"({world}, {world}, {world}) and, with k >= 2 a node-aligned divisor of {world} below it, (1, 1, k) at "
            f"stage 1, (1, k, k) at stage 2 and MiCS (k, k, k) at stage 3, (1, g, o) at stage 2 with 1 < g < o, "
            f"g dividing o, and (p, g, o) at stage 3 with 2 <= p < o, as (parameters, gradients, optimizer)")
    if mics_shard_size != MICS_OFF:
        key = f"{w}.mics_shard_size"
        if stage != 3:
            out.append((key, f"{key}={mics_shard_size} shards parameters, gradients and optimizer states over groups "
                             f"of {mics_shard_size} ranks (MiCS), a stage-3 partition: set {w}.stage to 3 (it is "
                             f"{stage}) or leave mics_shard_size out"))
        elif world % mics_shard_size:
            out.append((key, f"{key}={mics_shard_size} must divide the data-parallel world ({world} ranks): the "
                             f"world is cut into groups of that many ranks"))
        elif ranks_per_node is not None and not _aligned(mics_shard_size, ranks_per_node):
            out.append((key, f"{key}={mics_shard_size} must divide the ranks per node ({ranks_per_node}) or be a "
                             f"multiple of it (whole nodes), so that no group straddles a node boundary"))
        elif mics_shard_size == 1 and world > 1:
            out.append((key, f"{key}=1 replicates everything on every rank (plain data parallelism, which is not "
                             f"supported); use 2 or more ranks per group, or {world} (stage 3)"))
    if partition is None:
        return out
    if partition == AUTO:
        if mics_shard_size != MICS_OFF:
            out.append((_WHERE, f"{_WHERE}=\"auto\" contradicts {w}.mics_shard_size={mics_shard_size}: give one of "
                                "them"))
        return out
    assert isinstance(partition, PartitionConfig)
    given = partition.factors(world, ranks_per_node)
    known = [f for f in given if f is not None]
    for key, f in zip(PARTITION_KEYS, given):
        if f is None:
            continue
        name = f"{_WHERE}.{key}"
        if world % f:
            out.append((name, f"{name}={f} must divide the data-parallel world ({world} ranks)"))
        elif ranks_per_node is not None and not _aligned(f, ranks_per_node):
            out.append((name, f"{name}={f} must divide the ranks per node ({ranks_per_node}) or be a multiple of it "
                              f"(whole nodes), so that no group straddles a node boundary"))
    if out or len(known) < len(given):
        return out
    pg, gg, og = given
    assert pg is not None and gg is not None and og is not None
    if not (pg <= gg <= og and gg % pg == 0 and og % gg == 0):
        out.append((_WHERE, f"{_WHERE}={_label(given)} as (parameters, gradients, optimizer) must have each factor "
                            f"at most the next and dividing it: a rank's optimizer shard lies inside its gradient "
                            f"shard, and its gradient shard inside its parameter shard's span"))
        return out
    point = stage_point(stage, world)
    if mics_shard_size != MICS_OFF and given != (mics_shard_size,) * 3:
        out.append((_WHERE, f"{_WHERE}={_label(given)} contradicts {w}.mics_shard_size={mics_shard_size} (the point "
                            f"{_label((mics_shard_size,) * 3)}): give one of them"))
    elif given != point:
        runs_at = engine_stage(given, world)
        if runs_at is None:
            out.append((_WHERE, f"{_WHERE}={_label(given)} is not run by the engine: "
                                f"{unbuilt_reason(given, world)}; {runs}"))
        elif runs_at != stage:
            out.append((_WHERE, f"{_WHERE}={_label(given)} is not the point of {w}.stage={stage} {_label(point)} "
                                f"nor its grouped point; it runs at stage {runs_at}: set {w}.stage to {runs_at}"))
    return out


def partition_point(stage: int, partition: PartitionConfig | str | None, mics_shard_size: int, world: int,
                    ranks_per_node: int) -> tuple[int, int, int]:
    """The ``(p, g, o)`` the engine runs at ``world`` ranks, ``ranks_per_node`` per node.

    Raises:
        ConfigError: naming each value that the topology cannot serve or the engine cannot run, or an ``"auto"``
            that ``zeropp.initialize`` has not resolved yet.
    """
    if partition == AUTO:
        raise ConfigError(f"{_WHERE}=\"auto\" is resolved by zeropp.initialize for the model and topology; pass the "
                          "config through initialize (or give the partition)")
    problems = partition_problems(stage, partition, mics_shard_size, world, ranks_per_node)
    if problems:
        raise ConfigError("; ".join(message for _, message in problems))
    if isinstance(partition, PartitionConfig):
        return partition.factors(world, ranks_per_node)  # type: ignore[return-value]
    if mics_shard_size != MICS_OFF:
        return (mics_shard_size,) * 3
    return stage_point(stage, world)


def parse_mics(block: Mapping[str, Any], p: Problems) -> tuple[int, bool]:
    """DeepSpeed's ``mics_shard_size`` (-1: off, else a positive rank count) and
    ``mics_hierarchical_params_gather`` (a boolean that needs ``mics_shard_size``)."""
    w = "zero_optimization"
    size = block.get("mics_shard_size", MICS_OFF)
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != MICS_OFF):
        p.add(f"{w}.mics_shard_size", f"{w}.mics_shard_size={size!r} must be {MICS_OFF} (off, DeepSpeed's default) "
                                      "or a positive number of ranks per MiCS group")
        size = MICS_OFF
    hierarchical = get_bool(p, block, "mics_hierarchical_params_gather", w, False)
    key = f"{w}.mics_hierarchical_params_gather"
    if hierarchical and size == MICS_OFF and p.ok(f"{w}.mics_shard_size"):
        p.add(key, f"{key}=true gathers MiCS groups' parameters node by node and needs {w}.mics_shard_size; set "
                   "it, or leave mics_hierarchical_params_gather out")
    return size, hierarchical


def _refusals(config: Any, entries: tuple, what: str) -> list[str]:
    """One message per ``(on, key, why)`` of ``entries`` that is on, then per option no grouped point combines with
    (the offload tiers, OneBitAdam), each naming ``what`` refuses it."""
    z = config.zero_optimization
    common = (
        (z.offload, "zero_optimization.offload_optimizer / offload_param / zeropp.memory_budget",
         "the cross-group all-reduce reads every gradient shard on the device"),
        (config.optimizer is not None and config.optimizer.type == "OneBitAdam", "optimizer.type=OneBitAdam",
         "its compressed phase exchanges momenta over the whole world, not a shard group"),
    )
    return [f"{key}: not combined with {what} in this build: {why}" for on, key, why in (*entries, *common) if on]


def mics_refusals(config: Any, size: int | None = None, ranks_per_node: int | None = None) -> list[str]:
    """Why each option of ``config`` (a ``zeropp.config.Config``) that MiCS over groups of ``size`` ranks, with
    ``ranks_per_node`` per node, does not combine with in this build is refused, one message each (empty: none).
    hpZ runs with groups of whole nodes (``size > ranks_per_node``: the secondary inside each node of the group);
    with either unknown (None) it is refused."""
    z = config.zero_optimization
    w = "zero_optimization"
    return _refusals(config, (
        (z.zero_hpz_partition_size > 1 and (size is None or ranks_per_node is None or size <= ranks_per_node),
         f"{w}.zero_hpz_partition_size",
         "hpZ's secondary shard inside the node is what a MiCS group inside a node already is: shrink "
         "mics_shard_size instead (hpZ runs with groups of whole nodes, mics_shard_size above the ranks per node)"),
        (z.zeropp.weight_deltas, f"{w}.zeropp.weight_deltas", "weight deltas update hpZ secondaries, which MiCS "
         "does not have"),
    ), "MiCS (mics_shard_size / zeropp.partition (k, k, k), k below the world)")


def resident_refusals(config: Any, size: int, point: tuple[int, int, int] | None = None) -> list[str]:
    """Why each option of ``config`` (a ``zeropp.config.Config``) that the resident point ``(size, W, W)`` (or the
    grouped resident ``point`` with parameters over ``size``, named in the messages) does not combine with in this
    build is refused, one message each (empty: none). ``zero_hpz_partition_size`` equal to
    ``size`` says the same thing twice and is accepted; weight deltas turn the exact rebuild of the resident copy
    into their quantized updates (the resident point is then hpZ with weight deltas)."""
    z = config.zero_optimization
    w = "zero_optimization"
    why_offload = ("the parameters' resident copy over the group stays on the device between steps; this build "
                   "does not move it")
    entries = (
        (z.zero_hpz_partition_size not in (1, size), f"{w}.zero_hpz_partition_size={z.zero_hpz_partition_size}",
         f"the resident copy over {size} ranks is hpZ's secondary partition, of one size: leave "
         f"zero_hpz_partition_size out or set it to {size}"),
        (z.offload_param.enabled, f"{w}.offload_param", why_offload),
        (z.zeropp.memory_budget is not None, f"{w}.zeropp.memory_budget", why_offload + " (the budget may place "
         "parameters off it)"),
        (not z.zeropp.weight_deltas and (z.zeropp.delta_refresh_interval or z.zeropp.delta_refresh_bits is not None),
         f"{w}.zeropp.delta_refresh_interval / delta_refresh_bits", "they refresh weight deltas' reconstructions, and "
         "without zeropp.weight_deltas the resident copy is rebuilt exactly after every step: leave them out, or "
         "turn weight deltas on"),
    )
    where = _label(point) if point else f"({size}, world, world)"
    return [f"{key}: not combined with zeropp.partition {where} in this build: {why}" for on, key, why in entries if on]


def point_refusals(config: Any, point: tuple[int, int, int], world: int, ranks_per_node: int) -> list[str]:
    """Why each option of ``config`` (a ``zeropp.config.Config`` at ``point``'s stage) that the engine does not
    combine with ``point`` ``(p, g, o)``, a point it runs at ``world`` ranks with ``ranks_per_node`` per node, is
    refused, one message each (empty: none): ``resident_refusals`` (and ``grouped_resident_refusals`` for a grouped
    resident point), ``mics_refusals`` or ``grouped_refusals`` by the point's kind, and weight deltas where the point
    keeps no hpZ secondary; with the parameters over whole nodes, ``spanning_refusals`` instead of
    ``grouped_resident_refusals``."""
    z = config.zero_optimization
    _, grads, shards = point
    resident = resident_size(point, world)
    grouped = shards < world or 1 < grads < shards
    if resident:
        refused = resident_refusals(config, resident, point if grouped else None)
        if resident > ranks_per_node:
            refused += spanning_refusals(config, point, ranks_per_node)
        elif grouped:
            refused += grouped_resident_refusals(config, point)
    else:
        refused = ([] if not grouped else mics_refusals(config, shards, ranks_per_node) if z.stage == 3
                   else grouped_refusals(config))
    if z.zeropp.weight_deltas and z.zero_hpz_partition_size <= 1 and not resident:  # "node" was the world: one node
        refused.append(f"zero_optimization.zeropp.weight_deltas: the partition {point} keeps no hpZ secondary on "
                       f"{world // ranks_per_node} node(s) of {ranks_per_node} ranks; give zero_hpz_partition_size, "
                       "parameters below the world, or weight_deltas false")
    return refused


def grouped_refusals(config: Any) -> list[str]:
    """Why each option of ``config`` (a ``zeropp.config.Config``) that the grouped stage-1/2 points ``(1, 1, k)``
    and ``(1, k, k)`` (``k`` below the world) and ``(1, g, o)`` (``1 < g < o``) do not combine with in this build is
    refused, one message each (empty: none). hpZ and weight deltas need stage 3, which the config refuses
    already."""
    z = config.zero_optimization
    w = "zero_optimization"
    return _refusals(config, (
        (z.zero_quantized_weights, f"{w}.zero_quantized_weights",
         "qwZ's gather of the stepped shards inside a group is not tested; the groups gather exactly"),
        (z.zero_quantized_gradients, f"{w}.zero_quantized_gradients",
         "qgZ would quantize the reduce-scatter inside the group while the cross-group reductions stay exact fp32; "
         "that split is not built"),
    ), f"a grouped stage-{z.stage} partition (zeropp.partition (1, 1, k) or (1, k, k), k below the world, or "
       f"(1, g, o) with 1 < g < o)")


def grouped_resident_refusals(config: Any, point: tuple[int, int, int]) -> list[str]:
    """Why each option of ``config`` (a ``zeropp.config.Config``) that a grouped resident point ``(p, g, o)``
    (``2 <= p < o``, with ``o`` below the world or ``g`` below ``o``: ``zeropp.engine.partition``) does not combine
    with in this build is refused, one message each (empty: none), on top of ``resident_refusals``. ``(p, k, k)``
    runs qwZ and qgZ as MiCS over ``k`` does (the resident copy's qwZ pack, MiCS's quantized reductions); with
    ``g < o`` the collectives are exact only."""
    z = config.zero_optimization
    w = "zero_optimization"
    split = point[1] < point[2]
    return _refusals(config, (
        (z.zero_quantized_weights and split, f"{w}.zero_quantized_weights",
         "qwZ's pack of the resident copy inside a shard group is not tested; the groups gather exactly"),
        (z.zero_quantized_gradients and split, f"{w}.zero_quantized_gradients",
         "qgZ would quantize the reduce-scatter inside the gradient group while the boundary's reductions across "
         "groups stay exact fp32; that split is not built"),
        (z.zeropp.weight_deltas, f"{w}.zeropp.weight_deltas",
         "the resident copy is rebuilt exactly after every step; weight deltas' quantized updates are built for "
         "(p, world, world) only"),
    ), f"zeropp.partition {_label(point)} (parameters resident over {point[0]} ranks, optimizer states over "
       f"{point[2]})")


def spanning_refusals(config: Any, point: tuple[int, int, int], ranks_per_node: int) -> list[str]:
    """Why each option of ``config`` (a ``zeropp.config.Config``) that a resident point ``(p, g, o)`` with the
    parameters over whole nodes (``p`` a multiple of ``ranks_per_node`` above it, ``p < o``: the resident copy's
    partition is ``p / d`` whole nodes, ``comm.Topology.partition_of``) does not combine with in this build is
    refused, one message each (empty: none), on top of ``resident_refusals``: these points run with exact
    collectives only."""
    z = config.zero_optimization
    w = "zero_optimization"
    entries = (
        (z.zero_quantized_weights, f"{w}.zero_quantized_weights",
         "qwZ's pack of a resident copy gathered across nodes is not tested; the gathers are exact"),
        (z.zero_quantized_gradients, f"{w}.zero_quantized_gradients",
         "qgZ's reduce-scatter beside a resident copy over whole nodes is not tested; the reductions are exact"),
        (z.zeropp.weight_deltas, f"{w}.zeropp.weight_deltas",
         "weight deltas' quantized updates are built for a copy inside a node; the copy over whole nodes is "
         "rebuilt exactly after every step"),
        (z.offload_optimizer.enabled, f"{w}.offload_optimizer",
         "the optimizer offload is not tested with a resident copy over whole nodes"),
        (config.optimizer is not None and config.optimizer.type == "OneBitAdam", "optimizer.type=OneBitAdam",
         "its compressed phase exchanges momenta over the whole world, not tested with a resident copy over whole "
         "nodes"),
    )
    where = (f"zeropp.partition {_label(point)} (parameters resident over {point[0]} ranks, "
             f"{point[0] // ranks_per_node} whole nodes of {ranks_per_node})")
    return [f"{key}: not combined with {where} in this build: {why}" for on, key, why in entries if on]
