"""zeropp.config.partition: ``zeropp.partition``, ``mics_shard_size`` and ``mics_hierarchical_params_gather``:
what parses, the point each resolves to, and every refusal (single process; the topology's part through
``ZeroConfig.partition_point``)."""

from __future__ import annotations

import pytest

from zeropp.config import Config, ConfigError, load_config, to_dict
from zeropp.config.partition import (
    PartitionConfig,
    engine_stage,
    grouped_resident_refusals,
    point_refusals,
    resident_refusals,
    resident_size,
    stage_point,
)
from zeropp.engine import auto_partition
from zeropp.plan import Cluster

BASE = {"train_micro_batch_size_per_gpu": 1}


def parse(world: int, **zero) -> Config:
    return load_config({**BASE, "zero_optimization": zero}, world_size=world)


def part(p, g, o) -> dict:
    return {"parameters": p, "gradients": g, "optimizer": o}


def err(world: int, **zero) -> str:
    with pytest.raises(ConfigError) as e:
        parse(world, **zero)
    return str(e.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world,d", [(1, 1), (4, 2), (8, 4), (8, 2)])
def test_the_stages_are_points_of_the_space(stage, world, d):
    """Without a partition each stage is its point; a partition equal to it, spelled with names or counts, parses."""
    point = stage_point(stage, world)
    assert parse(world, stage=stage).zero.partition_point(world, d) == point
    named = {1: "1", world: "world"}
    for spelled in (point, tuple(named.get(f, f) for f in point)):
        spelled = tuple(int(f) if f == "1" else f for f in spelled)
        c = parse(world, stage=stage, zeropp={"partition": part(*spelled)})
        assert c.zero.zeropp.partition == PartitionConfig(*spelled)
        assert c.zero.partition_point(world, d) == point
        assert Config.parse(to_dict(c), world) == c


def test_node_resolves_at_initialize():
    """``"node"`` is the ranks per node: stage 3 on a one-node world, MiCS over each node on two."""
    c = parse(4, stage=3, zeropp={"partition": part("node", "node", "node")})
    assert c.zero.partition_point(4, 4) == (4, 4, 4)
    assert c.zero.partition_point(4, 2) == (2, 2, 2)
    c = parse(4, stage=2, zeropp={"partition": part(1, "node", "node")})
    assert c.zero.partition_point(4, 2) == (1, 2, 2)
    assert c.zero.partition_point(4, 4) == (1, 4, 4)
    c = parse(4, stage=1, zeropp={"partition": part(1, "node", "node")})
    with pytest.raises(ConfigError, match=r"partition=\(1, 2, 2\) is not the point of zero_optimization.stage=1 "
                                          r"\(1, 1, 4\) nor its grouped point; it runs at stage 2"):
        c.zero.partition_point(4, 2)


@pytest.mark.parametrize("world,d,k", [(4, 2, 2), (8, 4, 4), (8, 4, 2), (8, 2, 2), (8, 2, 4), (16, 4, 8)])
def test_grouped_stage_points(world, d, k):
    """Stage 1 inside groups of ``k`` ranks is ``(1, 1, k)``, stage 2 ``(1, k, k)``; each names its stage."""
    for stage, point in ((1, (1, 1, k)), (2, (1, k, k))):
        c = parse(world, stage=stage, zeropp={"partition": part(*point)})
        assert c.zero.partition_point(world, d) == point
        assert Config.parse(to_dict(c), world) == c
        other = 3 - stage
        message = err(world, stage=other, zeropp={"partition": part(*point)})
        assert f"it runs at stage {stage}: set zero_optimization.stage to {stage}" in message, message


@pytest.mark.parametrize("world,d,g,o", [(4, 2, 2, 4), (8, 4, 4, 8), (8, 2, 2, 8), (8, 4, 2, 4), (8, 2, 2, 4),
                                         (16, 4, 4, 8)])
def test_split_points(world, d, g, o):
    """``(1, g, o)`` with ``1 < g < o`` runs at stage 2 (``o`` up to the world; ``"node"`` and ``"world"`` spelled
    too), and names stage 2 when given at another stage."""
    c = parse(world, stage=2, zeropp={"partition": part(1, g, o)})
    assert c.zero.partition_point(world, d) == (1, g, o)
    assert Config.parse(to_dict(c), world) == c
    if g == d and o == world:
        named = parse(world, stage=2, zeropp={"partition": part(1, "node", "world")})
        assert named.zero.partition_point(world, d) == (1, g, o)
    for stage in (1, 3):
        assert "it runs at stage 2" in err(world, stage=stage, zeropp={"partition": part(1, g, o)})


def test_grouped_refusals():
    """The options the grouped stage-1/2 points do not combine with are refused at initialize, each with why."""
    from zeropp.config.partition import grouped_refusals

    c = load_config({**BASE, "zero_optimization": {"stage": 2, "zero_quantized_weights": True,
                                                   "zero_quantized_gradients": True,
                                                   "offload_optimizer": {"device": "cpu"},
                                                   "zeropp": {"partition": part(1, 2, 2)}}}, world_size=4)
    onebit = load_config({**BASE, "optimizer": {"type": "OneBitAdam", "params": {}},
                          "zero_optimization": {"stage": 1, "zeropp": {"partition": part(1, 1, 2)}}}, world_size=4)
    refused = grouped_refusals(c) + grouped_refusals(onebit)
    for needle in ("zero_quantized_weights", "zero_quantized_gradients", "offload_optimizer", "OneBitAdam"):
        assert sum(needle in line for line in refused) == 1, (needle, refused)
    assert all("not combined with a grouped stage-" in line for line in refused)
    assert grouped_refusals(parse(4, stage=1, zeropp={"partition": part(1, 1, 2)})) == []
    split = load_config({**BASE, "zero_optimization": {"stage": 2, "zero_quantized_gradients": True,
                                                       "zeropp": {"partition": part(1, 2, 4)}}}, world_size=4)
    refused = grouped_refusals(split)
    assert len(refused) == 1 and "zero_quantized_gradients" in refused[0] and "(1, g, o)" in refused[0], refused


@pytest.mark.parametrize("world,d,k", [(4, 2, 2), (8, 4, 4), (8, 4, 2), (8, 2, 2), (8, 2, 4), (16, 4, 8)])
def test_mics_points(world, d, k):
    """MiCS over ``k`` ranks: ``mics_shard_size`` or the partition ``(k, k, k)`` at stage 3, node-aligned."""
    for zero in ({"stage": 3, "mics_shard_size": k}, {"stage": 3, "zeropp": {"partition": part(k, k, k)}},
                 {"stage": 3, "mics_shard_size": k, "zeropp": {"partition": part(k, k, k)}}):
        c = parse(world, **zero)
        assert c.zero.partition_point(world, d) == (k, k, k)
        assert Config.parse(to_dict(c), world) == c


def test_mics_refusals():
    """The options MiCS does not combine with are refused at initialize, each named with why."""
    from zeropp.config.partition import mics_refusals

    c = load_config({**BASE, "zero_optimization": {"stage": 3, "mics_shard_size": 2, "zero_quantized_weights": True,
                                                   "zero_quantized_gradients": True, "zero_hpz_partition_size": 2,
                                                   "offload_optimizer": {"device": "cpu"}}}, world_size=4)
    onebit = load_config({**BASE, "optimizer": {"type": "OneBitAdam", "params": {}},
                          "zero_optimization": {"stage": 3, "mics_shard_size": 2}}, world_size=4)
    refused = mics_refusals(c) + mics_refusals(onebit)
    assert not any("hpz" in line for line in mics_refusals(c, 4, 2))  # groups of whole nodes: hpZ inside each
    for needle in ("zero_hpz_partition_size", "offload_optimizer", "OneBitAdam"):
        assert sum(needle in line for line in refused) == 1, (needle, refused)
    assert not any("zero_quantized" in line for line in refused), refused  # qwZ and qgZ run under MiCS
    assert all("not combined with MiCS" in line for line in refused)
    assert mics_refusals(parse(4, stage=3, mics_shard_size=2)) == []


def test_mics_shard_size_of_the_world_is_stage_3():
    c = parse(4, stage=3, mics_shard_size=4, mics_hierarchical_params_gather=True)
    assert (c.zero.mics_shard_size, c.zero.mics_hierarchical_params_gather) == (4, True)
    assert c.zero.partition_point(4, 2) == (4, 4, 4)
    assert Config.parse(to_dict(c), 4) == c
    assert parse(4, stage=3, mics_shard_size=-1).zero.partition_point(4, 2) == (4, 4, 4)


@pytest.mark.parametrize(
    "world,zero,needles",
    [
        (4, {"stage": 3, "zeropp": {"partition": [4, 4, 4]}}, ["zeropp.partition must be an object", "[4, 4, 4]"]),
        (4, {"stage": 3, "zeropp": {"partition": {"parameters": 4, "gradients": 4}}},
         ['needs "optimizer"']),
        (4, {"stage": 3, "zeropp": {"partition": {**part(4, 4, 4), "optimiser": 4}}},
         ["partition.optimiser", "optimizer"]),
        (4, {"stage": 3, "zeropp": {"partition": part(4, 4, "rack")}},
         ["partition.optimizer='rack'", '"world", "node" or a positive rank count']),
        (4, {"stage": 3, "zeropp": {"partition": part(0, 4, 4)}}, ["partition.parameters=0"]),
        (4, {"stage": 3, "zeropp": {"partition": part(True, 4, 4)}}, ["partition.parameters=True"]),
        (4, {"stage": 3, "zeropp": {"partition": part(3, 4, 4)}}, ["partition.parameters=3", "divide", "(4 ranks)"]),
        (4, {"stage": 3, "zeropp": {"partition": part("world", 2, "world")}},
         ["partition=(4, 2, 4)", "at most the next and dividing it"]),
        (8, {"stage": 3, "zeropp": {"partition": part(2, 4, 2)}}, ["partition=(2, 4, 2)", "at most the next"]),
        (4, {"stage": 1, "zeropp": {"partition": part("world", "world", "world")}},
         ["partition=(4, 4, 4) is not the point of zero_optimization.stage=1 (1, 1, 4)", "runs at stage 3"]),
        (4, {"stage": 2, "zeropp": {"partition": part(1, 1, 4)}},
         ["partition=(1, 1, 4) is not the point of zero_optimization.stage=2 (1, 4, 4)", "runs at stage 1"]),
        (8, {"stage": 1, "zeropp": {"partition": part(1, 2, 8)}},
         ["partition=(1, 2, 8) is not the point of zero_optimization.stage=1 (1, 1, 8)", "runs at stage 2"]),
        (8, {"stage": 2, "zeropp": {"partition": part(2, 2, 8)}},
         ["partition=(2, 2, 8) is not the point of zero_optimization.stage=2", "it runs at stage 3"]),
        (8, {"stage": 2, "zeropp": {"partition": part(2, "world", "world")}},
         ["partition=(2, 8, 8) is not the point of zero_optimization.stage=2", "runs at stage 3"]),
        (8, {"stage": 3, "zeropp": {"weight_deltas": True}}, ["weight_deltas=true", "hpZ off",
                                                              '"parameters": "node"']),
        (4, {"stage": 2, "mics_shard_size": 2}, ["mics_shard_size=2", "stage-3 partition", "it is 2"]),
        (6, {"stage": 3, "mics_shard_size": 4}, ["mics_shard_size=4 must divide", "(6 ranks)"]),
        (4, {"stage": 3, "mics_shard_size": 0}, ["mics_shard_size=0 must be -1 (off"]),
        (4, {"stage": 3, "mics_shard_size": 1}, ["mics_shard_size=1 replicates everything", "plain data"]),
        (4, {"stage": 3, "zeropp": {"partition": part(1, 1, 1)}}, ["partition=(1, 1, 1) is not run",
                                                                    "plain data parallelism", "MiCS (k, k, k)",
                                                                    "(p, g, o) at stage 3 with 2 <= p < o"]),
        (4, {"stage": 3, "mics_shard_size": "2"}, ["mics_shard_size='2'"]),
        (4, {"stage": 3, "mics_hierarchical_params_gather": True},
         ["mics_hierarchical_params_gather=true", "needs zero_optimization.mics_shard_size"]),
        (4, {"stage": 3, "mics_shard_size": 4, "mics_hierarchical_params_gather": "yes"},
         ["mics_hierarchical_params_gather='yes'"]),
        (4, {"stage": 3, "mics_shard_size": 4, "zeropp": {"partition": part(4, 2, 4)}},
         ["partition=(4, 2, 4)", "at most the next"]),
        (4, {"stage": 3, "mics_shard_size": 2, "zeropp": {"partition": "auto"}},
         ['partition="auto" contradicts zero_optimization.mics_shard_size=2']),
        (4, {"stage": 3, "zeropp": {"partition": "Auto"}}, ["must be an object", "or \"auto\"", "got 'Auto'"]),
    ],
)
def test_errors(world, zero, needles):
    message = err(world, **zero)
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_auto_parses_and_waits_for_initialize(stage):
    """``"auto"`` at any stage round-trips and is resolved by ``zeropp.initialize``
    (tests/engine/test_partition.py); the point is refused until then."""
    c = parse(4, stage=stage, zeropp={"partition": "auto"})
    assert c.zero.zeropp.partition == "auto" and Config.parse(to_dict(c), 4) == c
    with pytest.raises(ConfigError, match="resolved by zeropp.initialize"):
        c.zero.partition_point(4, 2)


GROUPED_2X2 = {(1, 1, 2), (1, 2, 2), (1, 2, 4)}
"""The grouped stage-1/2 points of world 4 as 2 x 2 (exact collectives only, no offload)."""


@pytest.mark.parametrize("stage, zero, want, reason", [
    (3, {}, GROUPED_2X2 | {(1, 1, 4), (1, 4, 4), (4, 4, 4), (2, 2, 2), (2, 4, 4), (2, 2, 4)}, None),
    (2, {}, GROUPED_2X2 | {(1, 1, 4), (1, 4, 4)}, None),
    (1, {}, {(1, 1, 4), (1, 1, 2)}, None),
    (3, {"zero_quantized_gradients": True}, {(1, 1, 4), (1, 4, 4), (4, 4, 4), (2, 2, 2), (2, 4, 4)},
     "zero_quantized_gradients: not combined with a grouped stage-"),
    (3, {"zero_hpz_partition_size": 2}, {(4, 4, 4), (2, 4, 4), (2, 2, 4)},
     "zero_hpz_partition_size=2 applies to the stage-3"),
    (3, {"offload_param": {"device": "cpu"}}, {(4, 4, 4)},
     "offload_param: not combined with zeropp.partition (2, 2, 4) in this build"),
    (3, {"offload_optimizer": {"device": "cpu"}}, {(1, 1, 4), (1, 4, 4), (4, 4, 4), (2, 4, 4)},
     "offload_optimizer / offload_param / zeropp.memory_budget: not combined with MiCS"),
])
def test_auto_candidates_respect_each_points_refusals(stage, zero, want, reason):
    """``"auto"`` weighs the points the engine runs at the stage or below (world 4 as 2 x 2), each validated as the
    config given with that point by hand: the stage's own rules and each point's refusals leave points out, and
    say why."""
    config = parse(4, stage=stage, **zero, zeropp={"partition": "auto"})
    plans, left_out = auto_partition.candidates(config, 4, 2)
    got = {(p.partition.params, p.partition.grads, p.partition.optimizer) for p in plans}
    assert got == want, got
    assert len(left_out) == len(auto_partition.points(stage, 4, 2)) - len(want), left_out
    assert reason is None or any(reason in line for line in left_out), left_out
    if want:  # each candidate config is the one the user would write for its point, and initialize accepts it
        for plan in plans:
            part = plan.partition
            moved = auto_partition.at_point(config, (part.params, part.grads, part.optimizer), 2)
            assert moved.zero.stage <= stage


def test_auto_memory_limit_is_the_budget_when_lower():
    """``zeropp.memory_budget.device`` lowers the planner's memory per rank; without it, the cluster's."""
    cluster = Cluster.default(2, 2)
    plain = parse(4, stage=3, zeropp={"partition": "auto"})
    assert auto_partition.memory_limit(plain, cluster) == cluster
    budget = parse(4, stage=3, offload_optimizer={"device": "cpu"},
                   zeropp={"partition": "auto", "memory_budget": {"device": 2**30}})
    assert auto_partition.memory_limit(budget, cluster).memory == 2**30
    roomy = parse(4, stage=3, offload_optimizer={"device": "cpu"},
                  zeropp={"partition": "auto", "memory_budget": {"device": 2**40}})
    assert auto_partition.memory_limit(roomy, cluster) == cluster


def test_partition_contradicting_mics_shard_size():
    c = parse(4, stage=3, mics_shard_size=4)
    assert c.zero.partition_point(4, 4) == (4, 4, 4)
    message = err(4, stage=3, mics_shard_size=4, zeropp={"partition": part(2, 2, 2)})
    assert "partition=(2, 2, 2) contradicts zero_optimization.mics_shard_size=4" in message


@pytest.mark.parametrize(
    "world,d,zero,needles",
    [
        # node alignment needs the ranks per node: known at initialize
        (8, 4, {"stage": 3, "mics_shard_size": 8, "zeropp": {"partition": part(8, 8, 8)}}, None),
        (12, 4, {"stage": 3, "mics_shard_size": 6}, ["mics_shard_size=6 must divide the ranks per node (4) or be "
                                                     "a multiple of it"]),
        (12, 4, {"stage": 3, "zeropp": {"partition": part(6, 6, 6)}},
         ["partition.parameters=6 must divide the ranks per node (4)", "partition.optimizer=6"]),
        (12, 4, {"stage": 1, "zeropp": {"partition": part(1, "node", 12)}},
         ["partition=(1, 4, 12) is not the point of zero_optimization.stage=1", "it runs at stage 2"]),
    ],
)
def test_topology_checks(world, d, zero, needles):
    c = parse(world, **zero)
    if needles is None:
        assert c.zero.partition_point(world, d) == (world,) * 3
        return
    with pytest.raises(ConfigError) as e:
        c.zero.partition_point(world, d)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("world,d,p,want", [(4, 2, "node", 2), (8, 4, "node", 4), (8, 4, 2, 2), (8, 2, "node", 2),
                                            (16, 8, 4, 4)])
def test_resident_point(world, d, p, want):
    """``(p, W, W)`` at stage 3 with ``p`` dividing the ranks per node is the resident point (``engine_stage`` 3);
    with weight deltas it needs no ``zero_hpz_partition_size``; ``"node"`` on one node is ZeRO-3."""
    c = parse(world, stage=3, zeropp={"partition": part(p, "world", "world"), "weight_deltas": True})
    point = c.zero.partition_point(world, d)
    assert point == (want, world, world) and resident_size(point, world) == want
    assert c.zero.partition_point(world, world) == (world,) * 3 if p == "node" else True
    assert resident_size(stage_point(3, world), world) is None and resident_size((1, world, world), world) is None


def test_resident_point_refusals():
    """Parameters over whole nodes run (``(4, 8, 8)`` on nodes of 2) with exact collectives: ``point_refusals``
    names qwZ, qgZ, weight deltas, the optimizer offload and OneBitAdam there (``spanning_refusals``), each once,
    and nothing without them; ``resident_refusals`` names another hpZ size and the parameter offload tiers, and
    accepts the same hpZ size."""
    c = parse(8, stage=3, zeropp={"partition": part(4, "world", "world")})
    assert c.zero.partition_point(8, 2) == (4, 8, 8) and point_refusals(c, (4, 8, 8), 8, 2) == []
    lossy = load_config({**BASE, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
        "offload_optimizer": {"device": "cpu"}, "zeropp": {"partition": part(4, 4, 8), "weight_deltas": True}}},
        world_size=8)
    onebit = load_config({**BASE, "optimizer": {"type": "OneBitAdam", "params": {}},
                          "zero_optimization": {"stage": 3, "zeropp": {"partition": part(4, 4, 8)}}}, world_size=8)
    refused = point_refusals(lossy, (4, 4, 8), 8, 2) + point_refusals(onebit, (4, 4, 8), 8, 2)
    for needle in ("zero_quantized_weights", "zero_quantized_gradients", "weight_deltas", "offload_optimizer",
                   "OneBitAdam"):
        assert sum(needle in line for line in refused) == 1, (needle, refused)
    assert all("zeropp.partition (4, 4, 8) (parameters resident over 4 ranks, 2 whole nodes of 2)" in line
               for line in refused), refused
    assert point_refusals(lossy, (4, 4, 8), 8, 4) != refused  # inside a node of 4: grouped_resident_refusals
    resident = {"partition": part("node", "world", "world")}
    assert resident_refusals(parse(8, stage=3, zero_hpz_partition_size=4, zeropp=resident), 4) == []
    refused = resident_refusals(parse(8, stage=3, zero_hpz_partition_size=2, offload_param={"device": "cpu"},
                                      zeropp=resident), 4)
    assert len(refused) == 2, refused
    assert "zero_hpz_partition_size=2: not combined with zeropp.partition (4, world, world)" in refused[0]
    assert "set it to 4" in refused[0] and "offload_param" in refused[1]
    refused = resident_refusals(parse(8, stage=3, zeropp={**resident, "delta_refresh_interval": 1}), 4)
    assert len(refused) == 1 and "delta_refresh_interval / delta_refresh_bits" in refused[0], refused
    assert resident_refusals(parse(8, stage=3, zero_hpz_partition_size=4, zeropp={
        **resident, "weight_deltas": True, "delta_refresh_interval": 1}), 4) == []


