"""Workers for tests/torchtitan: torchtitan's llama3 (its ``debugmodel`` config, cut to 2 layers, built on the
meta device), parallelized by torchtitan's own ``parallelize_fn`` over torchtitan's ``ParallelDims`` on the gloo
group ``comm_launch`` made, then trained a few steps with a plain torch optimizer, with and without zeropp.

What differs from torchtitan's ``Trainer`` (which cannot run on CPU, see ``zeropp.torchtitan``), and why:

* ``ParallelDims.build_mesh`` builds its meshes for ``torchtitan.tools.utils.device_type``, ``"cuda"`` on a
  machine without an accelerator; the meshes here are built with it set to ``"cpu"`` (gloo). Nothing else in
  torchtitan is replaced.
* The attention is ``ScaledDotProductAttention`` (causal, no mask) instead of ``FlexAttention``, whose
  ``torch.compile`` would cost the test a compile; the FSDP2 units and their parameters are the same.
* The data, loss (cross entropy, mean per rank) and optimizer (``torch.optim.AdamW``) are the test's; the model
  spec's ``post_optimizer_build_fn`` is called as ``Trainer.__init__`` calls it.
* The run without zeropp sets ``set_force_sum_reduction_for_comms(True)`` on its FSDP2 modules, as zeropp's hook
  does: torchtitan's gradient divide factor of 1 makes FSDP2 ask for a ``PREMUL_SUM(1.0)`` reduce-scatter, which
  gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); ``SUM`` with a post-division by 1 is the same sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

VOCAB = 2048  # the debugmodel's
SEQ, BATCH, LAYERS = 32, 2, 2
RUNS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "exact": {"weight_bits": None, "gradient_bits": None},
    "zeropp": {"weight_bits": 8, "gradient_bits": 4},
}


def _config(enable_kwargs: dict[str, Any] | None, steps: int) -> Any:
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    import zeropp.torchtitan

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:LAYERS]
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config = Trainer.Config(model_spec=spec, training=TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, steps=steps))
    if enable_kwargs is None:
        return dataclasses.replace(config, parallelism=ParallelismConfig(spmd_backend="partial_dtensor"))
    return zeropp.torchtitan.configure(config, **enable_kwargs)


def _parallel_dims(config: Any, world: int) -> Any:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims

    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    with mock.patch.object(parallel_dims_module, "device_type", "cpu"):
        parallel_dims.build_mesh()
    return parallel_dims


def _batches(rank: int, steps: int) -> list[Any]:
    """Arithmetic sequences mod ``VOCAB``, different on each rank."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 9, (BATCH, 1), generator=g)
        out.append((start + stride * torch.arange(SEQ + 1)) % VOCAB)
    return out


def _train(rank: int, world: int, enable_kwargs: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule

    from zeropp import comm

    config = _config(enable_kwargs, steps)
    spec = config.model_spec
    spec.model.update_from_config(config=config)
    parallel_dims = _parallel_dims(config, world)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint, dump_folder="unused")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(optimizer, [model], parallel_dims)
    else:
        for m in fsdp_modules:
            m.set_force_sum_reduction_for_comms(True)
    comm.reset_stats()
    losses = []
    for tokens in _batches(rank, steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "shards": {name: p.to_local().detach().clone() for name, p in model.named_parameters()},
        "stats": comm.stats(),
        "fsdp_modules": len(fsdp_modules),
        "fsdp_meshes": sorted({(p.device_mesh.ndim, p.device_mesh.size(), p.device_mesh.device_type)
                               for p in model.parameters()}),
    }


def llama3_debugmodel_zeropp() -> Any:
    """A config registry function as a user writes one (``--module torchtitan_workers --config
    llama3_debugmodel_zeropp``)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import zeropp.torchtitan

    return zeropp.torchtitan.configure(llama3_debugmodel(), weight_bits=8, gradient_bits=4)


def _command_line(*args: str) -> Any:
    """The config torchtitan's command-line parser (``torchtitan.train``'s) makes from ``llama3_debugmodel_zeropp``
    and ``args``."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "torchtitan_workers", "--config", "llama3_debugmodel_zeropp", *args])


def _refusals() -> dict[str, str]:
    """The messages ``zeropp.torchtitan`` raises for what it does not serve (no collective runs), and what
    torchtitan's command line makes of a config from ``configure``."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.trainer import Trainer

    import zeropp.torchtitan

    def message(call: Any) -> str:
        try:
            call()
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    hook = _config({}, 1).model_spec.post_optimizer_build_fn
    dims = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "world_size": 2,
            "spmd_backend": "partial_dtensor"}
    out = {
        name: message(lambda kw=kw: hook(None, [], ParallelDims(**{**dims, **kw})))
        for name, kw in {"hsdp": {"dp_replicate": 2}, "tp": {"tp": 2}, "pp": {"pp": 2}, "cp": {"cp": 2},
                         "spmd_types": {"dp_shard": 2, "spmd_backend": "spmd_types"}}.items()
    }
    out["bad_kwarg"] = message(lambda: _config({"bits": 8}, 1))
    config = _command_line()
    out["command_line"] = (config.model_spec.post_optimizer_build_fn.__qualname__, config.parallelism.spmd_backend,
                           config.training.disable_cuda_graphs)
    config = _command_line("--parallelism.spmd_backend", "spmd_types")
    out["command_line_spmd_types"] = message(
        lambda: config.model_spec.post_optimizer_build_fn(None, [], ParallelDims.from_config(config.parallelism, 2)))
    out["no_spec"] = message(lambda: zeropp.torchtitan.configure(Trainer.Config()))
    return out


def train(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Every run in ``RUNS`` from the same seed and data, and (rank 0) ``zeropp.torchtitan``'s refusals."""
    import torchtitan.trainer  # noqa: F401  (its imports register the "fake" backend ParallelDims' meshes use)

    out: dict[str, Any] = {name: _train(rank, world, kwargs, steps) for name, kwargs in RUNS.items()}
    if rank == 0:
        out["refusals"] = _refusals()
    return out
