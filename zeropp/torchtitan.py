"""ZeRO++ for torchtitan (``torchtitan.train``): one line in a config registry.

torchtitan builds its ``Trainer`` from a ``Trainer.Config`` that a config-registry function returns
(``--module <package> --config <function>``). ``configure`` returns that config with zeropp's comms on:

    # my_configs.py; run: torchrun --nproc_per_node=8 -m torchtitan.train --module my_configs --config llama3_8b_zeropp
    from torchtitan.models.llama3.config_registry import llama3_8b
    import zeropp.torchtitan

    def llama3_8b_zeropp():
        return zeropp.torchtitan.configure(llama3_8b(), weight_bits=8, gradient_bits=4)

The hook is the model spec's ``post_optimizer_build_fn``, which ``Trainer.__init__`` calls with the model parts
after ``parallelize_fn`` (torchtitan's ``fully_shard`` calls), the weights' initialization and the optimizer's
build, before the checkpoint load and the first forward: exactly where ``zeropp.fsdp.enable`` belongs. A model
spec's own ``post_optimizer_build_fn`` (the MoE models' load-balancing hook) still runs, first. Checkpoints are
unaffected (the weights and optimizer state stay FSDP2's DTensor shards).

What the hook does on each model part, and why:

* ``set_force_sum_reduction_for_comms(True)`` on every FSDP2 module: torchtitan's ``apply_fsdp_to_decoder`` sets
  a gradient divide factor of 1 (it scales the loss by the global token count itself), for which FSDP2 asks for a
  ``PREMUL_SUM(1.0)`` reduce-scatter that zeropp's reduce-scatter (and gloo) cannot serve; with force-sum FSDP2
  asks for ``SUM`` and divides by the factor, 1, itself: the same gradients.
* ``zeropp.fsdp.enable(part, **enable_kwargs)``.
* A forward pre-hook that raises inside a CUDA graph capture (see below).

What it refuses (``ValueError`` when the Trainer is built, naming the setting): a data-parallel layout other than
pure FSDP (``data_parallel_replicate_degree``, tensor, context, pipeline or expert parallel degrees above 1:
zeropp.fsdp serves a 1-D shard mesh only), and an ``spmd_backend`` other than ``partial_dtensor``.

What ``configure`` sets in the config it returns, and a command line may undo (the hook then refuses):

* ``parallelism.spmd_backend = "partial_dtensor"``: with torchtitan's default, ``spmd_types``, and more than one
  data-parallel rank, torchtitan hands ``fully_shard`` plain tensors with SPMD annotations and ``dp_mesh_dims``,
  which torch 2.13's FSDP2 refuses ("When dp_mesh_dims is provided, all parameters must be DTensors"; torchtitan
  0.3 is made for a torch nightly), on any device; ``partial_dtensor`` is torchtitan's plain ``fully_shard`` over
  the 1-D ``fsdp`` mesh, the path zeropp.fsdp serves.
* ``training.disable_cuda_graphs = True``: torchtitan captures forward and backward in a CUDA graph by default
  and replays only its kernels; zeropp's comms keep Python-side state (byte counts, error-feedback residuals,
  buffers) per call, which a replay would skip. Eager steps only.

hpZ (``hpz=N``) needs modules wrapped with ``fully_shard(..., reshard_after_forward=N)``; torchtitan's
``fsdp_reshard_after_forward`` policy passes a bool, so with N below the data-parallel size ``enable(hpz=N)``
refuses torchtitan's own ``parallelize_fn`` at the first forward ("FSDPEmbedding was wrapped with
fully_shard(..., reshard_after_forward=True ..."): hpZ needs a ``parallelize_fn`` of your own.

Running on CPU: torchtitan's Trainer cannot (torchtitan 0.3.0): ``torchtitan.tools.utils`` takes the device type
``"cuda"`` when no accelerator is found, and ``Trainer.__init__`` calls ``torch.cuda.set_device`` (AttributeError
``torch._C._cuda_setDevice`` on a CPU build of torch); ``ParallelDims.build_mesh`` likewise builds its meshes for
``"cuda"``. tests/torchtitan runs torchtitan's llama3 ``parallelize_fn`` and this hook on a 2-rank gloo CPU mesh
instead; bench/torchtitan_gpu.sh runs the real Trainer on GPUs (one GPU: the integration, with FSDP2 running no
collective; 8 GPUs: zeropp's comms on NCCL too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

try:
    from torchtitan.protocols.model_spec import ModelSpec
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "zeropp.torchtitan needs torchtitan, which is not installed: pip install 'zeropp[torchtitan]' "
        "(or pip install torchtitan)"
    ) from exc

from . import fsdp

__all__ = ["configure"]

# ParallelDims attributes that must be 1, and the torchtitan option that sets each
_REFUSED_DEGREES = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree (HSDP)",
    "tp": "parallelism.tensor_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
}


def configure(config: Any, **enable_kwargs: Any) -> Any:
    """A copy of torchtitan's ``Trainer.Config`` (or a subclass's) whose Trainer runs FSDP2 on zeropp's comms.

    Its keyword arguments are ``zeropp.fsdp.enable``'s (``weight_bits``, ``gradient_bits``, ``hpz``,
    ``block_size``, ``error_feedback``, ``gradient_rotation``, ``topology``, ``ranks_per_node``), checked now;
    ``enable`` runs on every rank in ``Trainer.__init__`` through the model spec's ``post_optimizer_build_fn``. The
    copy also sets ``parallelism.spmd_backend = "partial_dtensor"`` and ``training.disable_cuda_graphs = True`` (see
    the module docstring); ``config`` itself is not changed.

    Raises:
        TypeError: a keyword ``zeropp.fsdp.enable`` does not take.
        ValueError: a config without a model spec.
    """
    fsdp.check_enable_kwargs("zeropp.torchtitan.configure", enable_kwargs)
    spec = getattr(config, "model_spec", None)
    if not isinstance(spec, ModelSpec):
        raise ValueError(
            f"zeropp.torchtitan.configure needs a torchtitan Trainer.Config with a model_spec (what a config "
            f"registry function such as torchtitan.models.llama3.config_registry.llama3_8b() returns); got "
            f"{type(config).__name__} with model_spec={spec!r}"
        )
    hook = _post_optimizer_build_fn(spec.post_optimizer_build_fn, enable_kwargs)
    return dataclasses.replace(
        config,
        model_spec=dataclasses.replace(spec, post_optimizer_build_fn=hook),
        parallelism=dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor"),
        training=dataclasses.replace(config.training, disable_cuda_graphs=True),
    )


def _post_optimizer_build_fn(
    original: Callable[..., None] | None, enable_kwargs: dict[str, Any]
) -> Callable[..., None]:
    """The model spec's ``post_optimizer_build_fn(optimizers, model_parts, parallel_dims)`` with zeropp: runs
    ``original`` (if any), then turns zeropp's comms on in every model part."""

    def post_optimizer_build_fn(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any) -> None:
        if original is not None:
            original(optimizers, model_parts, parallel_dims)
        _check_parallel_dims(parallel_dims)
        for part in model_parts:
            fsdp_modules = [m for m in part.modules() if isinstance(m, FSDPModule)]
            if not fsdp_modules:
                raise ValueError(
                    f"zeropp.torchtitan: the model part {type(part).__name__} holds no FSDP2 module after "
                    "parallelize_fn; zeropp serves torchtitan's fully_shard data parallelism"
                )
            for m in fsdp_modules:
                m.set_force_sum_reduction_for_comms(True)
            fsdp.enable(part, **enable_kwargs)
            part.register_forward_pre_hook(_refuse_cuda_graph_capture)

    return post_optimizer_build_fn


