"""The collectives on a device against the torch reference on CPU, bit for bit, with async calls interleaved and
waits from a side stream (run by ``test_comm_cuda.py`` through ``comm_launch.launch``).

Every rank runs the same code on ``device``: ``"cuda"`` (every rank on ``cuda:0`` — gloo on CUDA tensors of ONE GPU,
since NCCL refuses two ranks on one GPU — with the Triton kernels) or ``"cpu"`` (the same logic with CPU tensors, so
CI exercises the test itself; on CPU there are no streams and the stream steps are no-ops).

1. Reference: every case (qwZ all-gathers, hpZ all-gathers inside the node, qgZ and exact reduce-scatters, qgZ
   with error feedback) synchronously on CPU copies of the inputs with ``ZEROPP_QUANT_BACKEND=torch``.
2. Interleaved: all cases issued ``async_op=True`` on ``device`` and waited on the issuing stream in the issue order
   (every rank must), with further calls issued between the waits.
3. Side stream: the all-gathers (then the qgZ reduce-scatters) issued on the current stream; then, on a side
   stream kept busy first (~0.1 s of matmuls), each ``wait()``ed and its output copied there; the inputs, outputs
   and handles dropped; and at once, on the issuing stream, new buffers of the sizes of the outputs and temporaries
   allocated and filled with 0xFF bytes (NaN scales and values) while the side stream is still busy (reported in
   ``window_open``); then the copies checked. Without ``CollectiveWork``'s stream rule the allocator would hand the
   freed buffers to the fill before the side stream's dequantize kernels read them. (qgZ's ``wait()`` issues hop 2
   from the side stream and gloo copies its send buffer after the side stream's work, so the host catches up with
   the side stream there: for qgZ this checks the results and the output's use on the side stream.) A second
   ``wait()``, from the issuing stream, returns the same tensor, ordered after the side stream.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from comm_workers import make_input

from zeropp import comm
from zeropp.comm import ReduceOp, Topology
from zeropp.quant import BlockFormat, backend_name

D = 2  # ranks per emulated node


def _cases(topo: Topology, scale: int) -> list[dict[str, Any]]:
    """The collectives to compare: name, kind, input dtype and numel, keyword arguments."""
    n_ag = 1000 * scale + 37  # not a multiple of any block: padded last block
    n_rs = 4 * 256 * scale + 5  # not a multiple of the world size: short last slice
    return [
        {"name": "qwz8-bf16", "kind": "ag", "dtype": torch.bfloat16, "numel": n_ag, "kw": {"bits": 8}},
        {"name": "qwz4-fp16-to-fp32", "kind": "ag", "dtype": torch.float16, "numel": n_ag,
         "kw": {"bits": 4, "block_size": 64}, "out_dtype": torch.float32},
        {"name": "qwz8-fp32", "kind": "ag", "dtype": torch.float32, "numel": n_ag + 128, "kw": {"bits": 8}},
        {"name": "hpz-exact-bf16", "kind": "ag", "dtype": torch.bfloat16, "numel": n_ag,
         "kw": {"bits": None, "group": topo.partition_group(D)}},
        {"name": "hpz-q8-fp16", "kind": "ag", "dtype": torch.float16, "numel": n_ag,
         "kw": {"bits": 8, "group": topo.intra_group}},
        {"name": "exact-ag-fp32", "kind": "ag", "dtype": torch.float32, "numel": n_ag, "kw": {"bits": None}},
        {"name": "qgz4-bf16-avg", "kind": "rs", "dtype": torch.bfloat16, "numel": n_rs, "kw": {"bits": 4}},
        {"name": "qgz8-fp32-sum", "kind": "rs", "dtype": torch.float32, "numel": n_rs,
         "kw": {"bits": 8, "op": ReduceOp.SUM, "block_size": 64}},
        {"name": "qgz4-fp16-to-fp32", "kind": "rs", "dtype": torch.float16, "numel": n_rs + 256,
         "kw": {"bits": 4}, "out_dtype": torch.float32},
        {"name": "exact-rs-fp32", "kind": "rs", "dtype": torch.float32, "numel": n_rs, "kw": {"bits": None}},
        # two reductions of one buffer with error feedback: the second depends on the residuals of the first
        {"name": "qgz4-ef-1", "kind": "rs", "dtype": torch.float32, "numel": n_rs, "kw": {"bits": 4}, "ef": "a"},
        {"name": "qgz4-ef-2", "kind": "rs", "dtype": torch.float32, "numel": n_rs, "kw": {"bits": 4}, "ef": "a"},
    ]


# the cases waited on a side stream: the quantized ones without state carried from call to call (an ErrorFeedback
# is updated on the issuing stream and on the waiting stream, see CollectiveWork), and the exact hpZ gather
SIDE = ("qwz8-bf16", "qwz4-fp16-to-fp32", "hpz-exact-bf16", "hpz-q8-fp16", "qgz4-bf16-avg", "qgz8-fp32-sum",
        "qgz4-fp16-to-fp32")


def _issue(case: dict[str, Any], x: torch.Tensor, topo: Topology, efs: dict[str, comm.ErrorFeedback],
           async_op: bool) -> Any:
    kw = dict(case["kw"])
    out = None
    if case["kind"] == "ag":
        size = dist.get_world_size(kw.get("group", topo.group))
        if "out_dtype" in case:
            out = torch.empty(size * x.numel(), dtype=case["out_dtype"], device=x.device)
        return comm.all_gather(x, topology=topo, out=out, async_op=async_op, **kw)
    start, stop = comm.shard_range(x.numel(), topo.world_size, topo.rank)
    if "out_dtype" in case:
        out = torch.empty(stop - start, dtype=case["out_dtype"], device=x.device)
    ef = efs.setdefault(case["ef"], comm.ErrorFeedback()) if "ef" in case else None
    return comm.reduce_scatter(x, topology=topo, out=out, async_op=async_op, error_feedback=ef, **kw)


def _buffer_sizes(cases: list[dict[str, Any]], world: int) -> list[int]:
    """Byte sizes of the buffers the cases allocate: outputs, packs, gathered packs, qgZ send/receive buffers."""
    sizes = []
    for c in cases:
        bits = c["kw"].get("bits")
        out_item = torch.empty(0, dtype=c.get("out_dtype", c["dtype"])).element_size()
        if c["kind"] == "ag":
            size = D if "group" in c["kw"] else world
            sizes.append(size * c["numel"] * out_item)
            if bits is not None:
                pack = BlockFormat(bits, c["kw"].get("block_size", 128)).packed_bytes(c["numel"])
                sizes += [pack, size * pack]
        else:
            s = -(-c["numel"] // world)
            sizes.append(s * out_item)
            if bits is not None:
                pack = BlockFormat(bits, c["kw"].get("block_size", 128)).packed_bytes(s)
                sizes += [world * pack, world * pack, (world // D) * pack, (world // D) * pack]
    return sizes


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        bad = int((diff > 0).sum()) + int(got.isnan().sum())
        raise AssertionError(f"{name}: {bad} of {got.numel()} elements differ from the CPU reference (max "
                             f"|diff| {float(diff.nan_to_num(float('inf')).max())})")


def device_vs_reference(rank: int, world: int, device: str, backend: str, scale: int) -> dict[str, Any]:
    """See the module docstring. ``backend``: ``ZEROPP_QUANT_BACKEND`` for the device runs (``"auto"``: Triton on
    CUDA tensors); ``scale`` sets the sizes (elements ~ 1000 * scale)."""
    assert world == 2 * D, "2 emulated nodes of 2 ranks"
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    topo = Topology(ranks_per_node=D)
    assert topo.num_nodes == 2 and topo.intra_group is topo.partition_group(D)
    cases = _cases(topo, scale)
    by_name = {c["name"]: c for c in cases}
    inputs = {c["name"]: make_input(rank, c["numel"], c["dtype"], 31 + i) for i, c in enumerate(cases)}

    # 1. the reference: torch backend, CPU, synchronous
    os.environ["ZEROPP_QUANT_BACKEND"] = "torch"
    efs: dict[str, comm.ErrorFeedback] = {}
    ref = {c["name"]: _issue(c, inputs[c["name"]], topo, efs, async_op=False) for c in cases}
    os.environ["ZEROPP_QUANT_BACKEND"] = backend
    probe = torch.zeros(1, device=dev)
    expected_backend = "triton" if dev.type == "cuda" else backend
    assert backend_name(probe) == expected_backend, (backend_name(probe), expected_backend)

    # 2. interleaved: issue a few, wait the oldest, issue more, ... (every rank in the same order)
    efs = {}
    handles: list[tuple[str, comm.CollectiveWork]] = []
    done: dict[str, torch.Tensor] = {}
    for i, c in enumerate(cases):
        x = inputs[c["name"]].to(dev)
        handles.append((c["name"], _issue(c, x, topo, efs, async_op=True)))
        if i % 3 == 2:  # keep two in flight
            name, work = handles.pop(0)
            done[name] = work.wait()
    for name, work in handles:
        done[name] = work.wait()
        assert work.is_completed() and work.wait() is done[name]
    for name, got in done.items():
        _check(f"interleaved {name}", got, ref[name])
    del done, handles

    # 3. waits from a side stream kept busy, then everything dropped and its memory refilled on the issuing stream
    # (module docstring): the all-gathers, whose wait() does not block the host on the side stream, then qgZ
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    on_side: Callable[[], Any] = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
    snapshots: dict[str, torch.Tensor] = {}
    window_open: dict[str, bool] = {}
    kept = None
    for kind in ("ag", "rs"):
        group = [by_name[n] for n in SIDE if by_name[n]["kind"] == kind]
        issued = [(c["name"], _issue(c, inputs[c["name"]].to(dev), topo, {}, async_op=True)) for c in group]
        busy_done = None
        with on_side():
            if side is not None:  # ~0.1 s of matmuls first, so the side stream's own kernels run late
                busy = torch.randn(4096, 4096, device=dev)
                for _ in range(40):
                    busy = busy @ busy
                    busy = busy / busy.abs().amax()
                busy_done = torch.cuda.Event()
                busy_done.record(side)
            for name, work in issued:
                snapshots[name] = work.wait().clone()  # the output, used on the waiting stream
        if kept is None:
            kept = issued[0]  # for a second wait() below
        del issued
        # every byte 0xFF: NaN as a float32 scale or value, -1 as codes
        junk = [torch.full((n,), 0xFF, dtype=torch.uint8, device=dev) for n in _buffer_sizes(group, world)]
        if busy_done is not None:
            window_open[kind] = not busy_done.query()  # the fill was queued while the side stream still worked
            torch.cuda.synchronize(dev)
        del junk
    for name, got in snapshots.items():
        _check(f"side-stream {name}", got, ref[name])
    # a second wait(), from the issuing stream, returns the same tensor (ordered after the side stream's work)
    again_name, again_work = kept
    _check(f"second wait {again_name}", again_work.wait().clone(), ref[again_name])
    return {"cases": sorted(ref), "side": sorted(snapshots), "backend": expected_backend, "window_open": window_open}
