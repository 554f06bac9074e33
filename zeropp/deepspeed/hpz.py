"""hpZ's groups for DeepSpeed: made from zeropp's node layout, and forgotten when the engine is destroyed.

DeepSpeed 0.19.8 keeps one hpZ group per process, in the module global
``deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``, made by ``groups._create_zero_param_parallel_group(
zero_hpz_partition_size)`` (which ``zero.Init`` and the stage-3 optimizer call through the ``groups`` module when
the global is unset) and read by every later stage-3 engine whatever its config says. Two defects, fixed here:

* Layout: DeepSpeed cuts the world into runs of consecutive global ranks, so on a cluster whose nodes do not hold
  consecutive ranks the "in-node" backward gathers cross nodes. ``create_zero_param_parallel_group`` makes the
  group from the ``zeropp.comm.Topology`` of DeepSpeed's world group (the group ``zero.Init`` partitions over, the
  topology zeropp's qwZ and qgZ use too): the partition of ``size`` consecutive ranks of this rank's node
  (``Topology.partition_group``), whatever the global numbering. A size that does not divide the ranks per node
  would put a secondary partition across nodes: refused, naming the sizes that fit.
* Leak: ``DeepSpeedEngine.destroy()`` leaves the global set, so the next stage-3 engine of the process runs hpZ
  over the old group (or over a group of the wrong size) even when its config has no hpZ. ``destroy_wrapper``
  makes ``destroy()`` forget it. An engine that is never destroyed still hands it on, as in DeepSpeed: destroy an
  engine (``accelerator.free_memory()`` does, for the Trainer) before building another in the same process.

The secondary partitions themselves stay DeepSpeed's: ``zero.Init`` slices each parameter by this rank's index in
the group (``dist.get_rank(group)``), which holds for any set of ranks.
"""

from __future__ import annotations

from typing import Any

from .topology import topology_for


def create_zero_param_parallel_group(group_size: int) -> None:
    """Set DeepSpeed's hpZ group (``groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``) to the partition of ``group_size``
    ranks of this rank's node (capped at the world size, as DeepSpeed caps it). A collective over the world the
    first time the world's topology is made; creating the group is one over the partition's ranks.

    Raises:
        ValueError: ``group_size`` does not divide the ranks per node (the partition would span nodes).
        AssertionError: the global already holds another group (as DeepSpeed's own function asserts).
    """
    from deepspeed import comm as ds_dist
    from deepspeed.utils import groups

    topology = topology_for(ds_dist.get_world_group())
    size = min(group_size, topology.world_size)
    d = topology.ranks_per_node
    if d % size:
        raise ValueError(
            f"zero_hpz_partition_size={group_size} does not divide the ranks per node ({d}, zeropp's node layout "
            f"{topology.nodes}), so a secondary partition would span nodes and hpZ's backward gathers would cross "
            f"them; use one of {[s for s in range(2, d + 1) if d % s == 0] or 'none (one rank per node)'}, or set "
            "$ZEROPP_RANKS_PER_NODE to the real ranks per node"
        )
    group = topology.partition_group(size)
    current = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    assert current is None or current is group, "ZeRO parameter intra parallel group is already initialized"
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group


def destroy_wrapper(original: Any) -> Any:
    """``DeepSpeedEngine.destroy`` that, after DeepSpeed's, forgets the process's hpZ group."""

    def destroy(self: Any) -> None:
        from deepspeed.utils import groups

        try:
            original(self)
        finally:
            groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None

    destroy.__wrapped__ = original  # type: ignore[attr-defined]
    return destroy
