"""Worker of tests/test_torch_internals.py: a tiny FSDP2 model over a real gloo group, once with FSDP2's own comms
and once with custom comms built on ``zeropp._torch_internals``' interface classes, which record how FSDP2 calls
them (and run the same collectives FSDP2's defaults run, so both runs must agree bit for bit); and a
``fully_shard`` over two modules at once, for ``fsdp_group_modules``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from zeropp._torch_internals import FSDPAllGather, FSDPReduceScatter, fsdp_group_modules


class _Recording:
    """``allocate`` as FSDP2's default comms do it, keeping every buffer it handed out (so that no other tensor
    can reuse their memory and pass for one of them), and a record of each call."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.allocated: set[int] = set()  # the buffers' storage addresses
        self.calls: list[dict[str, Any]] = []
        self.phase = "forward"  # set by the worker around backward

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        t = torch.empty(*size, dtype=dtype, device=device)
        self.buffers.append(t)
        self.allocated.add(t.untyped_storage().data_ptr())
        return t

    def record(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
               **extra: Any) -> None:
        out_ptr = output_tensor.untyped_storage().data_ptr()
        self.calls.append({
            "phase": self.phase,
            "output_numel": output_tensor.numel(),
            "input_numel": input_tensor.numel(),
            "output_allocated": out_ptr in self.allocated,
            "input_allocated": input_tensor.untyped_storage().data_ptr() in self.allocated,
            "input_shares_output": input_tensor.untyped_storage().data_ptr() == out_ptr,
            "input_offset": input_tensor.storage_offset() - output_tensor.storage_offset(),
            "group_ranks": dist.get_process_group_ranks(group),
            **extra,
        })


class CountingAllGather(_Recording, FSDPAllGather):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self.record(output_tensor, input_tensor, group, async_op=async_op)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_Recording, FSDPReduceScatter):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp | dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        self.record(output_tensor, input_tensor, group, op=str(op), async_op=async_op)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def custom_comms(rank: int, world: int) -> dict[str, Any]:
    """Two ``fully_shard``-ed Linear layers under a ``fully_shard``-ed root (which holds no parameter): one step
    with FSDP2's comms, one with the recording comms installed on both layers, then one more with
    ``set_force_sum_reduction_for_comms(True)``. Returns the recorded calls and whether the two runs agree, and
    ``fsdp_group``'s record."""
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    def step(m: nn.Sequential, comms: Sequence[_Recording] = ()) -> tuple[float, list[torch.Tensor]]:
        loss = m(x).square().sum()
        for c in comms:
            c.phase = "backward"
        loss.backward()
        for c in comms:
            c.phase = "forward"
        grads = [p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        return loss.item(), grads

    plain_loss, plain_grads = step(model())
    m = model()
    all_gather, reduce_scatter = CountingAllGather(), CountingReduceScatter()
    for layer in (m[0], m[2]):
        layer.set_custom_all_gather(all_gather)
        layer.set_custom_reduce_scatter(reduce_scatter)
    loss, grads = step(m, (all_gather, reduce_scatter))
    same = loss == plain_loss and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    first = (list(all_gather.calls), list(reduce_scatter.calls))
    for layer in (m[0], m[2]):
        layer.set_force_sum_reduction_for_comms(True)
    step(m, (all_gather, reduce_scatter))
    return {
        "all_gather": first[0],
        "reduce_scatter": first[1],
        "force_sum_ops": [c["op"] for c in reduce_scatter.calls[len(first[1]):]],
        "same_as_plain": same,
        "group": fsdp_group(mesh),
    }


class _InputAllGather(FSDPAllGather):
    """FSDP2's default all-gather that keeps a copy of each input it is given."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self.inputs.append(input_tensor.clone())
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def fsdp_group(mesh: Any) -> dict[str, Any]:
    """``fully_shard([second, first])`` over two Linear layers of a Sequential (dims even: no padding on 2 ranks),
    then the root: what ``fsdp_group_modules`` says for each, and whether the group's one all-gather input is the
    second layer's weight and bias shards, then the first's (the order given to ``fully_shard``)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    fully_shard([m[2], m[0]], mesh=mesh)
    fully_shard(m, mesh=mesh)
    gather = _InputAllGather()
    m[0].set_custom_all_gather(gather)
    with torch.no_grad():
        m(torch.randn(3, 4))
    want = torch.cat([p.to_local().reshape(-1) for p in (m[2].weight, m[2].bias, m[0].weight, m[0].bias)])
    return {
        "first": [id(x) for x in fsdp_group_modules(m[0])],
        "second": [id(x) for x in fsdp_group_modules(m[2])],
        "root": [id(x) for x in fsdp_group_modules(m)],
        "want": [id(m[2]), id(m[0])],
        "want_root": [id(m)],
        "input_order": len(gather.inputs) == 1 and torch.equal(gather.inputs[0], want),
    }
