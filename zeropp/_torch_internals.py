"""The only place zeropp touches torch's private API, each use pinned by a test (tests/test_torch_internals.py).

Every function here wraps one read or call that torch offers no public way to make, names the private attributes
it uses, and has a test that checks its result against an independently known value, so that a torch upgrade
that moves or changes one of them fails in CI rather than in a user's run. This module imports only torch.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import ProcessGroup


def group_timeout(group: ProcessGroup) -> timedelta:
    """How long a collective on ``group`` waits for the other ranks before failing: the ``timeout`` given to
    ``init_process_group`` or ``new_group`` that made it (or torch's default for its backend), as later changed
    by torch.

    torch 2.13 has no public reader: the value lives in each of the group's backends' options
    (``ProcessGroup._device_types``, ``ProcessGroup._get_backend(device)``, ``Backend.options._timeout``, the
    attribute ``DeviceMesh`` itself reads). A group with several backends (``"cpu:gloo,cuda:nccl"``) gets one
    timeout for all of them from torch; should they differ, the longest is returned, so that no group made with it
    fails sooner than ``group`` itself would.
    """
    return max(group._get_backend(device).options._timeout for device in group._device_types)
