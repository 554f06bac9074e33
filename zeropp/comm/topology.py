"""``Topology``: which ranks of a data-parallel group share a node, and the process groups that follow from it.

A data-parallel (DP) group of ``P`` ranks is cut into ``n = P / d`` nodes of ``d`` ranks ("ranks per node").
Nodes are formed from the real host names (gathered once, at creation): the DP ranks on each host, in rank order,
are cut into runs of ``d``. On a real cluster with ``d`` = ranks per host that is one node per host, whatever the
global rank numbering (nothing assumes node-contiguous global ranks); on one machine a smaller ``d`` emulates
several nodes (``ZEROPP_RANKS_PER_NODE=2`` on a 4-process machine gives 2 nodes of 2).

Within a node, ranks are ordered by global rank; a rank's position is its *local index*. The groups:

* ``intra_group``: the ranks of this rank's node (hop 1 of qgZ, hpZ all-gathers);
* ``inter_group``: the ranks with this rank's local index on every node (hop 2 of qgZ);
* ``partition_group(s)``: runs of ``s`` consecutive local indices inside a node, for hpZ partitions of any size
  ``s`` dividing ``d`` (DeepSpeed's ``zero_hpz_partition_size``), or of ``s / d`` whole consecutive nodes for ``s`` a
  multiple of ``d`` (the resident points' parameter copy over whole nodes);
* ``subgroup(ranks)``: any set of the group's ranks (FSDP2's hpZ groups, for ``zeropp.fsdp``).

Every group a topology creates waits ``timeout`` for the other ranks (default: the default process group's
timeout, i.e. ``init_process_group``'s) before its collectives fail with ``CollectiveError``.

torch.distributed orders the ranks of every group by global rank; the collectives rely on that.

Clean exit: gloo's worker threads release a finished work's tensors after ``wait()`` has returned, and releasing a
tensor that Python also references takes the GIL; a worker doing so once the interpreter has begun to finalize
kills itself mid-destructor and the process aborts ("terminate called without an active exception"). So at exit
(``atexit``) zeropp drops its references to every group and destroys the process groups if the program has not:
destroying a group joins its threads, which finish their work with the GIL free. A group the program itself still
references at exit is not destroyed.
"""

from __future__ import annotations

import atexit
import os
import socket
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .._torch_internals import group_timeout

ENV_RANKS_PER_NODE = "ZEROPP_RANKS_PER_NODE"


def _parse_count(value: object, source: str) -> int:
    try:
        count = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"ranks_per_node={value!r} (from {source}) is not an integer") from None
    if isinstance(value, bool) or count < 1 or (isinstance(value, float) and value != count):
        raise ValueError(f"ranks_per_node={value!r} (from {source}) must be a positive integer")
    return count


