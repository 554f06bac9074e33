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
* ``fsdp_hsdp_mesh`` / ``route_hsdp_all_reduce`` / ``fsdp_requires_all_reduce`` / ``fsdp_all_reduce_hook``:
  ``FSDPModule._get_fsdp_state()._fsdp_param_groups`` and each group's ``mesh_info`` (``HSDPMeshInfo`` /
  ``FSDPMeshInfo`` of ``torch.distributed.fsdp._fully_shard._fsdp_common``), ``all_reduce_grads`` and
  ``_all_reduce_hook`` (nothing public reads the hook back, so a user's hook would be replaced unseen). FSDP2 runs HSDP's cross-replica
  gradient all-reduce as a plain ``dist.all_reduce`` inside ``foreach_reduce``, with no custom-comm hook (its
  public ``set_all_reduce_hook`` runs AFTER that all-reduce under native HSDP, and a custom all-gather or
  reduce-scatter only sees the shard group). Nothing public says whether a module is natively HSDP-sharded, over
  which mesh dims, or lets that all-reduce be replaced. ``zeropp.fsdp.hsdp`` gives each group a plain
  ``FSDPMeshInfo`` of the same mesh and dims: FSDP2 then reduce-scatters over the shard dim as before, passes no
  all-reduce group, and runs the public ``set_all_reduce_hook`` right after the reduce-scatter (its "custom HSDP"
  path), where zeropp's all-reduce over the replicate dim takes over. The parameters keep their own mesh info,
  so their DTensors (and checkpoints) stay ``(Replicate(), Shard(0))`` on the 2-D mesh.
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

__all__ = ["FSDPAllGather", "FSDPReduceScatter", "fsdp_all_reduce_hook", "fsdp_group_modules", "fsdp_hsdp_mesh",
           "fsdp_requires_all_reduce", "group_timeout", "in_backward", "route_hsdp_all_reduce", "tree_leaves"]

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


def fsdp_hsdp_mesh(module: Any) -> list[tuple[Any, int, int, bool] | None]:
    """Per FSDP2 parameter group of ``module``'s state: ``(mesh, shard_dim, replicate_dim, spmd)`` when FSDP2 runs
    native HSDP on it (``spmd``: the mesh was given with ``dp_mesh_dims``), else ``None``."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    out: list[tuple[Any, int, int, bool] | None] = []
    for group in module._get_fsdp_state()._fsdp_param_groups:
        info = group.mesh_info
        if isinstance(info, HSDPMeshInfo):
            out.append((info.mesh, info.shard_mesh_dim, info.replicate_mesh_dim, info.is_spmd_mesh))
        else:
            out.append(None)
    return out


def route_hsdp_all_reduce(module: Any) -> None:
    """Make FSDP2 skip its native HSDP all-reduce for every parameter group of ``module``'s state and run the
    group's ``set_all_reduce_hook`` hook right after the reduce-scatter instead: each group's ``HSDPMeshInfo`` is
    replaced by an ``FSDPMeshInfo`` of the same mesh and dims (a dedicated reduce-scatter group kept; so is the
    post-forward mesh info where it is that same object, ``reshard_after_forward=True``). Groups
    without native HSDP are left alone."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    for group in module._get_fsdp_state()._fsdp_param_groups:
        info = group.mesh_info
        if isinstance(info, HSDPMeshInfo):
            plain = FSDPMeshInfo(info.mesh, shard_mesh_dim=info.shard_mesh_dim,
                                 replicate_mesh_dim=info.replicate_mesh_dim, dp_mesh_dims=info.dp_mesh_dims,
                                 spmd_mesh=info.spmd_mesh)
            plain.reduce_scatter_process_group = info.reduce_scatter_process_group
            if group.post_forward_mesh_info is info:  # reshard_after_forward=True: resharded to the shard group
                group.post_forward_mesh_info = plain
            group.mesh_info = plain


def fsdp_all_reduce_hook(module: Any) -> Any:
    """The hook ``FSDPModule.set_all_reduce_hook`` set on ``module``'s parameter group (``None`` if none; that
    method only sets it)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return groups[0]._all_reduce_hook if groups else None


def fsdp_requires_all_reduce(module: Any) -> bool:
    """Whether FSDP2 would all-reduce ``module``'s gradients across replicas this backward
    (``FSDPModule.set_requires_all_reduce``, which only sets it)."""
    return all(group.all_reduce_grads for group in module._get_fsdp_state()._fsdp_param_groups)


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
