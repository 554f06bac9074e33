"""zeropp.fsdp on a device against plain FSDP2 on CPU (run by ``test_fsdp_cuda.py`` through ``fsdp_launch.launch``).

Every rank runs the same code on ``device``: ``"cuda"`` (every rank on ``cuda:0`` over the gloo default group —
NCCL refuses two ranks on one GPU — with the Triton kernels for CUDA tensors) or ``"cpu"`` (the same logic on CPU
tensors, so CI exercises the test itself).

The tiny GPT, float32, ``STEPS`` SGD steps on the same rank-specific random bytes in every run:

1. Reference: plain FSDP2 (torch's own collectives, no zeropp code) on a CPU mesh. Not on ``device``: plain FSDP2
   on CUDA tensors over gloo would rest on gloo's ``reduce_scatter_tensor`` with ``ReduceOp.AVG`` for CUDA tensors,
   which is gloo's business rather than ours and could not be tried where this was written; CPU is the reference
   that runs everywhere.
2. zeropp's exact comms and full ZeRO++ (qwZ int8 + qgZ int4 + hpZ: blocks wrapped with
   ``reshard_after_forward=2``, ``enable(hpz=2)``), on CPU and again on ``device`` (on CPU: twice, the same code).

Checks (raised here, naming the run): exact comms on CPU are bit-identical to the reference (losses and every
rank's parameter shards). On ``device``: bit-identical too when it is the CPU; on CUDA, the same arithmetic on other
kernels (cuBLAS, CUDA softmax and reductions round differently from the CPU's; TF32 is off), so the losses agree to
``1e-5`` relative and the shards to ``1e-3`` of how far the reference moved them — SGD keeps those differences
proportional to the gradients' (AdamW would turn a gradient near zero into a full ``lr`` step of either sign).
Full ZeRO++ stays within 2% of the reference's losses on both, and differs from it (the quantized path ran). The
byte counters (``zeropp.comm.stats()``) of each configuration are equal on CPU and on ``device``: what is counted
does not depend on where the tensors live.
"""

from __future__ import annotations

from typing import Any

import torch
from hpz_workers import HPZ, _model
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import zeropp.fsdp
from zeropp import comm
from zeropp.models import GPT
from zeropp.quant import backend_name

STEPS, BATCH, SEQ, LR = 3, 2, 32, 0.1
LOSS_RTOL = 1e-5  # CUDA against CPU, exact comms: relative, per step
PARAM_RTOL = 1e-3  # CUDA against CPU, exact comms: of the largest change the reference made to the shard
QUANT_RTOL = 0.02  # full ZeRO++ against the reference, per step


def _train(model: GPT, rank: int, dev: torch.device) -> dict[str, Any]:
    """``STEPS`` SGD steps on random bytes (rank-specific, the same in every run): this rank's losses, its
    parameter shards before and after (copied to CPU, by name), the byte counters of the steps and the device the
    shards live on (checked to be ``dev``)."""
    local = dict(model.named_parameters())
    for name, p in local.items():
        assert isinstance(p, DTensor) and p.to_local().device == dev, (name, p.to_local().device, dev)
    before = {name: p.to_local().detach().cpu().clone() for name, p in local.items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    comm.reset_stats()
    for _ in range(STEPS):
        idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen).to(dev)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    after = {name: p.to_local().detach().cpu().clone() for name, p in local.items()}
    return {"losses": losses, "before": before, "after": after, "stats": comm.stats(), "device": str(dev)}


def _zeropp_runs(mesh: DeviceMesh, rank: int, dev: torch.device) -> dict[str, dict[str, Any]]:
    """Exact comms (every module resharded over the whole group) and full ZeRO++ with hpZ on ``mesh``."""
    exact = _model(mesh, True)
    zeropp.fsdp.enable(exact, weight_bits=None, gradient_bits=None)
    full = _model(mesh, HPZ)
    zeropp.fsdp.enable(full, weight_bits=8, gradient_bits=4, hpz=HPZ)
    return {"exact": _train(exact, rank, dev), "zeropp_hpz": _train(full, rank, dev)}


def _check_exact(where: str, run: dict[str, Any], ref: dict[str, Any], bitwise: bool) -> None:
    if bitwise:
        assert run["losses"] == ref["losses"], (where, run["losses"], ref["losses"])
        for name, want in ref["after"].items():
            assert torch.equal(run["after"][name], want), (where, name)
        return
    for got, want in zip(run["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (where, run["losses"], ref["losses"])
    for name, want in ref["after"].items():
        moved = float((want - ref["before"][name]).abs().max())
        diff = float((run["after"][name] - want).abs().max())
        assert diff <= PARAM_RTOL * moved, f"{where} {name}: max |diff| {diff:.3e} against a change of {moved:.3e}"


def _check_quantized(where: str, run: dict[str, Any], ref: dict[str, Any]) -> None:
    assert run["losses"] != ref["losses"], (where, "the quantized path did not change the losses")
    for got, want in zip(run["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= QUANT_RTOL * want, (where, run["losses"], ref["losses"])


def device_vs_reference(rank: int, world: int, device: str) -> dict[str, Any]:
    """See the module docstring. Returns the losses and byte counters of every run, the quantization backend
    zeropp used for ``device``'s tensors and the device the parameters lived on."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before the mesh: init_device_mesh keeps a device already chosen
        torch.set_float32_matmul_precision("highest")  # no TF32: the tolerances above assume float32 matmuls
    probe = torch.zeros(1, device=dev)  # initialises CUDA on cuda:0 before the mesh is made
    cpu = torch.device("cpu")
    cpu_mesh = init_device_mesh("cpu", (world,))
    ref = _train(_model(cpu_mesh, True), rank, cpu)
    on_cpu = _zeropp_runs(cpu_mesh, rank, cpu)
    on_dev = _zeropp_runs(init_device_mesh(dev.type, (world,)), rank, dev)

    _check_exact("exact comms, CPU run", on_cpu["exact"], ref, bitwise=True)
    _check_exact(f"exact comms, {dev} run", on_dev["exact"], ref, bitwise=dev.type == "cpu")
    for where, runs in (("CPU", on_cpu), (str(dev), on_dev)):
        _check_quantized(f"qwZ int8 + qgZ int4 + hpZ, {where} run", runs["zeropp_hpz"], ref)
    for name in ("exact", "zeropp_hpz"):
        assert on_dev[name]["stats"] == on_cpu[name]["stats"], (name, on_dev[name]["stats"], on_cpu[name]["stats"])
    moved = max(float((ref["after"][n] - ref["before"][n]).abs().max()) for n in ref["after"])
    return {
        "backend": backend_name(probe),
        "param_device": on_dev["exact"]["device"],
        "moved": moved,
        "losses": {"plain_cpu": ref["losses"], **{f"{k}_cpu": v["losses"] for k, v in on_cpu.items()},
                   **{f"{k}_{dev.type}": v["losses"] for k, v in on_dev.items()}},
        "stats": {f"{k}_{dev.type}": v["stats"] for k, v in on_dev.items()},
    }