def _check_parallel_dims(parallel_dims: Any) -> None:
    """Raise unless torchtitan's ``ParallelDims`` is pure FSDP (1-D shard mesh) on the ``partial_dtensor`` path."""
    over = [f"{option}={getattr(parallel_dims, attr)}" for attr, option in _REFUSED_DEGREES.items()
            if getattr(parallel_dims, attr) != 1]
    if over:
        raise ValueError(
            f"zeropp.torchtitan serves FSDP over a 1-D data-parallel shard mesh only; this run sets {', '.join(over)}."
            " Set those degrees to 1 (parallelism.data_parallel_shard_degree=-1 shards over all ranks); HSDP, tensor,"
            " context, pipeline and expert parallelism are not supported yet"
        )
    if parallel_dims.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"zeropp.torchtitan needs parallelism.spmd_backend=partial_dtensor (torchtitan's plain fully_shard), got "
            f"{parallel_dims.spmd_backend!r}: drop --parallelism.spmd_backend from the command line "
            "(zeropp.torchtitan.configure sets it)"
        )


def _refuse_cuda_graph_capture(module: nn.Module, args: Any) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "zeropp.torchtitan: the forward runs inside a CUDA graph capture, whose replays would skip zeropp's "
            "per-call state (byte counts, error-feedback residuals); drop --training.no_disable_cuda_graphs from the "
            "command line (zeropp.torchtitan.configure disables CUDA graphs)"
        )