@pytest.mark.parametrize("world,d,point", [(4, 2, (2, 2, 4)), (8, 4, (4, 4, 8)), (8, 4, (2, 4, 8)), (8, 4, (2, 4, 4)),
                                           (8, 4, (2, 2, 4)), (8, 2, (2, 2, 8)), (8, 2, (2, 4, 4)),
                                           (8, 2, (2, 4, 8)), (16, 8, (4, 8, 16))])
def test_grouped_resident_points(world, d, point):
    """``(p, g, o)`` with ``2 <= p < o`` (``o`` below the world or ``g`` below ``o``) runs at stage 3 as a resident
    point, its parameters inside a node or over whole nodes, and names stage 3 at another stage."""
    p = point[0]
    c = parse(world, stage=3, zeropp={"partition": part(*point)})
    assert c.zero.partition_point(world, d) == point and Config.parse(to_dict(c), world) == c
    assert engine_stage(point, world) == 3 and resident_size(point, world) == p
    assert "it runs at stage 3: set zero_optimization.stage to 3" in err(world, stage=2,
                                                                        zeropp={"partition": part(*point)})
    assert c.zero.partition_point(world, p // 2) == point  # the parameters over two whole nodes


def test_grouped_resident_refusals():
    """``grouped_resident_refusals`` names qwZ and qgZ (with gradients below the optimizer states), weight deltas,
    the offload tiers and OneBitAdam, each once; ``(p, k, k)`` takes qwZ and qgZ."""
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "offload_optimizer": {"device": "cpu"}, "zeropp": {"partition": part(2, 2, 4), "weight_deltas": True}}
    onebit = load_config({**BASE, "optimizer": {"type": "OneBitAdam", "params": {}},
                          "zero_optimization": {"stage": 3, "zeropp": {"partition": part(2, 4, 4)}}}, world_size=8)
    refused = (grouped_resident_refusals(load_config({**BASE, "zero_optimization": zero}, world_size=4), (2, 2, 4))
               + grouped_resident_refusals(onebit, (2, 4, 4)))
    for needle in ("zero_quantized_weights", "zero_quantized_gradients", "weight_deltas", "offload_optimizer",
                   "OneBitAdam"):
        assert sum(needle in line for line in refused) == 1, (needle, refused)
    assert all("not combined with zeropp.partition (2, " in line for line in refused), refused
    assert grouped_resident_refusals(parse(4, stage=3, zeropp={"partition": part(2, 2, 4)}), (2, 2, 4)) == []
    assert grouped_resident_refusals(parse(8, stage=3, zero_quantized_weights=True, zero_quantized_gradients=True,
                                           zeropp={"partition": part(2, 4, 4)}), (2, 4, 4)) == []