class Topology:
    """The node layout of a data-parallel group and its cached intra-node, inter-node and hpZ groups.

    Creating one is a collective over ``group`` (one all-gather of host names, then group creation): every rank
    of ``group`` must create it, with the same arguments, in the same order relative to other collectives. Its
    groups are created by their members only (``new_group(use_local_synchronization=True)``), which torch names by
    their ranks and the number of groups the rank has registered: the members must have registered as many groups
    before (a ``new_group`` that every rank calls registers only on its members), else the creation waits
    ``timeout`` and fails. With
    NCCL, call ``torch.cuda.set_device`` first (the host names travel as a pickled object on the current device).

    Args:
        group: the data-parallel process group (default: the whole world).
        ranks_per_node: ranks of ``group`` per node, ``d``. Default: ``$ZEROPP_RANKS_PER_NODE``, else torchrun's
            ``$LOCAL_WORLD_SIZE`` when ``group`` is the world, else the number of ``group``'s ranks on this host.
        host: this rank's host name (default ``socket.gethostname()``); tests pass made-up names to emulate
            several machines.
        hpz_partition_sizes: hpZ partition sizes whose groups are created now (others are created on first use
            of ``partition_group``, which is then a collective over the node).
        timeout: how long a collective on the groups this topology creates (intra-node, inter-node, hpZ) waits for
            the other ranks before failing with an error naming it. Default: the default process group's timeout
            (the ``timeout`` given to ``init_process_group``, else torch's default for its backend), not the
            30 minutes torch's ``new_group`` would give them. Collectives over ``group`` itself wait for
            ``group``'s own timeout, whatever this says.

    Raises:
        ValueError: if the group size is not a multiple of ``d``, the ranks disagree on ``d``, or a host holds a
            number of the group's ranks that is not a multiple of ``d`` (the claimed layout contradicts the hosts).
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        ranks_per_node: int | None = None,
        *,
        host: str | None = None,
        hpz_partition_sizes: tuple[int, ...] | list[int] = (),
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Topology needs an initialized torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (e.g. under torchrun)"
            )
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
            raise ValueError(f"timeout={timeout!r} must be a positive datetime.timedelta")
        # torch's new_group(timeout=None) would give the backend's default (30 minutes), not the user's
        self.timeout: timedelta = group_timeout(dist.group.WORLD) if timeout is None else timeout
        # Agreement-checked call records per group (zeropp.comm.checks.verify_agreement).
        self.verified_calls: dict[ProcessGroup, set[tuple[int, ...]]] = {}
        self.group: ProcessGroup = dist.group.WORLD if group is None else group
        self.ranks: list[int] = list(dist.get_process_group_ranks(self.group))
        self.world_size: int = len(self.ranks)
        self.global_rank: int = dist.get_rank()
        if self.global_rank not in self.ranks:
            raise ValueError(f"rank {self.global_rank} is not a member of the group {self.ranks}")
        self.rank: int = self.ranks.index(self.global_rank)

        if ranks_per_node is not None:
            claimed: int | None = _parse_count(ranks_per_node, "the ranks_per_node argument")
            source = "the ranks_per_node argument"
        elif os.environ.get(ENV_RANKS_PER_NODE):
            claimed = _parse_count(os.environ[ENV_RANKS_PER_NODE], f"${ENV_RANKS_PER_NODE}")
            source = f"${ENV_RANKS_PER_NODE}"
        elif os.environ.get("LOCAL_WORLD_SIZE") and self.world_size == dist.get_world_size():
            claimed = _parse_count(os.environ["LOCAL_WORLD_SIZE"], "$LOCAL_WORLD_SIZE")
            source = "$LOCAL_WORLD_SIZE"
        else:
            claimed = None
            source = "the number of the group's ranks on this host"

        self.host: str = socket.gethostname() if host is None else str(host)
        gathered: list[tuple[str, int | None]] = [("", None)] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(gathered, (self.host, claimed), group=self.group)
        else:
            gathered = [(self.host, claimed)]
        hosts = [h for h, _ in gathered]
        per_host: dict[str, list[int]] = {}
        for r, h in zip(self.ranks, hosts):
            per_host.setdefault(h, []).append(r)
        if claimed is None:
            claimed = len(per_host[self.host])
        claims = [c if c is not None else len(per_host[h]) for h, c in gathered]
        if len(set(claims)) > 1:
            raise ValueError(
                f"the ranks disagree on ranks_per_node: rank -> value {dict(zip(self.ranks, claims))}; "
                f"set the same ranks_per_node (or ${ENV_RANKS_PER_NODE}) on every rank"
            )
        d = claimed
        if self.world_size % d:
            raise ValueError(
                f"the group has {self.world_size} ranks, which is not a multiple of ranks_per_node={d} "
                f"(from {source}); pass ranks_per_node= or set ${ENV_RANKS_PER_NODE} to a divisor of "
                f"{self.world_size}"
            )
        for h, members in per_host.items():
            if len(members) % d:
                raise ValueError(
                    f"ranks_per_node={d} (from {source}) contradicts the hosts: host {h!r} holds "
                    f"{len(members)} ranks of the group ({members}), not a multiple of {d}; hosts: "
                    f"{ {k: len(v) for k, v in per_host.items()} }. Use a ranks_per_node that divides every "
                    "host's rank count"
                )
        self.ranks_per_node: int = d
        self.num_nodes: int = self.world_size // d
        # Nodes: each host's ranks (ascending global rank) cut into runs of d; hosts in order of first appearance.
        self.nodes: list[list[int]] = [
            members[i : i + d] for members in per_host.values() for i in range(0, len(members), d)
        ]
        self._node_of: dict[int, int] = {r: m for m, node in enumerate(self.nodes) for r in node}
        self._group_rank: dict[int, int] = {r: i for i, r in enumerate(self.ranks)}
        self._same_node: dict[ProcessGroup, int] = {}
        self._send_order: list[int] | None = None
        self._send_index: dict[torch.device, torch.Tensor] = {}
        self.node: int = self._node_of[self.global_rank]
        self.local_rank: int = self.nodes[self.node].index(self.global_rank)

        self._groups: dict[tuple[int, ...], ProcessGroup] = {tuple(self.ranks): self.group}
        _live.add(self)
        self.intra_group: ProcessGroup = self.subgroup(self.nodes[self.node])
        self.inter_group: ProcessGroup = self.subgroup(self.inter_ranks)
        for size in hpz_partition_sizes:
            self.partition_group(size)

    # ---- layout -------------------------------------------------------------------------------------------

    @property
    def intra_ranks(self) -> list[int]:
        """Global ranks of this rank's node, ascending (the order of ``intra_group``)."""
        return list(self.nodes[self.node])

    @property
    def inter_ranks(self) -> list[int]:
        """Global ranks holding this rank's local index on each node, ascending (the order of ``inter_group``)."""
        return sorted(node[self.local_rank] for node in self.nodes)

    def node_of(self, global_rank: int) -> int:
        """Index of the node holding ``global_rank`` (a member of the group)."""
        try:
            return self._node_of[global_rank]
        except KeyError:
            raise ValueError(f"global rank {global_rank} is not in the group {self.ranks}") from None

    def group_rank(self, global_rank: int) -> int:
        """Position of ``global_rank`` in the data-parallel group (the slice it owns in a reduce-scatter)."""
        try:
            return self._group_rank[global_rank]
        except KeyError:
            raise ValueError(f"global rank {global_rank} is not in the group {self.ranks}") from None

    def same_node_count(self, group: ProcessGroup) -> int:
        """How many members of ``group`` (this rank included) are on this rank's node."""
        if group not in self._same_node:
            ranks = dist.get_process_group_ranks(group)
            self._same_node[group] = sum(1 for r in ranks if self._node_of.get(r) == self.node)
        return self._same_node[group]

    def qgz_send_order(self) -> list[int]:
        """DP-group rank owning the slice at each position of the qgZ hop-1 send buffer.

        Position ``k * n + i`` holds the slice of member ``i`` (ascending global rank, the order of its
        ``inter_group``) of local index ``k``'s inter-node group, so local peer ``k`` receives one contiguous run
        already in the order of its hop-2 all-to-all. For node-contiguous layouts this is
        ``zeropp.quant.swizzle_source``'s order.
        """
        if self._send_order is None:
            self._send_order = [
                self._group_rank[g]
                for k in range(self.ranks_per_node)
                for g in sorted(node[k] for node in self.nodes)
            ]
        return list(self._send_order)

    def qgz_send_index(self, device: torch.device) -> torch.Tensor:
        """``qgz_send_order()`` as an int64 tensor on ``device`` (cached: no host-to-device copy per call)."""
        if device not in self._send_index:
            self._send_index[device] = torch.tensor(self.qgz_send_order(), dtype=torch.int64, device=device)
        return self._send_index[device]

    @property
    def is_node_contiguous(self) -> bool:
        """Whether node ``m`` holds DP-group ranks ``[m * d, (m + 1) * d)`` (then qgZ needs no reordering)."""
        return all(node == self.ranks[m * self.ranks_per_node : (m + 1) * self.ranks_per_node]
                   for m, node in enumerate(self.nodes))

    # ---- groups -------------------------------------------------------------------------------------------

    def subgroup(self, ranks: Sequence[int]) -> ProcessGroup:
        """The process group of ``ranks`` (global ranks of the group, this rank among them; any order), created
        with this topology's ``timeout`` on first use and cached: the first call for a set of ranks is a collective
        over those ranks (each of them must make it, in the same order relative to their other group creations).
        The whole group's ranks give ``group`` itself. ``zeropp.fsdp`` runs FSDP2's hpZ gathers over these."""
        key = tuple(sorted(ranks))
        if self.global_rank not in key or not set(key) <= set(self.ranks) or len(set(key)) != len(key):
            raise ValueError(
                f"subgroup ranks {list(ranks)} must be distinct members of the group {self.ranks} and include this "
                f"rank ({self.global_rank})"
            )
        if key not in self._groups:
            # Only the members call in: other ranks build their own groups at the same time.
            pg = dist.new_group(list(key), timeout=self.timeout, use_local_synchronization=True)
            assert pg is not None
            self._groups[key] = pg
        return self._groups[key]

    def partition_ranks(self, size: int) -> list[int]:
        """Global ranks of this rank's hpZ partition of ``size`` ranks, ascending (``partition_of``)."""
        return self.partition_of(self.global_rank, size)

    def partition_of(self, global_rank: int, size: int) -> list[int]:
        """Global ranks of ``global_rank``'s partition of ``size`` ranks, ascending: ``size`` consecutive local
        indices of its node when ``size`` divides ``ranks_per_node`` (hpZ's partitions), else ``size / d`` whole
        consecutive nodes (``size`` a multiple of ``d`` dividing the group's size: the resident points' parameter
        copy over whole nodes, ``zeropp.config.partition.resident_size``). A rank's position in its partition is
        its index in this list (the partition group's order)."""
        size = _parse_count(size, "the hpZ partition size")
        d = self.ranks_per_node
        node = self.node_of(global_rank)
        if d % size == 0:
            start = self.nodes[node].index(global_rank) // size * size
            return sorted(self.nodes[node][start : start + size])
        if size % d or self.world_size % size:
            raise ValueError(
                f"partition size {size} neither divides ranks_per_node={d} nor is a multiple of it dividing the "
                f"group's {self.world_size} ranks; use one of "
                f"{[s for s in range(1, d + 1) if d % s == 0]} or whole nodes "
                f"{[s for s in range(2 * d, self.world_size + 1, d) if self.world_size % s == 0]}"
            )
        first = node // (size // d) * (size // d)
        return sorted(r for n in self.nodes[first : first + size // d] for r in n)

    def partition_group(self, size: int) -> ProcessGroup:
        """The hpZ group of ``size`` ranks (a divisor of ``ranks_per_node``, or whole nodes: ``partition_of``)
        holding this rank; ``size`` equal to ``ranks_per_node`` gives ``intra_group``. Created and cached on first use: a collective over the
        partition's ranks then."""
        return self.subgroup(self.partition_ranks(size))

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self.world_size}, ranks_per_node={self.ranks_per_node}, "
            f"num_nodes={self.num_nodes}, rank={self.rank}, node={self.node}, local_rank={self.local_rank}, "
            f"host={self.host!r})"
        )


