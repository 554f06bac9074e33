"""``zero_optimization.zeropp.partition: "auto"``: the planner (``zeropp.plan``) picks the partition, and so the
stage, for this model, world, memory limit and options; ``zeropp.initialize`` applies it (``resolve``) before
anything reads the partition.

What the planner is told:

* the model (``model_spec``): the engine's units (``plan_units`` with the engine's unit policy: the root unit first,
  each with its trainable parameters' element counts, so the bytes are the engine's), its layers (the units after
  the root), hidden size and vocabulary (the first ``nn.Embedding``'s dimensions; without one, the hidden size
  ``h`` of a GPT block of ``12 h^2`` parameters), its context (``model.config``'s ``block_size``, ``n_positions`` or
  ``max_position_embeddings``, else ``DEFAULT_SEQ``);
* the cluster: the topology's nodes and ranks per node, with the rates and memory per rank of
  ``$ZEROPP_PLAN_CLUSTER`` (a JSON file of ``zeropp.plan.Cluster`` fields, e.g. written by ``python -m zeropp.plan
  --calibrate``; its nodes and ranks per node must be the topology's) or else ``Cluster.default``'s (the planner's
  command-line defaults: 80 GiB per rank); ``zeropp.memory_budget.device``, when given, lowers the memory limit to
  that many bytes (``memory_limit``);
* the batch: the config's micro-batch and accumulation steps and its compute dtype, at the model's context.

The candidates (``candidates``) are the points the engine runs (``zeropp.config.partition.engine_stage``) at the
config's stage or below: the stage is a ceiling. DeepSpeed's stage 3 makes the parameters partitioned tensors that
user code reads through ``gathered_parameters``, a change of what the model's code sees, while going down a stage
changes nothing it sees; so ``"auto"`` never raises the stage, and stage 3 (what DeepSpeed users write for large
models) weighs every point: stages 1-3, ``(1, 1, k)``, ``(1, k, k)``, ``(1, g, o)``, MiCS ``(k, k, k)`` and the
resident points ``(p, W, W)``. Memory is kept by the limit, not by the stage: a point that does not fit in it is not
picked. Each candidate is the user's config at the point's stage and partition, validated as a config given so
would be (``Config.parse``: the stage's own rules, e.g. ``offload_param`` and hpZ need stage 3;
``partition_point``; ``point_refusals``); the points it refuses are left out. Each is a ``zeropp.plan.Plan`` with
the user's options (qwZ and qgZ bits, hpZ, weight deltas, the optimizer's offload tier); the planner predicts the
ones it also runs (``Plan.unsupported``) and orders them as ``zeropp.plan.rank`` does (fitting in memory first, then
step time); the first wins, and is refused (``ConfigError``) when it does not fit in the limit. Its stage and
partition are applied; the bits and everything else stay the user's. The first rank of the topology decides and
broadcasts the choice, and prints it once with the planner's reason (``zeropp.plan.why``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch.distributed as dist
from torch import nn

from .. import comm
from ..config import Config, ConfigError
from ..config.load import to_dict
from ..config.partition import (AUTO, PARTITION_KEYS, PartitionConfig, engine_stage, point_refusals, resident_size,
                                stage_point)
from ..plan import Batch, Cluster, ModelSpec, Partition, Plan, Prediction, UnitSpec, partitions, predict, why
from ..plan.search import ordered
from .engine import compute_dtype
from .policy import UnitPolicy, plan_units

ENV_CLUSTER = "ZEROPP_PLAN_CLUSTER"
"""A JSON file of ``zeropp.plan.Cluster`` fields with this cluster's rates and memory per rank (``python -m
zeropp.plan --calibrate``)."""

_WHERE = "zero_optimization.zeropp.partition"

DEFAULT_SEQ = 2048
"""The context assumed for a model whose ``config`` names none."""


def model_spec(module: nn.Module, unit_policy: UnitPolicy | None = None) -> ModelSpec:
    """``module`` as the planner sees it (module docstring)."""
    units = tuple(UnitSpec(plan.name, tuple(p.numel() for _, p in plan.params))
                  for plan in plan_units(module, unit_policy))
    layers = max(1, len(units) - 1)
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        hidden, vocab = embedding.embedding_dim, embedding.num_embeddings
    else:
        hidden = max(1, math.isqrt(sum(u.numel for u in units[1:]) // (12 * layers)))
        vocab = 1
    config = getattr(module, "config", None)
    seq = next((getattr(config, key) for key in ("block_size", "n_positions", "max_position_embeddings")
                if isinstance(getattr(config, key, None), int)), DEFAULT_SEQ)
    return ModelSpec(type(module).__name__, units, layers, hidden, seq, vocab, 4 * hidden)


def cluster_for(topology: comm.Topology) -> Cluster:
    """The cluster of ``topology``: ``$ZEROPP_PLAN_CLUSTER``'s rates, else ``Cluster.default``'s.

    Raises:
        ConfigError: the file cannot be read, or describes another shape than the topology's.
    """
    nodes, d = topology.num_nodes, topology.ranks_per_node
    path = os.environ.get(ENV_CLUSTER)
    if not path:
        return Cluster.default(nodes, d)
    try:
        cluster = Cluster.from_json(path)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"${ENV_CLUSTER}={path!r}: {e}") from None
    if (cluster.nodes, cluster.ranks_per_node) != (nodes, d):
        raise ConfigError(f"${ENV_CLUSTER}={path!r} describes {cluster.nodes} node(s) x {cluster.ranks_per_node} "
                          f"rank(s), but this job runs on {nodes} x {d}: calibrate on this layout or unset it")
    return cluster


def memory_limit(config: Config, cluster: Cluster) -> Cluster:
    """``cluster`` with its memory per rank lowered to ``zeropp.memory_budget.device`` bytes when the config gives
    one (the budget bounds the ZeRO states on the device; the planner's total, activations included, is held to
    it)."""
    budget = config.zero_optimization.zeropp.memory_budget
    if budget is None or budget.device is None or budget.device >= cluster.memory:
        return cluster
    return dataclasses.replace(cluster, memory=float(budget.device))


def points(stage: int, world: int, ranks_per_node: int) -> list[tuple[int, int, int]]:
    """Every partition ``(p, g, o)`` of the space (``zeropp.plan.space.partitions``) the engine runs at ``stage`` or
    below, at ``world`` ranks with ``ranks_per_node`` per node."""
    out = []
    for part in partitions(world, ranks_per_node):
        point = (part.params, part.grads, part.optimizer)
        runs_at = engine_stage(point, world)
        if runs_at is not None and runs_at <= stage:
            out.append(point)
    return out


def at_point(config: Config, point: tuple[int, int, int], ranks_per_node: int) -> Config:
    """``config`` at ``point``'s stage with ``point`` as its partition, validated as that config given by hand.

    Raises:
        ConfigError: naming each option the point's stage or the point refuses.
    """
    world = config.world_size
    data = to_dict(config)
    data["zero_optimization"]["stage"] = engine_stage(point, world)
    data["zero_optimization"]["zeropp"]["partition"] = dict(zip(PARTITION_KEYS, point))
    moved = Config.parse(data, world)
    moved.zero_optimization.partition_point(world, ranks_per_node)  # the checks that need the ranks per node
    refused = point_refusals(moved, point, world, ranks_per_node)
    if refused:
        raise ConfigError("; ".join(refused))
    return moved


def candidates(config: Config, world: int, ranks_per_node: int) -> tuple[list[Plan], list[str]]:
    """The plans ``"auto"`` weighs (module docstring), each with the user's options, and why each other point at the
    stage or below is left out (``"(p, g, o): reason"``)."""
    z = config.zero_optimization
    tier = z.offload_optimizer.device if z.offload_optimizer.enabled else "none"
    options: dict[str, Any] = {"weight_bits": z.weight_bits, "gradient_bits": z.gradient_bits,
                               "gradient_bits_intra": z.gradient_bits_intra, "hpz": z.zero_hpz_partition_size,
                               "weight_deltas": z.zeropp.weight_deltas, "offload": tier}
    plans, left_out = [], []
    for point in points(z.stage, world, ranks_per_node):
        try:
            at_point(config, point, ranks_per_node)
        except ConfigError as e:
            left_out.append(f"{point}: {e}")
            continue
        plan = Plan(Partition(*point), **options)
        why_not = plan.unsupported(world, ranks_per_node)
        if why_not is None:
            plans.append(plan)
        else:
            left_out.append(f"{point}: {why_not}")
    return plans, left_out


def choose(config: Config, spec: ModelSpec, cluster: Cluster) -> list[Prediction]:
    """The candidates, predicted on ``cluster`` at its memory limit (``memory_limit``) and in the planner's order
    (the first is the choice when it fits)."""
    cluster = memory_limit(config, cluster)
    batch = Batch(config.train_micro_batch_size_per_gpu, spec.seq, config.gradient_accumulation_steps,
                  compute_dtype(config).itemsize)
    plans, _ = candidates(config, cluster.world, cluster.ranks_per_node)
    return ordered([predict(spec, plan, cluster, batch) for plan in plans])


def _name(point: tuple[int, int, int], world: int) -> str:
    """What ``point`` is, in words."""
    p, g, o = point
    stage = engine_stage(point, world)
    if point == stage_point(stage, world):
        return f"ZeRO-{stage}"
    if resident_size(point, world):
        return f"the resident point, ZeRO-3 with the parameters kept over {p} ranks"
    if p == o:
        return f"MiCS over groups of {p} ranks"
    if g == o or g == 1:
        return f"ZeRO-{stage} inside groups of {o} ranks"
    return f"ZeRO-2 with the gradients over groups of {g} ranks and the optimizer states over {o}"


def _pick(config: Config, module: nn.Module, topology: comm.Topology,
          unit_policy: UnitPolicy | None) -> tuple[tuple[int, int, int], str]:
    """The planner's partition ``(p, g, o)`` and its reason.

    Raises:
        ConfigError: no point at the stage or below runs with these options, or none fits in the memory limit.
    """
    world, d = topology.world_size, topology.ranks_per_node
    cluster = cluster_for(topology)
    ranked = choose(config, model_spec(module, unit_policy), cluster)
    stage = config.zero_optimization.stage
    if not ranked:
        _, left_out = candidates(config, world, d)
        raise ConfigError(f"{_WHERE}=\"auto\": the engine runs none of the points at stage {stage} or below with "
                          f"these options ({'; '.join(left_out)}); give the partition")
    if not ranked[0].fits:
        least = min(ranked, key=lambda p: p.memory_total)
        limit = memory_limit(config, cluster).memory
        raise ConfigError(f"{_WHERE}=\"auto\": no point at stage {stage} or below fits in {limit / 2**30:.3g} GiB "
                          f"per rank (the least, {least.label}, needs {least.memory_total / 2**30:.3g} GiB as the "
                          f"planner counts it); give the partition to run one anyway, raise the memory in "
                          f"${ENV_CLUSTER} or zeropp.memory_budget.device, or shrink the micro-batch")
    part = ranked[0].plan.partition
    return (part.params, part.grads, part.optimizer), why(ranked)


def resolve(config: Config, module: nn.Module, topology: comm.Topology,
            unit_policy: UnitPolicy | None = None) -> Config:
    """``config`` with an ``"auto"`` partition replaced by the planner's choice and the stage by that point's
    (module docstring); any other config unchanged. A collective over ``topology``'s group when it resolves.

    Raises:
        ConfigError: on every rank, when the first rank finds no point to pick (``_pick``).
    """
    z = config.zero_optimization
    if z.zeropp.partition != AUTO:
        return config
    world = topology.world_size
    picked: list[Any] = [stage_point(z.stage, world), "one rank: nothing to shard", None]
    if topology.rank == 0 and world > 1:
        try:
            picked = [*_pick(config, module, topology, unit_policy), None]
        except ConfigError as e:  # raised on every rank below, not only here
            picked = [None, "", str(e)]
    if world > 1:
        dist.broadcast_object_list(picked, src=topology.ranks[0], group=topology.group)
    point, reason, error = picked
    if error is not None:
        raise ConfigError(error)
    stage = engine_stage(point, world) if world > 1 else z.stage
    if topology.rank == 0:
        print(f"zeropp: {_WHERE}=\"auto\" -> stage {stage}, {tuple(point)} as (parameters, gradients, optimizer): "
              f"{_name(point, world) if world > 1 else f'ZeRO-{stage}'}. {reason}", flush=True)
    partition = PartitionConfig(*point)
    return dataclasses.replace(config, zero_optimization=dataclasses.replace(
        z, stage=stage, zeropp=dataclasses.replace(z.zeropp, partition=partition)))
