"""``zeropp.initialize``: DeepSpeed's entry point — validate the config, build the engine and its optimizer."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm.process_group import init_distributed
from ..config import Config, ConfigError, load_config
from ..config.partition import (
    grouped_refusals,
    grouped_resident_refusals,
    mics_refusals,
    resident_refusals,
    resident_size,
)
from . import auto_partition
from .engine import ZeroEngine, compute_dtype
from .materialize import MetaInit, ParamInitFn, meta_state
from .policy import UnitPolicy


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Mapping[str, Any] | str | os.PathLike[str] | Config | None = None,
    mesh_param: Any = None,
    config_params: Mapping[str, Any] | str | os.PathLike[str] | Config | None = None,
    *,
    topology: comm.Topology | None = None,
    unit_policy: UnitPolicy | None = None,
    param_init_fn: ParamInitFn | None = None,
    init_seed: int = 0,
    device: torch.device | str | None = None,
    timeout: timedelta | None = None,
) -> tuple[ZeroEngine, Any, None, Any]:
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, None, lr_scheduler)`` like
    ``deepspeed.initialize`` (the same parameters, in the same order).

    Collective: every rank of the data-parallel group calls it with the same model structure and config. A model
    built eagerly: the first rank's initial weights are broadcast to the others. A model built on the meta device
    (``zeropp.Init`` or ``torch.device("meta")``): materialised unit by unit on every rank from ``init_seed``, the
    same values on every rank and at every world size, never the whole model at once
    (``zeropp.engine.materialize``).

    Args:
        args: an argparse namespace (``zeropp.add_config_arguments``); only its ``deepspeed_config`` (a JSON path)
            is read, or the deprecated ``deepscale_config`` (with a ``DeprecationWarning``), as DeepSpeed; giving it
            and ``config`` too is a ``ConfigError``.
        model: the model, on its device (or the meta device), every trainable parameter float32 or the config's
            compute dtype (bfloat16 with ``bf16.enabled``, float16 with ``fp16.enabled``); with bf16/fp16 it is
            cast in place to the compute dtype (``model.to``; a meta model's tensors after their initialisation),
            as DeepSpeed does.
        model_parameters: the parameters to optimize (default: every parameter that requires grad), or parameter
            groups (dicts with ``params`` and per-group hyperparameters). Freeze the others with
            ``requires_grad_(False)``.
        lr_scheduler: a learning-rate scheduler over the returned optimizer (an object with ``step()``; with
            ``state_dict``/``load_state_dict`` it is checkpointed), or a callable taking the optimizer and returning
            one, as DeepSpeed. The engine steps it after every applied optimizer step. Not together with the
            config's ``scheduler`` block (a ``ConfigError``). ``torch.optim.lr_scheduler`` classes work (the
            partitioned optimizer is a ``torch.optim.Optimizer`` for them), as do ``zeropp.engine.scheduler``'s.
        config: a dict, the path of a JSON file, or a ``Config`` (see ``zeropp.config``). It must have an
            ``optimizer`` block. ``config_params`` is DeepSpeed's older name for it.
        optimizer: DeepSpeed's client optimizer; not supported (must be None).
        training_data: DeepSpeed's client data; not supported (must be None).
        mpu: DeepSpeed's model-parallel unit; not supported (must be None).
        collate_fn: DeepSpeed's client collate function; not supported (must be None).
        mesh_param: DeepSpeed's device-mesh shape; not supported (must be None).
        distributed_port: passed to ``zeropp.init_distributed``, which initializes the default process group from
            torchrun's environment unless it already is (as DeepSpeed).
        dist_init_required: passed to ``zeropp.init_distributed`` as ``distributed_port`` is.
        topology: the data-parallel group and node layout (default: the world, ``comm.get_default_topology()``).
        unit_policy: which modules become units (default: each child of each outermost ``nn.ModuleList``;
            see ``zeropp.engine.policy``).
        param_init_fn: meta models: ``fn(module)`` initialises one module's own parameters and buffers in place
            (default: ``module.reset_parameters()``), FSDP's argument.
        init_seed: meta models: the seed the per-unit seeds derive from (``materialize.unit_seed``).
        device: meta models: where to materialise (default: the current CUDA device under NCCL, else the CPU).
        timeout: how long a collective on the node-local and cross-node groups waits before failing with an error
            naming it (default: the default process group's, i.e. ``init_process_group``'s timeout; see
            ``comm.Topology``). Applies to the default topology; with ``topology=``, give it to ``Topology``
            instead.

    Raises:
        ConfigError: a bad config, or a setting this engine does not implement yet; nothing is raised mid-run
            for configuration reasons.
    """
    if config is not None and config_params is not None:
        raise ConfigError("initialize got both config= and config_params= (its older name); pass one")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    if getattr(args, "deepscale_config", None) is not None:
        if from_args is not None:
            raise ConfigError("args has both deepscale_config and deepspeed_config; pass --deepspeed_config only")
        warnings.warn("--deepscale_config is deprecated, use --deepspeed_config", DeprecationWarning, stacklevel=2)
        from_args = args.deepscale_config
    if from_args is not None:
        if config is not None:
            raise ConfigError(f"initialize got a config both in args.deepspeed_config ({from_args!r}) and as config=; "
                              "pass one (as DeepSpeed)")
        config = from_args
    if config is None:
        raise ConfigError("initialize needs config=: a dict or the path of a JSON file (see zeropp.config)")
    for name, value, hint in (
        ("optimizer", optimizer, "set the config's optimizer block (AdamW, Adam, SGD or OneBitAdam)"),
        ("training_data", training_data, "build your own DataLoader over this rank's slice of the data"),
        ("collate_fn", collate_fn, "build your own DataLoader over this rank's slice of the data"),
        ("mpu", mpu, "model (tensor/pipeline) parallelism is not supported; zeropp is data-parallel"),
        ("mesh_param", mesh_param, "device meshes are not supported; pass topology= for the data-parallel layout"),
    ):
        if value is not None:
            raise ConfigError(f"initialize({name}=...) is not supported: {hint}")
    if model is None:
        raise TypeError("initialize needs model=: the nn.Module to train")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if topology is not None and timeout is not None:
        raise ValueError("initialize got topology= and timeout=; pass the timeout to comm.Topology(timeout=...)")
    topo = topology if topology is not None else comm.get_default_topology(timeout)
    cfg = auto_partition.resolve(load_config(config, world_size=topo.world_size), model, topo, unit_policy)
    _check_supported(cfg, topo)
    dtype = compute_dtype(cfg)
    allowed = {torch.float32, dtype}
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype not in allowed})
    if wrong:
        mode = {torch.bfloat16: "bf16.enabled", torch.float16: "fp16.enabled"}.get(dtype)
        what = f"the config computes in {dtype} ({mode})" if mode else "the config computes in torch.float32 " \
            "(neither bf16.enabled nor fp16.enabled)"
        raise ConfigError(f"the model has trainable parameters of dtype {', '.join(wrong)} but {what}; pass a "
                          f"float32 model (the engine casts it) or one in {dtype}, or change the config")
    meta = meta_state(model)
    if not meta and (param_init_fn is not None or device is not None):
        raise ConfigError("param_init_fn= and device= apply to a model built on the meta device (zeropp.Init()); "
                          "this model's parameters already have values: leave them out")
    meta_init = None
    if meta:
        if device is None:
            nccl = dist.get_backend(topo.group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        meta_init = MetaInit(seed=init_seed, param_init_fn=param_init_fn, device=torch.device(device))
    elif dtype != torch.float32:
        model.to(dtype)  # as DeepSpeed: every floating parameter and buffer, frozen ones included
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine = ZeroEngine(model, cfg, model_parameters, topology=topo, unit_policy=unit_policy,
                        lr_scheduler=lr_scheduler, meta_init=meta_init)
    return engine, engine.optimizer, None, engine.lr_scheduler


def _check_supported(cfg: Config, topo: comm.Topology) -> None:
    """Reject, at initialize, the valid settings this engine does not implement yet, and the ZeRO++ settings that
    do not fit the topology."""
    z = cfg.zero_optimization
    hpz, d = z.zero_hpz_partition_size, topo.ranks_per_node
    if hpz > 1 and d % hpz:
        divisors = [s for s in range(1, d + 1) if d % s == 0]
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size={hpz} must divide the ranks per node ({d} here: "
            f"{topo.num_nodes} node(s) of {d} ranks, set by ${comm.ENV_RANKS_PER_NODE} or the hosts); use one of "
            f"{divisors}")
    point = z.partition_point(topo.world_size, topo.ranks_per_node)
    _, grads, shards = point
    resident = resident_size(point, topo.world_size)
    grouped = shards < topo.world_size or 1 < grads < shards
    if resident:
        refused = resident_refusals(cfg, resident) + (grouped_resident_refusals(cfg, point) if grouped else [])
    else:
        refused = ([] if not grouped else mics_refusals(cfg, shards, d) if z.stage == 3
                   else grouped_refusals(cfg))
    if z.zeropp.weight_deltas and hpz <= 1 and not resident:  # "node" was the world: one node
        refused.append(f"zero_optimization.zeropp.weight_deltas: the partition {point} keeps no hpZ secondary on "
                       f"{topo.num_nodes} node(s) of {d} ranks; give zero_hpz_partition_size, parameters below the "
                       "world, or weight_deltas false")
    if refused:
        raise ConfigError("; ".join(refused))
    if cfg.optimizer is None:
        raise ConfigError("the config has no optimizer block; add e.g. "
                          '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}')
