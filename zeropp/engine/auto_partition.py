"""``zero_optimization.zeropp.partition: "auto"``: the planner (``zeropp.plan``) picks the stage-3 partition for this
model, world and options; ``zeropp.initialize`` applies it (``resolve``) before anything reads the partition.

What the planner is told:

* the model (``model_spec``): the engine's units (``plan_units`` with the engine's unit policy: the root unit first,
  each with its trainable parameters' element counts, so the bytes are the engine's), its layers (the units after
  the root), hidden size and vocabulary (the first ``nn.Embedding``'s dimensions; without one, the hidden size
  ``h`` of a GPT block of ``12 h^2`` parameters), its context (``model.config``'s ``block_size``, ``n_positions`` or
  ``max_position_embeddings``, else ``DEFAULT_SEQ``);
* the cluster: the topology's nodes and ranks per node, with the rates of ``$ZEROPP_PLAN_CLUSTER`` (a JSON file of
  ``zeropp.plan.Cluster`` fields, e.g. written by ``python -m zeropp.plan --calibrate``; its nodes and ranks per
  node must be the topology's) or else ``Cluster.default``'s (the planner's command-line defaults);
* the batch: the config's micro-batch and accumulation steps and its compute dtype, at the model's context.

The candidates are ZeRO-3 ``(W, W, W)``, MiCS ``(k, k, k)`` for every node-aligned ``k`` from 2 below ``W``
(``zeropp.plan.space.shard_factors``) and the resident point ``(p, W, W)`` for every ``p`` from 2 dividing the ranks
per node (ZeRO-3 bit for bit, its parameters kept over ``p`` ranks of a node), each a ``zeropp.plan.Plan`` with the
user's options (qwZ and qgZ bits, hpZ, weight deltas, the optimizer's offload tier); a MiCS or resident point is left
out when the options are ones it does not combine with (``mics_refusals``, ``resident_refusals``). The planner
predicts each one the engine runs today (``Plan.unsupported``) and orders them as ``zeropp.plan.rank`` does (fitting
in memory first, then step time); the first wins. Only its partition is applied: the stage, bits and everything else
stay the user's. The first rank of the topology decides and broadcasts the choice, and prints it once with the
planner's reason (``zeropp.plan.why``).
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
from ..config.partition import AUTO, PartitionConfig, mics_refusals, resident_refusals
from ..plan import Batch, Cluster, ModelSpec, Partition, Plan, Prediction, UnitSpec, predict, why
from ..plan.search import ordered
from ..plan.space import shard_factors
from .engine import compute_dtype
from .policy import UnitPolicy, plan_units

ENV_CLUSTER = "ZEROPP_PLAN_CLUSTER"
"""A JSON file of ``zeropp.plan.Cluster`` fields with this cluster's rates (``python -m zeropp.plan --calibrate``)."""

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


def candidates(config: Config, world: int, ranks_per_node: int) -> list[Plan]:
    """ZeRO-3 and (unless the options refuse them) every MiCS and resident point, each with the user's options."""
    z = config.zero_optimization
    tier = z.offload_optimizer.device if z.offload_optimizer.enabled else "none"
    options: dict[str, Any] = {"weight_bits": z.weight_bits, "gradient_bits": z.gradient_bits,
                               "gradient_bits_intra": z.gradient_bits_intra, "hpz": z.zero_hpz_partition_size,
                               "weight_deltas": z.zeropp.weight_deltas, "offload": tier}
    factors = [k for k in shard_factors(world, ranks_per_node) if 2 <= k < world]
    mics = [Partition(k, k, k) for k in factors if not mics_refusals(config, k, ranks_per_node)]
    resident = [Partition(p, world, world) for p in factors
                if ranks_per_node % p == 0 and not resident_refusals(config, p)]
    return [Plan(part, **options) for part in [Partition(world, world, world), *mics, *resident]]


def choose(config: Config, spec: ModelSpec, cluster: Cluster) -> list[Prediction]:
    """The runnable candidates, predicted and in the planner's order (the first is the choice)."""
    world, d = cluster.world, cluster.ranks_per_node
    batch = Batch(config.train_micro_batch_size_per_gpu, spec.seq, config.gradient_accumulation_steps,
                  compute_dtype(config).itemsize)
    return ordered([predict(spec, plan, cluster, batch) for plan in candidates(config, world, d)
                    if plan.unsupported(world, d) is None])


def _pick(config: Config, module: nn.Module, topology: comm.Topology,
          unit_policy: UnitPolicy | None) -> tuple[tuple[int, int, int], str]:
    """The planner's partition ``(p, g, o)`` and its reason."""
    world, d = topology.world_size, topology.ranks_per_node
    ranked = choose(config, model_spec(module, unit_policy), cluster_for(topology))
    if not ranked:
        why_not = "; ".join(f"{p.label(world, d)}: {p.unsupported(world, d)}" for p in candidates(config, world, d))
        raise ConfigError(f"{_WHERE}=\"auto\": the planner runs none of ZeRO-3, MiCS and the resident points "
                          f"with these options ({why_not}); give the partition")
    part = ranked[0].plan.partition
    return (part.params, part.grads, part.optimizer), why(ranked)


def resolve(config: Config, module: nn.Module, topology: comm.Topology,
            unit_policy: UnitPolicy | None = None) -> Config:
    """``config`` with an ``"auto"`` partition replaced by the planner's choice (module docstring); any other
    config unchanged. A collective over ``topology``'s group when it resolves."""
    z = config.zero_optimization
    if z.zeropp.partition != AUTO:
        return config
    world = topology.world_size
    picked: list[Any] = [(world,) * 3, "one rank: nothing to shard", None]
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
    p, g, o = point
    if topology.rank == 0:
        name = ("ZeRO-3" if p == world else f"MiCS over groups of {p} ranks" if p == o else
                f"the resident point, ZeRO-3 with the parameters kept over {p} ranks of a node")
        print(f"zeropp: {_WHERE}=\"auto\" -> ({p}, {g}, {o}) as (parameters, gradients, "
              f"optimizer): {name}. {reason}", flush=True)
    partition = PartitionConfig(p, g, o)
    return dataclasses.replace(config, zero_optimization=dataclasses.replace(
        z, zeropp=dataclasses.replace(z.zeropp, partition=partition)))
