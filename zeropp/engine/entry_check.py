"""``EntryCheck``: a call that every rank of the data-parallel group must make, made by fewer, raises within a bounded
time instead of waiting forever.

The engine's calls that communicate outside the training loop — ``model.state_dict()`` at stage 3 (unless the
units are held by a ``gathered_parameters`` block), ``gathered_parameters()`` entry, ``consolidated_state_dict()``,
``state_dict()``, ``full_parameters()``, ``save_16bit_model()``, ``load_state_dict()``, ``save_checkpoint()`` and
``load_checkpoint()`` — are collectives. The most common mistake is a save from one rank (``if rank == 0:
model.save_pretrained(d)``, what PEFT and Hugging Face examples write): that rank would wait in the first all-gather
until the process group's timeout (30 minutes for gloo) with no message. So each such call first runs an arrival
check (``comm.Arrival``, through ``Collectives.wait_all_arrived``: a handshake on a gloo side group, one round trip
of one-byte messages through the group's first rank): when not every rank arrives within
``zero_optimization.zeropp.entry_check_timeout`` seconds (default 300), the ranks that did raise
``EngineUsageError``, naming the ranks that did not (on the group's first rank; the others wait up to 1.25 times the
timeout for its answer and cannot know which rank was missing) and the pattern to use instead::

    with engine.gathered_parameters():      # every rank: the whole weights, gathered once
        if rank == 0:
            model.save_pretrained(save_dir)  # model.state_dict() inside reads them, no communication

The error type is ``EngineUsageError``, not ``comm.CollectiveError``: nothing failed in the backend; the program
made a collective call on some ranks only (or one rank is far slower than the timeout allows), and the fix is in
the program or the config.

The default, 300 s, is long enough for a rank that evaluates or writes a large file alone before a call the others
already wait in, and short against torch's own timeouts (30 minutes for gloo, 10 for NCCL); a rank that is merely
that much slower gets the same error, whose message names the key to raise.

Cost: one check per outermost call (a call made inside another — ``save_16bit_model`` calling ``state_dict`` — is
not checked again); nothing in the training loop (forward, backward, step) ever checks. A ``model.state_dict()``
whose units are all held by a ``gathered_parameters`` block communicates nothing and checks nothing. The side group
(a gloo group over the data-parallel ranks, CPU only) is made once per ``Topology``, with the first engine over it.

After a failed check the ranks are out of step, and the check's side group is closed (see ``comm.arrival``): every
later checked call of the engines over that topology raises at once, on every rank. Restart the program
(``load_checkpoint`` resumes it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .. import comm
from .collectives import Collectives


class EngineUsageError(RuntimeError):
    """The engine's calls came in an order that cannot be right (e.g. ``backward`` before a forward), or a call that
    every rank must make was made by fewer ranks (``zeropp.engine.entry_check``)."""


SAVE_PATTERN = """\
    with engine.gathered_parameters():
        if rank == 0:
            model.save_pretrained(save_dir)   # or torch.save(model.state_dict(), path)"""


class EntryCheck:
    """The arrival check of the engine's collective calls (see the module docstring).

    Args:
        collectives: the engine's collectives (their ``wait_all_arrived`` is the check).
    """

    def __init__(self, collectives: Collectives) -> None:
        self.comm = collectives
        self._depth = 0
        self.failed: str | None = None  # the message of the failed check, if one failed

    @contextlib.contextmanager
    def entered(self, what: str, *, save_hint: bool = True) -> Iterator[None]:
        """Inside: the call ``what`` (as a user writes it, e.g. ``"engine.save_16bit_model()"``) runs knowing that
        every rank entered it. The outermost ``entered`` checks (none at one rank); nested ones do not. Raises
        ``EngineUsageError`` when the check fails; ``save_hint`` adds the one-rank save pattern to its message."""
        if self._depth == 0:
            self.check(what, save_hint=save_hint)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def check(self, what: str, *, save_hint: bool = True) -> None:
        """Check that every rank entered ``what`` now, unless an enclosing ``entered`` already did (see ``entered``)."""
        if self._depth:
            return
        if self.failed is not None:
            raise EngineUsageError(f"{what}: an earlier call's arrival check failed on this rank, so the ranks are out "
                                   f"of step; restart the program. The earlier error: {self.failed}")
        try:
            self.comm.wait_all_arrived()
        except comm.ArrivalError as e:
            text = (f"{what} is a collective over the data-parallel group (global ranks {self.comm.topology.ranks}): "
                    f"every rank must call it, and not every rank did: {e}.")
            if save_hint:
                text += (" To save from one rank, gather on every rank and write on one (inside the block "
                         f"model.state_dict() reads the whole weights without communicating):\n\n{SAVE_PATTERN}\n\n")
            else:
                text += " "
            self.failed = text + (
                "If every rank does make this call but some arrive later than that, raise "
                f"zero_optimization.zeropp.entry_check_timeout (now {self.comm.arrival_timeout.total_seconds():g} s). The ranks are now out of "
                "step: every later state_dict/gather/save/load call of this engine raises at once; restart the "
                "program.")
            raise EngineUsageError(self.failed) from e
