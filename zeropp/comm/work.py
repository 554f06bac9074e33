"""``CollectiveWork``: the handle an ``async_op=True`` collective returns.

A collective is written as a generator that issues its communication with ``async_op=True``, yields each
``torch.distributed`` work object together with the tensors the steps after it still touch and the step's name
for error messages (``""`` for a collective of one step), runs the local step
that needs it once it has been waited on, and finally returns its result. Creating the handle runs the generator to
its first communication, which is then in flight; ``wait()`` runs the rest. Synchronous calls create the handle and
wait at once. A communication that another one follows (qgZ's hop 1) is yielded with a fourth element ``True``:
``start_next_hop()`` may then issue the next one before ``wait()``.

CUDA streams (the rule is in ``CollectiveWork``'s docstring): the handle remembers the stream current when the
collective was issued and an event recorded on it once the issuing steps are queued. ``wait()`` from another stream
makes that stream wait on the event and records every tensor the collective used on it (``Tensor.record_stream``).

Failures: a backend error while waiting (a timeout because a rank skipped the call or called another collective,
a peer that died) is re-raised as ``CollectiveError`` naming the zeropp collective, its group and shapes, and the
step that failed (qgZ's hop and its ranks).

"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import Any

import torch

# What a collective's generator yields: a torch.distributed work object, the tensors (temporaries, buffers handed
# to the communication) that stay in use after it, and the step's name for error messages ("" if the only one);
# optionally a fourth element, True when another communication follows this one (see start_next_hop).
Pending = tuple[Any, tuple[torch.Tensor | None, ...], str] | tuple[Any, tuple[torch.Tensor | None, ...], str, bool]

class CollectiveError(RuntimeError):
    """A zeropp collective failed in the backend (a timeout, a peer gone); the message names the collective."""


def wait_backend(work: Any, what: str) -> None:
    """``work.wait()`` for a torch.distributed work object, a backend failure re-raised as a ``CollectiveError``
    naming ``what`` (the collective, its group and shapes)."""
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(
            f"{what} failed in the backend: {e}. If it timed out, a rank of the group did not make this call "
            "(it skipped it, called another collective or is stuck); the timeout is Topology's (timeout=, by "
            "default init_process_group's) on zeropp's node groups, the group's own on the data-parallel group"
        ) from e


class CollectiveWork:
    """Handle of an asynchronous zeropp collective. ``wait()`` finishes it and returns the output tensor.

    For a quantized all-gather the only communication is in flight on return and ``wait()`` dequantizes. For qgZ
    hop 1 is in flight on return; the fused reduce, hop 2 and the final reduce run inside ``wait()`` (on CUDA they
    are queued on the current stream, so the host does not block on them).

    Because ``wait()`` may issue communication (qgZ hop 2), every rank must call ``wait()`` on its handles in the
    same order, as it issued the collectives in the same order.

    CUDA streams. Call the stream current at the call the *issuing* stream ``I`` and the one current at ``wait()``
    the *waiting* stream ``W`` (often the same, as in the engine; then all this costs one event record per call).
    The rule, as for NCCL's own ``Work.wait()``: after ``wait()`` returns, the output is safe to use on ``W``, and
    every tensor the collective touched may be freed or reused from any stream. To that end ``wait()``:

    1. makes ``W`` wait on an event recorded on ``I`` when the call returned (so ``W`` sees the quantization and any
       write the call queued on ``I``, also when no communication orders them, e.g. at one rank);
    2. queues the remaining local steps (dequantize, fused reduce, qgZ's hop 2, the final reduce) on ``W``;
    3. calls ``Tensor.record_stream(W)`` on every tensor the collective used — the input, ``out``, and every
       temporary allocated on ``I`` (packed send and receive buffers, qgZ's intermediates, the error-feedback
       residuals) — so the caching allocator hands their memory to no other allocation until the work queued on
       ``W`` so far has run. Without it, a temporary freed at the end of ``wait()`` would return to ``I``'s pool
       and the next allocation on ``I`` could overwrite it while ``W``'s kernels still read it.

    The output is *not* ordered before later work on ``I``: to use it there, make ``I`` wait on ``W``
    (``I.wait_stream(W)``), as with any tensor produced on another stream. The communication itself is the
    backend's (gloo's and NCCL's works order their own streams and keep their buffers alive). A second ``wait()``
    from yet another stream makes that stream wait on the first waiting stream. An ``ErrorFeedback`` is updated on
    ``I`` (hop 1) and ``W`` (hop 2): wait for successive reductions of one buffer on one stream. Synchronous calls
    and CPU tensors (no streams) skip all of this.
    """

    def __init__(
        self, steps: Generator[Pending, None, torch.Tensor], tensors: Iterable[torch.Tensor] = (), *,
        streams: bool = True, what: str = "collective",
    ) -> None:
        """``tensors``: the caller's tensors (input, output) to record on the waiting stream. ``streams=False``
        (a synchronous call: waited on the issuing stream at once) skips the stream bookkeeping. ``what``: the
        collective, its group and shapes, for error messages."""
        self._steps = steps
        self._what = what
        self._result: torch.Tensor | None = None
        self._pending: Pending | None = None
        self._used = [t for t in tensors if t.is_cuda] if streams else []
        self._stream: torch.cuda.Stream | None = None
        self._issued: torch.cuda.Event | None = None
        self._waited_on: torch.cuda.Stream | None = None  # the stream of the first wait()
        if self._used:
            self._stream = torch.cuda.current_stream(self._used[0].device)
        self._advance()
        if self._stream is not None:
            self._issued = torch.cuda.Event()
            self._issued.record(self._stream)

    def _advance(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration as stop:
            self._pending = None
            self._result = stop.value
        except RuntimeError as e:  # the backend refused to issue the communication (e.g. a peer is gone)
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(f"{self._what} failed in the backend: {e}") from e

    def wait(self) -> torch.Tensor:
        """Block until the collective is done (on CUDA: until it is queued on the current stream, which may differ
        from the issuing one, see the class docstring); returns the output tensor. Calling it again returns the
        same tensor (from another stream than the first ``wait()``'s: after making that stream wait on it)."""
        waiting = self._hand_over()
        while self._pending is not None:
            self._finish_step(waiting)
        assert self._result is not None
        return self._result

    def start_next_hop(self) -> bool:
        """If the communication in flight is one that another follows (qgZ's hop 1), wait for it, run the local
        step after it and issue the next one (hop 2), so that it travels while the caller goes on instead of from
        ``wait()``; returns whether it did. The choice depends only on the collective's structure, never on what
        has arrived, so ranks that call it at the same point of their program issue the same communications in the
        same order. The stream rule is ``wait()``'s: the current stream becomes the waiting one."""
        if self._pending is None or len(self._pending) < 4 or not self._pending[3]:
            return False
        self._finish_step(self._hand_over())
        return True

    def _hand_over(self) -> torch.cuda.Stream | None:
        """CUDA: make the current stream the waiting one (the class docstring's rule); returns the stream to record
        the remaining steps' tensors on when it is not the one they were issued on, else ``None``."""
        if self._stream is None:
            return None
        current = torch.cuda.current_stream(self._stream.device)
        if self._waited_on is None:
            self._waited_on = current
            waiting = None
            if current != self._stream:
                assert self._issued is not None
                current.wait_event(self._issued)
                waiting = current
                self._record(self._used, waiting)
            self._used = []
            return waiting
        if current == self._waited_on:
            return None
        current.wait_stream(self._waited_on)  # a later call from yet another stream
        self._waited_on = current
        if self._result is not None:
            self._result.record_stream(current)
            return None
        return current

    def _finish_step(self, waiting: torch.cuda.Stream | None) -> None:
        """Wait for the communication in flight and run the generator to its next one (or to its end)."""
        assert self._pending is not None
        work, tensors, step = self._pending[:3]
        if waiting is not None:  # before the last step frees them: the generator's locals go with it
            self._record(tensors, waiting)
        wait_backend(work, f"{self._what}{step}")
        self._advance()

    @staticmethod
    def _record(tensors: Iterable[torch.Tensor | None], stream: torch.cuda.Stream) -> None:
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(stream)

    def is_completed(self) -> bool:
        """Whether ``wait()`` has finished the collective."""
        return self._pending is None


def run(
    steps: Generator[Pending, None, torch.Tensor], async_op: bool, tensors: Iterable[torch.Tensor] = (),
    what: str = "collective",
) -> torch.Tensor | CollectiveWork:
    """Run a collective's ``steps``: at once (``async_op=False``), or to its first communication, returning the
    handle. ``tensors``: the caller's input and output, recorded on the waiting stream (see ``CollectiveWork``).
    ``what``: the collective, its group and shapes, for error messages."""
    work = CollectiveWork(steps, tensors, streams=async_op, what=what)
    return work if async_op else work.wait()
