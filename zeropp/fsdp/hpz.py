"""hpZ for FSDP2: ``fully_shard(..., reshard_after_forward=N)`` is ZeRO++'s secondary partition; ``enable(hpz=N)``
checks that the modules were wrapped that way and that FSDP2's post-forward groups stay inside a node.

How FSDP2 (torch 2.13) does it, read from ``torch/distributed/fsdp/_fully_shard``:

* The int is honoured only by ``fully_shard``: the public ``FSDPModule.set_reshard_after_forward`` takes a bool
  (and would replace the int), so zeropp cannot set it afterwards; it checks instead (``install_check``).
* ``fully_shard`` builds the post-forward mesh from the module's 1-D mesh as ``DeviceMesh(mesh.mesh.view(-1, N))``:
  the post-forward group of a rank is the run of ``N`` ranks at mesh positions ``[k * N, (k + 1) * N)`` holding
  it (a new mesh, and new process groups, per ``fully_shard`` call). ``N`` equal to the mesh size means ``True``
  (the shard group), ``1`` means ``False``. A root module whose ``reshard_after_forward`` is left unset is not
  resharded after forward at all (FSDP2 keeps its parameters gathered for backward).
* After forward each rank keeps the slice ``[r * n / N, (r + 1) * n / N)`` (``r`` its position in the run) of every
  gathered parameter, cloned from the all-gather output: with qwZ, of the DEQUANTIZED weights forward used. The
  backward all-gather runs over the post-forward group on those slices; ``ZeroppAllGather`` runs it exact, so
  backward computes with the forward weights bit for bit, and the bytes are counted per node of the shard group's
  topology (inside a node: all intra-node).
* torch creates the post-forward groups with ``new_group``'s default timeout (the backend's: 30 minutes for gloo),
  not ``init_process_group``'s; ``ZeroppAllGather`` runs the backward gathers over ``Topology.subgroup`` of the
  same ranks instead, which waits the topology's timeout (``enable(hpz=N)`` creates it; without ``hpz`` it is
  created at the first backward gather).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import comm
from .segments import managed_parameters


def check_hpz(hpz: int, mesh: DeviceMesh, topology: comm.Topology) -> None:
    """Raise unless ``hpz`` divides the ranks per node and every post-forward group FSDP2 builds from ``mesh``
    (runs of ``hpz`` consecutive mesh positions) lies inside one node of ``topology``."""
    d = topology.ranks_per_node
    if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 2 or d % hpz:
        choices = [s for s in range(2, d + 1) if d % s == 0]
        raise ValueError(
            f"hpz={hpz!r} must be an integer >= 2 dividing the ranks per node ({d}), so that the backward "
            f"all-gathers stay inside a node; use one of {choices or 'none (one rank per node: hpZ has nothing to do)'} "
            "and pass the same value as fully_shard(..., reshard_after_forward=hpz)"
        )
    order = mesh.mesh.flatten().tolist()
    for k in range(0, len(order), hpz):
        run = order[k : k + hpz]
        nodes = {topology.node_of(r) for r in run}
        if len(nodes) > 1:
            raise ValueError(
                f"FSDP2 would reshard after forward to ranks {run} (positions {k}..{k + hpz - 1} of the mesh "
                f"{order}), which span nodes {sorted(nodes)} of the topology {topology.nodes}; build the mesh with "
                "each node's ranks at consecutive positions (init_device_mesh over node-contiguous ranks)"
            )


def install_check(groups: list[tuple[nn.Module, ...]], hpz: int) -> None:
    """Check, once per module of each FSDP2 group (``zeropp.fsdp.segments.fsdp_group``), right after FSDP2's
    post-forward reshard (a forward hook registered after FSDP2's), that the group resharded to groups of ``hpz``
    ranks or not at all; raise at the first forward otherwise.

    The check reads the parameters FSDP2 sets on the group's modules after resharding (public
    ``DTensor.device_mesh``): a post-forward DTensor lives on the ``(P / N, N)`` mesh, a fully resharded one on the
    1-D mesh of ``P``, an unresharded parameter is a plain tensor. For a group of several modules
    (``fully_shard([a, b])``) FSDP2 reshards after the last of them has run forward, so the modules that run before
    see plain tensors and pass, and the last one checks; it never raises wrongly.
    """
    for group in groups:
        params = [(owner, name) for owner, name, _ in managed_parameters(group[0])]
        for module in group:
            handles: list[Any] = []

            def check(mod: nn.Module, args: Any, output: Any, params: list[tuple[nn.Module, str]] = params,
                      handles: list[Any] = handles) -> None:
                handles.pop().remove()
                for owner, name in params:
                    p = getattr(owner, name)
                    if isinstance(p, DTensor) and p.device_mesh.shape[-1] != hpz:
                        size = p.device_mesh.shape[-1]
                        wrapped = "True (the whole shard group)" if p.device_mesh.ndim == 1 else str(size)
                        raise ValueError(
                            f"zeropp.fsdp.enable(hpz={hpz}): {type(mod).__name__} was wrapped with "
                            f"fully_shard(..., reshard_after_forward={wrapped}), so its backward all-gathers run "
                            f"over {size} ranks; pass reshard_after_forward={hpz} to fully_shard for every module "
                            "but the root (or enable with hpz=None)"
                        )

            handles.append(module.register_forward_hook(check))
