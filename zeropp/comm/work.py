"""``CollectiveWork``: the handle an ``async_op=True`` collective returns.

A collective is written as a generator that issues its communication with ``async_op=True``, yields each
``torch.distributed`` work object, runs the local step that needs it once it has been waited on, and finally
returns its result. Creating the handle runs the generator to its first communication, which is then in flight;
``wait()`` runs the rest. Synchronous calls create the handle and wait at once.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch


class CollectiveWork:
    """Handle of an asynchronous zeropp collective. ``wait()`` finishes it and returns the output tensor.

    For a quantized all-gather the only communication is in flight on return and ``wait()`` dequantizes. For qgZ
    hop 1 is in flight on return; the fused reduce, hop 2 and the final reduce run inside ``wait()`` (on CUDA they
    are queued on the current stream, so the host does not block on them).

    Because ``wait()`` may issue communication (qgZ hop 2), every rank must call ``wait()`` on its handles in the
    same order, as it issued the collectives in the same order.
    """

    def __init__(self, steps: Generator[Any, None, torch.Tensor]) -> None:
        self._steps = steps
        self._result: torch.Tensor | None = None
        self._pending: Any = None
        self._advance()

    def _advance(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration as stop:
            self._pending = None
            self._result = stop.value

    def wait(self) -> torch.Tensor:
        """Block until the collective is done (on CUDA: until it is queued on the current stream); returns the
        output tensor. Calling it again returns the same tensor."""
        while self._pending is not None:
            self._pending.wait()
            self._advance()
        assert self._result is not None
        return self._result

    def is_completed(self) -> bool:
        """Whether ``wait()`` has finished the collective."""
        return self._pending is None


def run(steps: Generator[Any, None, torch.Tensor], async_op: bool) -> torch.Tensor | CollectiveWork:
    work = CollectiveWork(steps)
    return work if async_op else work.wait()
