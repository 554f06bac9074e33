"""The only place zeropp touches torch's private API; each use pinned by a test in tests/test_torch_internals.py so
a torch upgrade fails in CI, not in a user's run.

A leaf: it imports torch only. Each use below has no public equivalent in torch 2.13 (checked in its source):

* ``in_backward``: ``torch._C._current_graph_task_id()``. Nothing public says whether autograd is executing a
  backward pass on this thread; ``torch.autograd.graph.register_multi_grad_hook`` reads the same id internally. A
  flag of zeropp's own set around ``engine.backward`` would miss backward passes run by other calls
  (``torch.autograd.grad``, the inner backward of a reentrant activation checkpoint started outside the engine).
* ``tree_leaves``: ``torch.utils._pytree.tree_leaves``. torch 2.13 has no public pytree module; zeropp needs
  torch's, not a walk of its own, because libraries register their output types with it (Hugging Face registers
  ``ModelOutput``), and those must be searched for tensors the same way torch's own hooks do.
* ``FSDPAllGather`` / ``FSDPReduceScatter``: the interface classes that the public
  ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take, defined only in the private
  ``torch.distributed.fsdp._fully_shard._fsdp_api`` (not exported by ``torch.distributed.fsdp``). Looked up on
  first access (the module ``__getattr__`` below), not when this module is imported, so that ``zeropp.comm`` and
  ``zeropp.engine`` do not depend on where torch keeps them: a torch that moves them breaks ``zeropp.fsdp`` only.
* ``fsdp_group_modules``: ``FSDPModule._get_fsdp_state()._modules``. ``fully_shard([a, b])`` gives ``a`` and ``b``
  one FSDP2 state, one flat all-gather input and one custom all-gather; nothing public says which modules share a
  state, and ``zeropp.fsdp`` needs the group's modules, in the order given to ``fully_shard``, to lay out the
  group's parameters (``zeropp.fsdp.segments``).
* ``group_timeout``: ``ProcessGroup._device_types``, ``ProcessGroup._get_backend`` and the backend options'
  ``_timeout`` (what ``DeviceMesh`` itself reads). Nothing public reads a process group's timeout, and torch's
  ``new_group`` does not inherit the default group's, so ``zeropp.comm.Topology`` reads it to give its groups the
  timeout the user gave ``init_process_group``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup
from torch.utils import _pytree

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter

__all__ = ["FSDPAllGather", "FSDPReduceScatter", "fsdp_group_modules", "group_timeout", "in_backward", "tree_leaves"]

_FSDP_COMM_INTERFACES = {"FSDPAllGather": "AllGather", "FSDPReduceScatter": "ReduceScatter"}


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread: inside a gradient hook, or inside the forward
    that a reentrant activation checkpoint recomputes during backward."""
    return torch._C._current_graph_task_id() != -1


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in torch's pytree order: nested tuples, lists, dicts, namedtuples and every type
    registered with torch's pytree are walked; anything else (a tensor, ``None``) is a leaf."""
    return _pytree.tree_leaves(tree)


def fsdp_group_modules(module: Any) -> tuple[torch.nn.Module, ...]:
    """The modules of the ``fully_shard`` call that made ``module`` (an ``FSDPModule``) an FSDP2 module, in the order
    FSDP2 walks them (the call's modules less those nested in another of them, in the order given): ``(module,)``
    for ``fully_shard(module)``, ``(a, b)`` for ``fully_shard([a, b])``, whichever of ``a`` and ``b`` is asked."""
    return tuple(module._get_fsdp_state()._modules)


def group_timeout(group: ProcessGroup) -> timedelta:
    """How long a collective on ``group`` waits for the other ranks before failing: the ``timeout`` given to
    ``init_process_group`` or ``new_group`` that made it (or torch's default for its backend). A group with several
    backends (``"cpu:gloo,cuda:nccl"``) gets one timeout for all of them from torch; should they differ, the longest
    is returned, so that no group made with it fails sooner than ``group`` itself would."""
    return max(group._get_backend(device).options._timeout for device in group._device_types)


def __getattr__(name: str) -> type:
    if name in _FSDP_COMM_INTERFACES:
        from torch.distributed.fsdp._fully_shard import _fsdp_api

        return getattr(_fsdp_api, _FSDP_COMM_INTERFACES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
