"""Byte accounting: what each collective of this process sends and receives, split by intra- and inter-node.

Counters are per process (this rank) and per collective kind (``"all_gather"``, ``"reduce_scatter"``,
``"exchange"``, ``"all_reduce"``), in bytes actually handed to the transport (packed codes and scales for quantized
collectives, the padded float buffers for exact ones). A rank's own part, which never leaves the process, is not
counted.

The model (every kind): a rank exchanges with each peer ``q`` of the group a known number of bytes, and those
bytes are *intra* when ``q`` is on the same node and *inter* otherwise.

* all-gather of ``B`` bytes per rank over a group of ``P`` ranks, ``p`` of them on this rank's node:
  ``sent_intra = recv_intra = (p - 1) * B`` and ``sent_inter = recv_inter = (P - p) * B``.
  The totals, ``(P - 1) * B`` each way, are exactly what a ring all-gather sends and receives per rank (the
  nccl-tests ``busbw`` factor ``(P - 1) / P`` of ``P * B``). The split is by the node of the rank that owns
  (receive) or needs (send) the bytes: the volume that must cross node boundaries in any bandwidth-optimal
  hierarchical algorithm. A flat ring instead carries ``(P - 1) * B`` over each of its cross-node links.
* all-to-all (``all_to_all_single`` with ``B_q`` bytes to and from peer ``q``): exact, ``sum over q != self``
  split by the node of ``q``. qgZ hop 1 is intra-node by construction, hop 2 inter-node.
* exact reduce-scatter of ``S`` elements per rank (``reduce_scatter_tensor``): counted like an all-gather of
  ``S * itemsize`` bytes (ring reduce-scatter sends and receives ``(P - 1) * S * itemsize`` per rank).
* exchange (``zeropp.comm.exchange``: ``B`` bytes to each of some peers, from each of some peers): exact, each
  peer's ``B`` split by the node of that peer.
* all-reduce (``zeropp.comm.all_reduce``) of ``N`` elements over ``R`` ranks: a ring reduce-scatter and all-gather
  of ``ceil(N / R)`` elements each, so twice an all-gather of ``ceil(N / R) * itemsize`` bytes. Quantized, its two
  halves (a qgZ reduce-scatter and a quantized all-gather, each counted as above) are one ``"all_reduce"`` call
  (``combined``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

KINDS = ("all_gather", "reduce_scatter", "exchange", "all_reduce")
FIELDS = ("calls", "sent_intra", "sent_inter", "recv_intra", "recv_inter")

_lock = threading.Lock()
_counters: dict[str, dict[str, int]] = {}
_combining = threading.local()  # .calls: the Traffic of each call recorded inside this thread's ``combined`` block


@dataclass(frozen=True)
class Traffic:
    """Bytes one collective call moves for this rank (its own part excluded)."""

    sent_intra: int = 0
    sent_inter: int = 0
    recv_intra: int = 0
    recv_inter: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.sent_intra + other.sent_intra,
            self.sent_inter + other.sent_inter,
            self.recv_intra + other.recv_intra,
            self.recv_inter + other.recv_inter,
        )

    @property
    def sent(self) -> int:
        return self.sent_intra + self.sent_inter

    @property
    def received(self) -> int:
        return self.recv_intra + self.recv_inter


def gather_traffic(nbytes: int, group_size: int, same_node: int) -> Traffic:
    """An all-gather of ``nbytes`` per rank over ``group_size`` ranks, ``same_node`` of them (self included) on
    this rank's node."""
    intra = (same_node - 1) * nbytes
    inter = (group_size - same_node) * nbytes
    return Traffic(intra, inter, intra, inter)


def all_to_all_traffic(nbytes_per_peer: int, peers_same_node: int, peers_other_nodes: int) -> Traffic:
    """An all-to-all moving ``nbytes_per_peer`` to and from each peer (self excluded from both counts)."""
    intra = peers_same_node * nbytes_per_peer
    inter = peers_other_nodes * nbytes_per_peer
    return Traffic(intra, inter, intra, inter)


def record(kind: str, traffic: Traffic) -> None:
    """Add one call of ``kind`` moving ``traffic`` to the counters (inside ``combined``: to that block's call)."""
    held = getattr(_combining, "calls", None)
    if held is not None:
        held.append(traffic)
        return
    with _lock:
        c = _counters.setdefault(kind, dict.fromkeys(FIELDS, 0))
        c["calls"] += 1
        c["sent_intra"] += traffic.sent_intra
        c["sent_inter"] += traffic.sent_inter
        c["recv_intra"] += traffic.recv_intra
        c["recv_inter"] += traffic.recv_inter


@contextmanager
def combined(kind: str) -> Iterator[None]:
    """Count every call this thread records inside the block as one call of ``kind`` moving their summed bytes
    (a collective built of other collectives, e.g. a quantized all-reduce). Not nestable."""
    if getattr(_combining, "calls", None) is not None:
        raise RuntimeError("accounting.combined blocks do not nest")
    _combining.calls = []
    try:
        yield
    finally:
        calls, _combining.calls = _combining.calls, None
        record(kind, sum(calls, Traffic()))


def stats() -> dict[str, dict[str, int]]:
    """A copy of the counters: ``{kind: {"calls", "sent_intra", "sent_inter", "recv_intra", "recv_inter"}}``
    (bytes, this rank, since the last ``reset_stats``). Every kind in ``KINDS`` is present."""
    with _lock:
        out = {k: dict.fromkeys(FIELDS, 0) for k in KINDS}
        for kind, c in _counters.items():
            out[kind] = dict(c)
        return out


def reset_stats() -> None:
    """Zero every counter."""
    with _lock:
        _counters.clear()