_default: Topology | None = None
_live: weakref.WeakSet[Topology] = weakref.WeakSet()


def _shut_down_at_exit() -> None:
    """Destroy the process groups before the interpreter finalizes (see ``zeropp.comm.work``): gloo's worker
    threads release finished works' tensors, which takes the GIL; a thread doing so once finalization has begun
    aborts the process. Destroying a group joins its threads (without holding the GIL), so this drops every
    reference zeropp holds to a group and destroys the process groups the program did not destroy."""
    global _default
    _default = None
    for topo in list(_live):
        topo._groups.clear()
        topo.verified_calls.clear()
        topo._same_node.clear()
        del topo.group, topo.intra_group, topo.inter_group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_shut_down_at_exit)


def get_default_topology(timeout: timedelta | None = None) -> Topology:
    """The topology of the whole world, created on first use (a collective over all ranks then) with ``timeout``
    (see ``Topology``; default: the default process group's). Raises ``ValueError`` if it exists with another
    timeout than a given one."""
    global _default
    if _default is None:
        _default = Topology(timeout=timeout)
    elif timeout is not None and timeout != _default.timeout:
        raise ValueError(
            f"the default topology exists with timeout={_default.timeout} and is now asked for timeout={timeout}; "
            "pass the same timeout everywhere, or set_default_topology(Topology(timeout=...)) first"
        )
    return _default


def set_default_topology(topology: Topology | None) -> None:
    """Make ``topology`` the default used by collectives called without one (``None`` forgets it)."""
    global _default
    _default = topology
