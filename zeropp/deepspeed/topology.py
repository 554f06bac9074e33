"""The ``zeropp.comm.Topology`` of each DeepSpeed partition group, made once per group while installed.

DeepSpeed partitions a parameter over ``param.ds_process_group`` (its data-parallel group unless the parameter
names another). zeropp's collectives need that group's node layout; creating it is a collective over the group,
so it is made at a point every member reaches in the same order: DeepSpeed converting a parameter of that group
(``patches._convert_to_deepspeed_param``) or, for the world group, DeepSpeed creating its hpZ group
(``hpz.create_zero_param_parallel_group``), which comes first. ``forget()`` (at ``uninstall``) drops the cache; the groups themselves
are DeepSpeed's and torch's.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from ..comm import Topology

_topologies: dict[ProcessGroup, Topology] = {}


def topology_for(group: ProcessGroup) -> Topology:
    """The topology of ``group`` (a collective over ``group`` the first time it is asked for)."""
    if group not in _topologies:
        _topologies[group] = Topology(group=group)
    return _topologies[group]


def forget() -> None:
    """Drop every cached topology (engines created afterwards make new ones)."""
    _topologies.clear()
