"""Workers for test_host_syncs.py: count the host synchronizations zeropp's own code asks for in ``engine.step()``.

On CPU nothing synchronizes, so the count is of the calls that *would* wait for a GPU, made from zeropp's files
(every torch call is seen through a ``TorchFunctionMode``; the first frame outside torch names the caller):

* reading a tensor's value into Python: ``item``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``,
  ``tolist``, ``numpy``;
* copies to the host: ``cpu()``, and ``to(...)`` given an explicit device (on a GPU ``to(cuda)`` of a host tensor is
  a blocking copy from pageable memory, and this cannot tell the two directions apart on CPU);
* tensors made from Python data with an explicit device: ``torch.tensor(..., device=)``, ``as_tensor`` (a blocking
  host-to-device copy on a GPU).

Not seen: copies between devices by ``copy_`` (nothing in the engine's step does one), and the blocking waits of the
collectives themselves (a gloo ``wait()`` blocks the host by design; NCCL's does not). On CUDA the worker also counts
the synchronizations ``torch.cuda.set_sync_debug_mode("warn")`` reports.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from engine_workers import MODEL, text_batches
from torch.overrides import TorchFunctionMode

import zeropp
from zeropp.models import GPT

_TORCH_DIR = os.path.dirname(torch.__file__)
_ZEROPP_DIR = os.path.dirname(zeropp.__file__)
_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu"}


def _device_given(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:])


class HostSyncCounter(TorchFunctionMode):
    """Records ``(file:line, op)`` for each call of zeropp's code that would wait for a GPU (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "to" and _device_given(args, kwargs)) or (
            name in ("tensor", "as_tensor") and kwargs.get("device") is not None
        ):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(_ZEROPP_DIR):
                where = os.path.relpath(frame.f_code.co_filename, os.path.dirname(_ZEROPP_DIR))
                self.calls.append(f"{where}:{frame.f_lineno} {name}")
        return func(*args, **kwargs)


def count_step_syncs(rank: int, world: int, runs: dict[str, dict], device: str = "cpu", steps: int = 3) -> dict:
    """Train each run ``steps`` steps; per step the zeropp calls that would synchronize, in ``step()`` and (listed,
    not asserted) in ``backward()``; on CUDA also the synchronizations the sync debug mode reports in ``step()``."""
    dev = torch.device(device)
    out: dict[str, Any] = {}
    for name, run in runs.items():
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": run.get("clip", 0.0),
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                               "zero_optimization": {"stage": run["stage"], **run.get("zero", {})}}
        if run.get("fp16"):
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if run.get("bf16"):
            cfg["bf16"] = {"enabled": True}
        engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0).to(dev), config=cfg)
        record: dict[str, Any] = {"units": len(engine.units), "step": [], "backward": [], "cuda_step": []}
        for x, y in text_batches(steps, 2 * world):
            _, loss = engine(x[2 * rank : 2 * rank + 2].to(dev), y[2 * rank : 2 * rank + 2].to(dev))
            with HostSyncCounter() as counter:
                engine.backward(loss)
            record["backward"].append(counter.calls)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as counter:
                warnings.simplefilter("always")
                engine.step()
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                record["cuda_step"].append([str(w.message)[:120] for w in caught
                                            if "synchroniz" in str(w.message)])
            record["step"].append(counter.calls)
        record["norm"] = engine.get_global_grad_norm()
        out[name] = record
    return out
