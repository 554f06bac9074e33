"""Stage-3 prefetch: start the all-gathers of the units expected next while the current unit computes.

The order is learned, not declared: every forward records the order in which units are gathered by their forward
pre-hooks (``after_forward_gather``), starting afresh when the model's outermost forward begins (``begin_forward``,
a pre-hook on the model). The next forward uses the previous one's order:

* forward: after unit ``u`` is gathered, start the gathers of the units that followed ``u`` last time;
* backward: after ``u`` is gathered for its backward, start those of the units that *preceded* ``u`` in the forward
  (autograd visits them in reverse), which in stage 3 re-gather from the hpZ secondaries when hpZ is on.

Look-ahead is bounded by ``stage3_prefetch_bucket_size`` (elements, DeepSpeed's meaning): units are started in order
while their sizes (padded flat buffers) add up to no more than it; ``0`` turns prefetching off. The first forward has
no order yet and gathers on demand. Every rank makes the same calls in the same order, so the collectives match; a
wrong guess (a unit not used after all) costs one gather and memory until the engine frees every unit at the end of
backward, never correctness: computation always waits for the unit's own gather (``Unit.gather``).

A unit whose secondary still waits for its part of the weight-delta exchange (``Unit.secondary_in_flight``;
``zeropp.engine.weight_deltas``: the exchange after a step is in flight while the next forward runs) is started
ahead only if it is the first such unit of the walk: starting it lands its part (waits for it and applies it) before
its gather starts, so each call waits for at most one part, the one of the unit needed next; the later units in
flight are left to the next calls (one unit ahead in the first forward after a step), the units after them that
are not in flight are started as usual. Whether a part is in flight is the same on every rank at the same point
(the parts land at the same reads), so the ranks still start the same gathers in the same order (whether a part
has *arrived* would differ between ranks, and is never looked at).

``last_order()``: the order of the latest forward, which the weight-delta tier sends its parts in.

The gathers overlap computation because they are asynchronous collectives (a gloo worker thread moves the bytes on
CPU; NCCL's stream on GPU). A prefetched qwZ gather quantizes its shard at once (before it is needed) and dequantizes
when waited on.
"""

from __future__ import annotations

from .unit import Unit


class Prefetcher:
    """Learns the stage-3 gather order and starts gathers ahead of use (see the module docstring).

    Args:
        bucket_numel: most elements of units started ahead of the current one (``stage3_prefetch_bucket_size``;
            a unit counts its trainable and its frozen elements, both gathered).

    Attributes:
        started: gathers started ahead of use so far (for tests and benchmarks).
    """

    def __init__(self, bucket_numel: int) -> None:
        self.bucket_numel = bucket_numel
        self.order: list[Unit] = []  # the previous forward's gather order
        self._position: dict[int, int] = {}
        self._recording: list[Unit] = []
        self._seen: set[int] = set()
        self.started = 0

    def begin_forward(self) -> None:
        """A forward of the whole model starts: what the last one recorded becomes the order to prefetch by."""
        if self._recording:
            self.order = self._recording
            self._position = {id(u): i for i, u in enumerate(self.order)}
        self._recording = []
        self._seen = set()

    def last_order(self) -> list[Unit]:
        """The units in the order the latest forward gathered them (the one before it while none has run since
        ``begin_forward``; empty before the first)."""
        return self._recording or self.order

    def after_forward_gather(self, unit: Unit) -> None:
        """``unit`` was gathered for its forward: record it, start the gathers of the units after it."""
        if id(unit) not in self._seen:
            self._seen.add(id(unit))
            self._recording.append(unit)
        self._start(unit, +1)

    def after_backward_gather(self, unit: Unit) -> None:
        """``unit`` was gathered for its backward: start the gathers of the units before it in the forward."""
        self._start(unit, -1)

    def _start(self, unit: Unit, direction: int) -> None:
        i = self._position.get(id(unit))
        if i is None or self.bucket_numel <= 0:
            return
        budget = self.bucket_numel
        landed = False  # at most one unit per call lands its part of the weight-delta exchange (module docstring)
        i += direction
        while 0 <= i < len(self.order):
            nxt = self.order[i]
            if not nxt.gathered and not (landed and nxt.secondary_in_flight):
                size = nxt.full.numel() + (nxt.frozen.full.numel() if nxt.frozen is not None else 0)
                if size > budget:
                    return
                budget -= size
                landed = landed or nxt.secondary_in_flight
                nxt.gather(wait=False)
                self.started += 1
            i += direction
