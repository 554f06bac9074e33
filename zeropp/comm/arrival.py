"""``Arrival``: the check, before a collective that a program might call on some ranks only, that every rank of the
group has reached it, with a bounded wait and the late ranks named.

A collective entered by fewer ranks than its group waits for the others until the group's timeout (torch's default
for gloo: 30 minutes) and then fails without saying why. ``Arrival.wait_all()`` is a handshake on a gloo side group
of its own, made with public point-to-point calls (``isend``/``irecv`` and ``Work.wait(timeout)``): every rank sends
one byte to the group's first rank, which waits until ``timeout`` after its own arrival for all of them and then
sends each rank one byte back. A rank whose handshake does not complete raises ``ArrivalError``: on the first rank
within ``timeout``, naming the global ranks that did not arrive; on the others within ``1.25 * timeout`` (they wait
for the first rank's answer, which it sends at most ``timeout`` after it arrived; they cannot tell which rank was
missing, so they say so). gloo's point-to-point calls work on any machine, so the check costs no device memory and
no NCCL communicator; its cost is one round trip of one-byte messages through the first rank.

Every engine over one ``Topology`` shares one ``Arrival`` (``Arrival.of``), made when the first asks for it: a group
made later, once other groups have been created on some of the ranks only (an engine over a subgroup), would not
meet (``use_local_synchronization`` names a group by its ranks and the number of groups each rank has made).

After a failed check the side group is unusable: gloo closes every connection of a group when a wait on it times
out, so each later ``wait_all()`` on any rank fails at once (a stale message of the failed round can never be taken
for an arrival). ``broken`` holds the error on the rank that saw it, and later calls there raise it again.

A handshake cannot guarantee agreement when a rank arrives at the very end of the wait (the first rank may confirm
while a rank that arrived ``1.25 * timeout`` earlier has just given up); it is a bound on how long a mistaken call
waits, not a consensus protocol.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .topology import Topology
from .work import CollectiveError

# ranks other than the first wait this much longer than ``timeout`` for its answer (see the module docstring)
_FOLLOWER_SLACK = 1.25
_TAG = 0x5A5A  # the side group carries nothing else; a fixed tag keeps its messages apart from any other traffic


class ArrivalError(CollectiveError):
    """Not every rank of the group arrived at ``Arrival.wait_all()`` in time.

    Attributes:
        missing: the global ranks known not to have arrived (on the group's first rank: all of them); ``None`` on
            the other ranks, which only know that the first rank did not confirm.
        timeout: the bound the check used.
    """

    def __init__(self, message: str, missing: list[int] | None, timeout: timedelta) -> None:
        super().__init__(message)
        self.missing = missing
        self.timeout = timeout


class Arrival:
    """The arrival check over the global ``ranks`` (see the module docstring).

    Creating one is a collective over ``ranks`` (``dist.new_group(backend="gloo", use_local_synchronization=True)``):
    every rank in ``ranks`` creates it, in the same order relative to other group creations; other ranks need not.
    torch names such a group by its ranks and the number of groups this rank has registered, so the members must
    have registered as many groups before (a group created by every rank with ``new_group`` registers only on its
    members): ranks that disagree wait in the creation until ``timeout`` and then fail.

    Args:
        ranks: global ranks of the group, this rank among them (at least two).
        timeout: how long the creation waits for the other ranks (the topology's timeout). Each check's wait names
            its own timeout, which overrides this one.
    """

    def __init__(self, ranks: Sequence[int], timeout: timedelta) -> None:
        self.ranks = sorted(ranks)
        self.rank = dist.get_rank()
        if len(self.ranks) < 2 or self.rank not in self.ranks:
            raise ValueError(f"ranks={list(ranks)} must hold at least two ranks, this rank ({self.rank}) among them")
        self.group = dist.new_group(self.ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        self.broken: ArrivalError | None = None
        # the works of a failed round: gloo may still hold their buffers, which must outlive it
        self._abandoned: list[Any] = []

    @classmethod
    def of(cls, topology: Topology) -> Arrival:
        """The ``Arrival`` over ``topology``'s data-parallel ranks, made on the first call for it (then a collective
        over them; see the module docstring)."""
        if topology not in _by_topology:
            _by_topology[topology] = cls(topology.ranks, topology.timeout)
        return _by_topology[topology]

    def wait_all(self, timeout: timedelta) -> None:
        """Return once every rank of the group has called ``wait_all()`` (the matching call on each), or raise
        ``ArrivalError`` within the bound of the module docstring: ``timeout`` (a positive ``datetime.timedelta``)
        after this rank's call on the group's first rank, 1.25 times that on the others."""
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout={timeout!r} must be a positive datetime.timedelta")
        if self.broken is not None:
            raise ArrivalError(f"an earlier arrival check failed on this rank ({self.broken}); the check's group "
                               "has been closed since", self.broken.missing, timeout)
        first = self.ranks[0]
        works: list[Any] = []
        try:
            if self.rank == first:
                self._lead(works, timeout)
            else:
                self._follow(first, works, timeout)
        except ArrivalError as e:
            self.broken = e
            self._abandoned += works
            raise

    def _lead(self, works: list[Any], timeout: timedelta) -> None:
        start = time.monotonic()
        seconds = timeout.total_seconds()
        others = self.ranks[1:]
        try:
            received = {r: dist.irecv(torch.zeros(1, dtype=torch.uint8), src=r, group=self.group, tag=_TAG)
                        for r in others}
        except RuntimeError as e:  # gloo refuses to post on a closed group
            raise ArrivalError(f"the check's group of {self.ranks} is closed: an earlier check failed on another "
                               "rank, or a rank's process ended", None, timeout) from e
        works += received.values()
        missing = []
        for r, work in received.items():
            # a message already received completes even after an earlier wait timed out and closed the group
            left = max(seconds - (time.monotonic() - start), 0.001)
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError:
                missing.append(r)
        if missing:
            raise ArrivalError(f"global ranks {missing} of the group {self.ranks} did not arrive within "
                               f"{seconds:g} s of rank {self.rank}", missing, timeout)
        go = torch.ones(1, dtype=torch.uint8)
        late = []
        for r in others:
            try:  # the others have posted their receive: this completes at once unless one has given up
                works.append(dist.isend(go, dst=r, group=self.group, tag=_TAG))
                works[-1].wait(timedelta(seconds=seconds * (_FOLLOWER_SLACK - 1)))
            except RuntimeError:
                late.append(r)
        if late:
            raise ArrivalError(f"global ranks {late} of the group {self.ranks} arrived but gave up before rank "
                               f"{self.rank} could confirm (timeout {seconds:g} s)", late, timeout)

    def _follow(self, first: int, works: list[Any], timeout: timedelta) -> None:
        seconds = timeout.total_seconds()
        answer = torch.zeros(1, dtype=torch.uint8)
        try:
            works.append(dist.isend(torch.ones(1, dtype=torch.uint8), dst=first, group=self.group, tag=_TAG))
            works.append(dist.irecv(answer, src=first, group=self.group, tag=_TAG))
            for work in reversed(works):  # the answer first: the send completes when the first rank takes it
                work.wait(timedelta(seconds=seconds * _FOLLOWER_SLACK))
        except RuntimeError as e:
            raise ArrivalError(
                f"rank {self.rank} arrived, but the group's first rank ({first}) did not confirm within "
                f"{seconds * _FOLLOWER_SLACK:g} s that every rank of {self.ranks} arrived: it did not arrive, "
                "another rank did not (the first rank's error names it), or an earlier check failed",
                None, timeout) from e


_by_topology: weakref.WeakKeyDictionary[Topology, Arrival] = weakref.WeakKeyDictionary()
