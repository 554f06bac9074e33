"""``ZeroEngine``: ZeRO stages 1, 2 and 3 over units of flat sharded parameters (see ``zeropp.initialize``).

The engine DeepSpeed training scripts expect (every rank runs the same calls), so that ZeRO++'s quantized weight
gather (qwZ), hierarchical secondary shard (hpZ) and quantized gradient reduce-scatter (qgZ) can be used from them::

    engine, optimizer, _, lr_scheduler = zeropp.initialize(model=model, model_parameters=model.parameters(),
                                                           config=cfg)
    for batch in micro_batches:              # train_micro_batch_size_per_gpu samples on this rank
        loss = engine(batch)                 # the model's forward; returns what the model returns
        engine.backward(loss)                # loss / gradient_accumulation_steps, then backward
        engine.step()                        # steps the optimizer every gradient_accumulation_steps micro-batches

This file holds the loop (forward, backward, gradient buckets, the step with its one all-reduce of the norm and
the Inf/NaN flags) and DeepSpeed's engine API; units, hooks, prefetch, reuse, offload and checkpoints live in the
sibling modules. What each stage keeps, the buffers and their dtypes, mixed precision and loss scaling, overlap,
non-finite gradients, frozen parameters, whole-parameter access and checkpoints: docs/engine.md.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..config import Config, ConfigError
from ..config.partition import resident_size
from ..offload import SwapError
from . import checkpoint, gathered, host_memory, placement, reuse
from .collectives import Collectives
from .entry_check import EngineUsageError, EntryCheck
from .gathered import StateDictGathering
from .hooks import GradientReadiness, install_entry_hooks, install_stage3_hooks
from .loss_scaler import LossScaler
from .monitor import Monitor
from .onebit import OneBitAdam
from .partition import partition_groups
from .materialize import Materializer, MetaInit
from .offload import OffloadError, OptimizerOffload
from .optimizer import PartitionedOptimizer, state_kinds
from .param_offload import ParamOffload
from .policy import UnitPolicy, plan_units
from .rules import split_plans
from .prefetch import Prefetcher
from .scheduler import build_scheduler
from .unit import GradientReduction, ReduceBuffers, Unit, flat_layout, gather_bucketed, moved, reduce_bucketed
from .weight_deltas import WeightDeltas


class NonFiniteGradientError(FloatingPointError):
    """fp32/bf16 with ``zero_optimization.zeropp.nonfinite_gradients: "raise"``: a step's gradients held an Inf or
    NaN. Raised by ``step()`` on every rank with the same message, naming the units; the step was skipped first (as
    with ``"skip"``), so the engine is consistent and may go on with the next batch (or load a checkpoint)."""


class ZeroEngine:
    """A model wrapped for ZeRO training. Build it with ``zeropp.initialize``.

    Attributes:
        module: the wrapped model (its parameters are views into the units' buffers).
        config: the validated ``Config``.
        optimizer: the ``PartitionedOptimizer``.
        units: the ``Unit`` list, the root unit first.
        micro_steps: micro-batches stepped so far; ``global_steps``: accumulation boundaries so far (optimizer
            steps taken or skipped); ``skipped_steps``: those skipped for an Inf/NaN gradient (fp16: an overflow);
            ``overflow``: whether the last boundary's gradients held an Inf/NaN (and its step was skipped);
            ``loss_scale``: the fp16 loss scale (1.0 otherwise).
    """

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        model_parameters: Iterable[Any],
        *,
        topology: comm.Topology,
        unit_policy: UnitPolicy | None = None,
        lr_scheduler: Any = None,
        meta_init: MetaInit | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.topology = topology
        zero = config.zero_optimization
        self.stage = zero.stage
        point = zero.partition_point(topology.world_size, topology.ranks_per_node)
        resident = resident_size(point, topology.world_size)
        self.mics = partition_groups(topology, point)
        """The grouped points (MiCS at stage 3, ``(1, 1, k)`` / ``(1, k, k)`` at stages 1 / 2, ``(1, g, o)`` at
        stage 2, the grouped resident points ``(p, g, o)`` at stage 3; ``zeropp.engine.partition``): the shard and
        replica groups; None at the stages' own points and the resident point ``(p, W, W)``."""
        if self.mics is not None and zero.gradient_bits is not None:
            self.mics.quantize_replicas(zero.gradient_bits, zero.zeropp.block_size)
        self.comm = Collectives(
            topology if self.mics is None else self.mics.shard_topology,
            weight_bits=zero.weight_bits,
            gradient_bits=zero.gradient_bits,
            block_size=zero.zeropp.block_size,
            hpz=resident or (zero.zero_hpz_partition_size if self.stage == 3 else 1),  # resident: hpZ over p
            error_feedback=zero.zeropp.error_feedback,
            error_feedback_beta=zero.zeropp.error_feedback_beta if zero.zeropp.error_feedback == "loco" else 0.0,
            gradient_rotation=zero.gradient_rotation,
            gradient_bits_intra=zero.gradient_bits_intra,
            stochastic_rounding=zero.gradient_bits is not None and zero.zeropp.gradient_stochastic_rounding,
            delta_bits=zero.zeropp.delta_bits if zero.zeropp.weight_deltas else None,
            communication_dtype=communication_dtype(config),
            onebit=config.optimizer is not None and config.optimizer.type == "OneBitAdam",
            arrival_timeout=timedelta(seconds=zero.zeropp.entry_check_timeout),
            gradient_split=None if self.mics is None else self.mics.gradient_split,
        )
        self.entry_check = EntryCheck(self.comm)
        self.compute_dtype = compute_dtype(config)
        sharded = self.stage == 3
        plans = plan_units(module, unit_policy)
        # built on the meta device: each unit is materialised just before it is built (then, stage 3, freed)
        self.materializer = None if meta_init is None else Materializer(
            module, plans, seed=meta_init.seed, param_init_fn=meta_init.param_init_fn, device=meta_init.device,
            dtype=self.compute_dtype)
        if self.mics is not None and self.materializer is None:
            self.mics.broadcast_module(module)
        buffers = ReduceBuffers()
        # zeropp.rules: each plan's parameters by format, one unit per format (zeropp.engine.rules)
        parts = split_plans(plans, zero.zeropp.rules, (zero.weight_bits, zero.gradient_bits), sharded=sharded)
        built = [plan for plan, plan_parts in zip(plans, parts) if plan_parts]
        self._device = _device_of(built, meta_init)
        self.offload = OptimizerOffload(zero.offload_optimizer, config.aio, device=self._device,
                                        numels=[sum(p.numel() for _, p in part.params)
                                                for plan_parts in parts for part in plan_parts],
                                        rank=topology.global_rank)
        self.param_offload = ParamOffload(zero.offload_param, config.aio, device=self._device,
                                          rank=topology.global_rank)
        if self.param_offload.enabled and self.comm.world_size == 1 and self._device.type != "cpu":
            raise ConfigError(f"zero_optimization.offload_param.device={zero.offload_param.device!r} at one rank on "
                              f"{self._device}: this "
                              "build keeps the whole weights of a single rank on the device (there are no shards to "
                              "move); set it to \"none\" (offload_optimizer moves the optimizer's states), or train "
                              "on more ranks")
        assert config.optimizer is not None
        # NVMe: the swap space exists before the units, so each unit's master is swapped out as soon as it is built
        # (a failed write there is raised by attach, after the units' collectives)
        self._attach(self.offload.nvme, lambda: self.offload.open(
            [flat_layout([p.numel() for _, p in part.params], self.comm.for_format(*part.format).alignment,
                         self.comm.world_size)[2] for plan_parts in parts for part in plan_parts],
            state_kinds(config.optimizer.type)))
        self.units = []
        modules = {}
        for plan, plan_parts in zip(plans, parts):
            if self.materializer is not None:
                self.materializer.materialize(plan)
            for part in plan_parts:  # one unit per format; stages 1/2: frozen parameters stay whole, in none
                u = len(self.units)
                self.units.append(Unit(plan.name, part.params, self.comm.for_format(*part.format), sharded=sharded,
                                       reduce_buffers=buffers, frozen=part.frozen,
                                       broadcast=self.materializer is None,
                                       optimizer_side=None if not self.offload.config.enabled
                                       else lambda n, kind, u=u: self.offload.empty(u, n, kind),
                                       shard_home=self.param_offload.home if self.param_offload.enabled else None))
                self.offload.admit(u, self.units[u].master)
                modules[plan.name] = plan.module
        if self.mics is not None:
            self.mics.attach(self.units)
        self.optimizer = PartitionedOptimizer(
            config.optimizer, self.units, model_parameters,
            make_state=lambda u, kind: self.offload.zeros(u, self.units[u].master, kind))
        self.onebit = OneBitAdam(self.optimizer, self.units, self.comm) if self.comm.onebit else None
        self.optimizer.onebit = self.onebit
        self._failure: str | None = None  # why the engine cannot go on (an offload read or write failed)
        self.placement: placement.Placement | None = None
        """``memory_budget``: the tiers the first step chose (``zeropp.engine.placement``); None before it, or
        without a budget."""
        self._placement_due = zero.zeropp.memory_budget is not None
        self._attach(self.offload.nvme, lambda: self.offload.attach(self.units, self.optimizer.state))
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.prefetcher = Prefetcher(zero.stage3_prefetch_bucket_size if sharded else 0)
        self.state_dict_gathering: StateDictGathering | None = None
        self.persistent: list[Unit] = []
        self._kept: set[int] = set()  # ids of the units kept whole from their forward to their backward
        if sharded and self.comm.world_size > 1:
            self.persistent = reuse.persistent_units(
                self.units, zero.stage3_param_persistence_threshold, zero.stage3_model_persistence_threshold
            )
            for unit in self.persistent:
                unit.persistent = True
        self._attach(self.param_offload.nvme, lambda: self.param_offload.attach(self.units))
        self.weight_deltas = (WeightDeltas(self.units, self.comm, refresh_interval=zero.zeropp.delta_refresh_interval,
                                           refresh_bits=zero.zeropp.delta_refresh_bits)
                              if zero.zeropp.weight_deltas or resident else None)
        """``zeropp.weight_deltas``: the tier that keeps the hpZ secondaries and sends each step's quantized weight
        change; at the resident points ``(p, g, o)`` without them, the same tier sending the exact stepped shards
        (``zeropp.engine.weight_deltas``); None when neither."""
        if sharded:
            self._hooks.append(module.register_forward_pre_hook(lambda *_: self._begin_forward()))
            for unit in self.units:
                self._hooks += install_stage3_hooks(
                    unit, modules[unit.name], root=unit.name == "", prefetcher=self.prefetcher,
                    keep=lambda u: id(u) in self._kept, release=self._release,
                )
                self._hooks += install_entry_hooks(unit, _holders(module, unit, modules[unit.name]),
                                                   prefetcher=self.prefetcher)
            if self.comm.world_size > 1:
                self.state_dict_gathering = StateDictGathering(
                    module, self.units, self.entry_check,
                    after=lambda: self.param_offload.check(self.comm, "model.state_dict()"))
        self.overlap_comm = zero.overlap_comm
        self.reduce_bucket_size = zero.reduce_bucket_size
        self._reductions: collections.deque[GradientReduction] = collections.deque()  # in flight, oldest first
        # units whose packed gradients wait for their bucket's reduce-scatter, and their buffers' elements in all;
        # one collective per unit at one rank (no buffer)
        # one bucket per format (zeropp.rules; a collective has one format), keyed by the units' Collectives
        self._buckets: dict[Collectives, list[tuple[Unit, list[torch.Tensor | None]]]] = {}
        self._bucket_numels: dict[Collectives, int] = {}
        self._bucketing = self.comm.world_size > 1
        self._readiness = GradientReadiness(self.units, self._on_unit_ready) if self.stage >= 2 else None

        self._accumulation_steps = config.gradient_accumulation_steps
        self.loss_scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0  # boundaries whose step was skipped for an Inf/NaN gradient (counted in global_steps)
        self.heap_trim = host_memory.HeapTrim()  # CPU: when a step gives the freed heap back to the OS
        self.overflow = False  # whether the last boundary's gradients held an Inf/NaN (fp16: overflowed)
        self._global_grad_norm: float | torch.Tensor | None = None  # a device tensor until first read
        self._forward_pending = False  # a forward with grad ran and awaits its backward
        self._backward_pending = False  # a backward ran and awaits its step()
        self._step_applied = False  # the last boundary's optimizer step was applied (not skipped for an Inf/NaN)
        self._no_sync = False  # inside no_sync(): backward neither reduces nor counts a micro-batch
        self.global_samples = 0  # samples of every finished accumulation window (train_batch_size each)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.monitor = Monitor(config.steps_per_print, config.wall_clock_breakdown, topology.rank == 0, self.device)
        self._params_by_id = {id(p): p for p in module.parameters()}
        self._destroyed = False
        gathered.register(self)  # zeropp.zero.GatheredParameters finds the engine from its parameters

    # ---- the DeepSpeed protocol -------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model. With grad enabled, the result's loss must go to ``backward`` before the next ``step``."""
        self._check_alive("forward()")
        self._check_usable()
        if self._backward_pending and torch.is_grad_enabled():
            raise EngineUsageError(
                "forward() after backward() without step(): call engine.step() after every engine.backward() "
                "(it steps the optimizer only every gradient_accumulation_steps micro-batches)"
            )
        self.monitor.begin("forward")
        out = self.module(*args, **kwargs)
        self.monitor.end("forward")
        if torch.is_grad_enabled():
            self._forward_pending = True
        elif self.stage == 3:  # no step will follow to agree on a failed swap read (zeropp.engine.param_offload)
            self.param_offload.check(self.comm, "forward()")
        return out

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (in fp32; times the loss scale under fp16); gradients
        end up in the units' fp32 shards (in stage 1 at the last micro-batch of the accumulation window). Returns
        ``loss``, as DeepSpeed does."""
        self._check_alive("backward()")
        if self._backward_pending:
            raise EngineUsageError(
                "backward() called twice without step(): call engine.step() after every engine.backward()"
            )
        if not self._forward_pending:
            raise EngineUsageError(
                "backward() called without a forward: run loss = engine(batch) (with grad enabled, in train "
                "mode) first"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise EngineUsageError(f"backward() takes the scalar loss tensor, got {_describe(loss)}")
        if not loss.requires_grad:
            raise EngineUsageError(
                "the loss does not require grad: was the forward run under torch.no_grad() or are all parameters "
                "frozen?"
            )
        self._forward_pending = False
        self.monitor.begin("backward")
        if self._readiness is not None:
            self._readiness.reset()
        scaled = loss.float() / self._accumulation_steps
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        scaled.backward()
        self._finish_backward()
        self.monitor.end("backward")
        self.monitor.loss(loss)
        self._backward_pending = not self._no_sync
        return loss

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """End a micro-batch; at the accumulation boundary check the gradients for Inf/NaN (skipping the step on
        every rank when some unit holds one), clip, step the optimizer, publish the weights and, when the step was
        applied, step ``lr_scheduler`` (``lr_kwargs`` go to its ``step``, as in DeepSpeed).

        Raises:
            NonFiniteGradientError: fp32/bf16 with ``zero_optimization.zeropp.nonfinite_gradients: "raise"``, on
                every rank, after skipping the step, when some rank's gradients held an Inf/NaN (the units named).
        """
        self._check_alive("step()")
        if self._no_sync:
            raise EngineUsageError("step() inside no_sync(): leave the no_sync block first; its backward passes only "
                                   "accumulate gradients, the first backward after it reduces them all")
        if not self._backward_pending:
            raise EngineUsageError(
                "step() called without backward(): each micro-batch is loss = engine(batch); "
                "engine.backward(loss); engine.step()"
            )
        self._backward_pending = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self.monitor.begin("step")
        if self.mics is not None:
            self.mics.sync_gradients(self.units)
        stats = self._gradient_stats()
        values = stats.tolist()  # the step's one host read: skip the step or not
        n = len(self.units)
        if self.param_offload.shards:  # a parameter shard's swap read failed on some rank: nothing is stepped
            self.param_offload.raise_failed(self.comm, values[1 + n:], f"step {self.global_steps + 1}")
        bad = [unit for unit, count in zip(self.units, values[1 : 1 + n]) if count > 0]
        self.overflow = bool(bad)
        if self.loss_scaler is not None:
            old = self.loss_scaler.scale
            self.loss_scaler.update(self.overflow)
            if self.loss_scaler.scale != old:  # qgZ residuals are in scaled units: keep them in step with the scale
                for unit in self.units:
                    if unit.error_feedback is not None:
                        unit.error_feedback.rescale(self.loss_scaler.scale / old)
        if self.overflow:
            # skipped: no master, optimizer-state or parameter change (the compute shards, whole parameters and
            # hpZ secondaries still hold the current weights)
            self.skipped_steps += 1
            self._global_grad_norm = None
        else:
            self._clip_gradients(stats[0])
            self._step_optimizer()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self._step_applied = not self.overflow
        for unit in self.units:
            unit.grad_shard.zero_()
        if self.onebit is not None:
            self.onebit.zero_grad()
        error = None
        if bad and self.loss_scaler is None:  # fp16: an overflow, the loss scaler's business
            message = self._nonfinite_message(bad)
            if self.config.zero_optimization.zeropp.nonfinite_gradients == "raise":
                error = NonFiniteGradientError(
                    f"{message}: the optimizer step was skipped (zero_optimization.zeropp.nonfinite_gradients is "
                    "\"raise\"; set it to \"skip\" to skip such steps and go on)")
            elif self.topology.rank == 0:
                warnings.warn(f"{message}: the optimizer step was skipped on every rank (skipped_steps="
                              f"{self.skipped_steps})", RuntimeWarning, stacklevel=2)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.monitor.end("step")
        self.monitor.boundary(self)
        if self._placement_due:
            self._place_states()
        if self.units and self.units[0].full.device.type == "cpu":
            self.heap_trim.after_step()  # freed heap back to the OS when it piles up (see host_memory)
        if error is not None:
            raise error

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window (the next step() steps)."""
        return (self.micro_steps + 1) % self._accumulation_steps == 0

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    @property
    def loss_scale(self) -> float:
        """fp16: the current loss scale; 1.0 otherwise."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping), when clipping is on. Read from
        the device on the first call after a step (``step()`` itself does not wait for it)."""
        if isinstance(self._global_grad_norm, torch.Tensor):
            self._global_grad_norm = float(self._global_grad_norm)
        return self._global_grad_norm

    # ---- DeepSpeed's engine API --------------------------------------------------------------------------

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (``train_batch_size`` of the config)."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._accumulation_steps

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine: ``$LOCAL_RANK`` (torchrun's, the device index) when set, else its
        index in its node of the topology."""
        value = os.environ.get("LOCAL_RANK")
        return int(value) if value not in (None, "") else self.topology.local_rank

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group."""
        return self.topology.global_rank

    @property
    def world_size(self) -> int:
        """Ranks of the data-parallel group (the whole world unless ``initialize`` got a ``topology``)."""
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """DeepSpeed's ``dp_world_size``: ranks of the data-parallel group (``world_size``: zeropp has no model
        parallelism)."""
        return self.topology.world_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, ``zero_optimization.stage`` (1, 2 or 3)."""
        return self.stage

    def gradient_clipping(self) -> float:
        """The global gradient-norm bound, ``gradient_clipping`` (0.0: no clipping)."""
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        """Whether ``fp16.enabled``: float16 compute with dynamic loss scaling."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """Whether ``bf16.enabled`` (or ``bfloat16.enabled``): bfloat16 compute (DeepSpeed's name for it)."""
        return self.config.bf16.enabled

    def bf16_enabled(self) -> bool:
        """``bfloat16_enabled()``."""
        return self.bfloat16_enabled()

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters and of the compute shards (an offload tier keeps the optimizer's
        side elsewhere: ``zeropp.engine.offload``)."""
        return self._device

    def get_lr(self) -> list[float]:
        """The learning rate of every parameter group (what the next optimizer step uses)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each parameter group's ``betas`` (Adam, AdamW) or ``momentum`` (SGD), as DeepSpeed's ``get_mom``."""
        key = "momentum" if self.optimizer.type == "SGD" else "betas"
        return [group[key] for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last accumulation boundary's optimizer step was applied (false before the first one, and
        when it was skipped for an Inf/NaN gradient: an fp16 overflow, or ``nonfinite_gradients`` in fp32/bf16)."""
        return self._step_applied

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last optimizer step: every unit's fp32 gradient shard and
        (stage 1 between boundaries) the parameters' ``.grad``. ``step()`` already clears them at each boundary;
        this is for discarding a partial accumulation window."""
        self.optimizer.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's ``no_sync``: inside the block, ``backward`` only accumulates gradients in the parameters'
        ``.grad`` (no reduction, no micro-batch counted) and ``step()`` is an error; the first backward after the
        block ends reduces everything accumulated. Stage 1 only: stages 2 and 3 reduce-scatter each unit's gradient
        during backward (DeepSpeed raises for them too); use ``gradient_accumulation_steps`` there."""
        if self.stage != 1:
            raise EngineUsageError(f"no_sync() needs ZeRO stage 1: stage {self.stage} reduce-scatters every unit's "
                                   "gradient during backward; use gradient_accumulation_steps instead")
        if self._no_sync:
            raise EngineUsageError("no_sync() is already active; it cannot be nested")
        if self._backward_pending:
            raise EngineUsageError("no_sync() after backward() without step(): call engine.step() first")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters (at stage 3 on several ranks, trainable ones are empty outside the engine's
        forward and backward; ``full_parameters`` gathers them)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's named parameters (see ``parameters``)."""
        return self.module.named_parameters(prefix, recurse)

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The module's state dict in the compute dtype, every parameter whole. Stages 1 and 2: the module's own
        tensors (detached). Stage 3: a collective (every rank calls it, checked on entry: ``zeropp.engine.entry_check``;
        one exact all-gather per unit) returning new tensors: the fp32 master weights rounded to the compute dtype
        (under qwZ: the exact weights, not the dequantized copy the forward uses); buffers and frozen parameters as
        the module holds them."""
        self._check_alive("state_dict()")
        if self.stage != 3 or self.world_size == 1:
            return {prefix + k: v for k, v in self.module.state_dict(keep_vars=False).items()}
        dtype = self.compute_dtype
        trainable = {name for unit in self.units for name in unit.param_names}
        aliases = checkpoint.state_dict_sources(self)
        out = {}
        with self.entry_check.entered("engine.state_dict()"):
            for key, value in self.consolidated_state_dict().items():
                out[prefix + key] = value.to(dtype) if aliases[key] in trainable else value
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> LoadResult:
        """Load a whole (unsharded) state dict of the module, e.g. from ``state_dict`` or ``save_16bit_model``:
        each trainable parameter into this rank's fp32 master shard (then published to the compute weights, as
        after an optimizer step: at stages 1 and 2 an all-gather, so a collective), buffers and frozen parameters
        into the module. The optimizer state is kept. Every rank calls it (each loads its own shards; checked on entry:
        ``zeropp.engine.entry_check``). With ``strict``, missing or unexpected keys raise
        ``KeyError`` naming them (nothing is loaded then); else they are returned, as ``nn.Module.load_state_dict``
        does."""
        self._check_alive("load_state_dict()")
        if self._backward_pending or self._forward_pending:
            raise EngineUsageError("load_state_dict() between a forward/backward and its step(); call it at an "
                                   "accumulation boundary")
        with self.entry_check.entered("engine.load_state_dict()", save_hint=False):
            self._settle_deltas()
            result = LoadResult(*checkpoint.load_whole_state_dict(self, state_dict, strict))
            if self.weight_deltas is not None:
                self.weight_deltas.refresh()
            return result

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole model's state dict in the compute dtype (``state_dict``; without the frozen parameters'
        entries with ``exclude_frozen_parameters``) to ``save_dir/save_filename`` from the data-parallel group's
        first rank: ``torch.save``, or safetensors when the name ends in
        ``.safetensors`` (needs the ``safetensors`` package). A collective: every rank calls it (checked on entry,
        ``zeropp.engine.entry_check``). At stage 3 it
        gathers only with ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (as DeepSpeed: without
        it nothing is written, a warning says so, and it returns ``False``). Returns whether the file was written
        (on every rank). Tied parameters are written once per key (safetensors: as separate copies)."""
        self._check_alive("save_16bit_model()")
        if self.stage == 3 and self.world_size > 1 and \
                not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            warnings.warn("save_16bit_model() wrote nothing: at stage 3 it needs zero_optimization."
                          "stage3_gather_16bit_weights_on_model_save=true (as DeepSpeed)", stacklevel=2)
            return False
        use_safetensors = str(save_filename).endswith(".safetensors")
        if use_safetensors and importlib.util.find_spec("safetensors") is None:
            raise ImportError(f"save_16bit_model(save_filename={save_filename!r}) writes safetensors, which is not "
                              "installed: pip install safetensors, or use a .bin name for torch.save")
        with self.entry_check.entered("engine.save_16bit_model()"):
            state = self.state_dict()
            if exclude_frozen_parameters:
                frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            if self.topology.rank == 0:
                path = Path(save_dir) / save_filename
                path.parent.mkdir(parents=True, exist_ok=True)
                state = {k: v.detach().clone().contiguous() for k, v in state.items()}
                if use_safetensors:
                    from safetensors.torch import save_file

                    save_file(state, str(path), metadata={"format": "pt"})
                else:
                    torch.save(state, path)
            self.comm.all_reduce_sum(torch.zeros(1, device=self.device))  # the file exists for every rank on return
            if self.mics is not None:  # and for the ranks of the other MiCS groups
                dist.barrier(group=self.topology.group)
        return True

    def save_fp16_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's older name of ``save_16bit_model`` (the same arguments and result)."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def _begin_forward(self) -> None:
        """Stage 3, before the model's forward: gather the persistent units that need it in one collective, learn
        the forward order and which units to keep whole for their backward (``zeropp.engine.reuse``)."""
        gather_bucketed(self.persistent)
        self.prefetcher.begin_forward()
        zero = self.config.zero_optimization
        root = [u for u in self.units if u.name == ""]
        self._kept = reuse.kept_units(self.prefetcher.order, zero.stage3_max_reuse_distance,
                                      zero.stage3_max_live_parameters, root + self.persistent)

    # ---- gradients ----------------------------------------------------------------------------------------

    def _on_unit_ready(self, unit: Unit) -> None:
        """A unit's gradients are complete (stages 2 and 3): start the next hop of the reductions in flight, then
        reduce-scatter this unit's gradients, free the unit (unless the backward of its frozen weights may still be
        to come: ``hooks``)."""
        self._start_next_hops()
        self._reduce(unit)
        if not unit.pending_input_grads:
            unit.free()

    def _release(self, unit: Unit) -> None:
        """Stage 3, a unit with frozen parameters: the gradients of its module's inputs are complete; free it once
        its trainable gradients are too (``hooks``)."""
        assert self._readiness is not None  # stage 3
        if not unit.pending_input_grads and (not unit.params or self._readiness.is_done(unit)):
            unit.free()

    def _reduce(self, unit: Unit) -> None:
        """Reduce-scatter ``unit``'s gradients in a bucket (DeepSpeed's ``reduce_bucket_size``, in elements of the
        units' padded flat buffers): its ``.grad`` is packed into its flat buffer at once (and dropped, so a
        stage-3 unit can be freed) and held; a unit that would take the held ones past ``reduce_bucket_size``
        first sends them, and once the held units reach it they go in one reduce-scatter (``reduce_bucketed``);
        ``_finish_backward`` sends the rest. A unit of at least ``reduce_bucket_size`` elements goes alone. Units of
        different formats (``zeropp.rules``) are held in separate buckets, each filled and sent as above."""
        if self.onebit is not None and self.onebit.diverts:  # OneBitAdam's compressed phase: kept on this rank
            self.onebit.take(unit, unit.take_gradients())
            return
        if not self._bucketing:
            self._start_reduction(unit.reduce_gradients(self.micro_steps))
            return
        numel = unit.full.numel()
        key = unit.comm
        if self._buckets.get(key) and self._bucket_numels[key] + numel > self.reduce_bucket_size:
            self._send_bucket(key)
        self._buckets.setdefault(key, []).append((unit, unit.take_gradients()))
        self._bucket_numels[key] = self._bucket_numels.get(key, 0) + numel
        if self._bucket_numels[key] >= self.reduce_bucket_size:
            self._send_bucket(key)

    def _send_bucket(self, key: Collectives | None = None) -> None:
        """Start the reduce-scatter of the units held in the bucket of format ``key`` (all buckets, in the order
        they were first filled, when ``None``; nothing for an empty one)."""
        for k in list(self._buckets) if key is None else [key]:
            held = self._buckets.pop(k, [])
            self._bucket_numels.pop(k, None)
            if held:
                units, grads = zip(*held)
                self._start_reduction(reduce_bucketed(list(units), list(grads), self.micro_steps))

    def _start_next_hops(self) -> None:
        """Issue qgZ's hop 2 (across nodes) of every reduction in flight whose hop 1 (inside the node) was started
        before: without this, hop 2 would start only in ``wait()`` (at the end of the backward, or when the double
        buffer is full), so the slow link would idle while the backward computes. Called at each unit's gradients
        (a point of the program every rank reaches in the same order); a reduction's hop 1 has had at least that
        unit's backward to finish."""
        for reduction in self._reductions:
            reduction.start_next_hop()

    def _start_reduction(self, reduction: GradientReduction) -> None:
        """Without ``overlap_comm`` wait for ``reduction`` at once; with it, let it run while autograd goes on,
        waiting for the oldest ones only while the flat buffers in flight exceed ``reduce_bucket_size`` elements
        (with buckets of about that size: one bucket in flight while the next fills, DeepSpeed's double buffer).
        Every rank waits in the order it started them: qgZ's hop 2 runs inside the wait."""
        self._reductions.append(reduction)
        if not self.overlap_comm:
            self._reductions.popleft().wait()
            return
        while len(self._reductions) > 1 and sum(r.numel for r in self._reductions) > self.reduce_bucket_size:
            self._reductions.popleft().wait()

    def _build_scheduler(self, given: Any) -> Any:
        """The config's ``scheduler`` block built over the optimizer, or ``given`` (a scheduler object, or a callable
        taking the optimizer and returning one); both is a ``ConfigError``."""
        if given is not None and self.config.scheduler is not None:
            raise ConfigError("initialize(lr_scheduler=...) and the config's scheduler block are both given; keep "
                              "one (DeepSpeed would silently prefer the config's)")
        if self.config.scheduler is not None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        if given is None:
            return None
        scheduler = given if hasattr(given, "step") else given(self.optimizer) if callable(given) else given
        if not callable(getattr(scheduler, "step", None)):
            raise ConfigError(f"lr_scheduler must have a step() method, or be a callable taking the optimizer and "
                              f"returning such a scheduler; got a {type(scheduler).__name__}")
        return scheduler

    def _finish_backward(self) -> None:
        """Reduce what the hooks did not (stage 1 at the boundary; units with a parameter that got no gradient),
        send the last bucket, wait for every reduction in flight and free every stage-3 unit, root included. Same
        unit order on every rank."""
        for unit in self.units:
            if not unit.params:
                pass  # frozen parameters only: nothing to reduce
            elif self.stage == 1:
                if self.is_gradient_accumulation_boundary() and not self._no_sync:
                    self._reduce(unit)
            elif self._readiness is not None and not self._readiness.is_done(unit):
                self._reduce(unit)
            unit.pending_input_grads = 0
            unit.free()
        self._start_next_hops()
        self._send_bucket()
        while self._reductions:
            self._reductions.popleft().wait()

    def _step_optimizer(self) -> None:
        """Step every unit, in the order of the offload tier's stream (an NVMe tier reads each unit's master and
        state ahead and writes them behind), copying each stepped master into its compute shard; then, stages 1
        and 2, all-gather the shards. With NVMe, the ranks first agree whether some rank's swap failed (one small
        all-reduce), so that no rank waits in a collective that a failed rank never enters."""
        failure: SwapError | None = None
        stream = self.offload.stream(self.units, write=True)
        try:
            self.optimizer.step(stream, after=Unit.publish_shard)
        except SwapError as e:
            failure = e
        finally:
            stream.close()
            self.param_offload.drain()  # the new shards' writes (NVMe offload_param)
        self.param_offload.check(self.comm, f"the optimizer step {self.global_steps + 1}")
        if self.offload.nvme:
            self._agree_on_swap(failure, f"the optimizer step {self.global_steps + 1}", "some units were stepped and "
                                "some not, so this engine's weights are no longer consistent")
        for unit in self.units:
            unit.publish_gather()
        if self.weight_deltas is not None:  # in flight, in the order the next forward gathers the units
            self.weight_deltas.after_step(self.persistent + self.prefetcher.last_order())

    def _attach(self, nvme: bool, attach: Callable[[], None]) -> None:
        """Run an offload tier's ``attach`` (its swap files made and written); with NVMe, a failure on any rank
        raises on every rank (``_agree_on_swap``), after both tiers' files are deleted."""
        failure: SwapError | None = None
        try:
            attach()
        except SwapError as e:
            failure = e
        if nvme:
            try:
                self._agree_on_swap(failure, "setting up the engine", None)
            except OffloadError:
                self.offload.close()
                self.param_offload.close()
                raise
        elif failure is not None:
            raise failure

    def _agree_on_swap(self, failure: SwapError | None, what: str, consequence: str | None) -> None:
        """NVMe: every rank learns whether ``what`` failed reading or writing some rank's swap files (one all-reduce
        of ``world_size`` flags, so that no rank waits in a collective a failed rank never enters); if so
        ``OffloadError`` is raised on every rank, naming the failed ranks and their messages (gathered only after a
        failure), and, with a ``consequence``, the engine is unusable from then on."""
        flags = torch.zeros(self.comm.world_size, device=self.device)
        flags[self.comm.rank] = failure is not None
        try:
            summed = self.comm.all_reduce_sum(flags).tolist()
        except RuntimeError as error:  # a rank died (gloo: the connection closed) or the group timed out
            text = (f"{what}: the ranks could not agree whether every rank's NVMe offload swap files were read and "
                    f"written ({type(error).__name__}: {str(error)[:300]}); a rank probably died mid-way")
            if failure is not None:
                text += f"; this rank's swap failed too: {failure}"
            self._failure = (f"{text}: this process group cannot go on; restart every rank and load the last "
                             "checkpoint (engine.load_checkpoint)")
            raise OffloadError(self._failure) from error
        failed = [r for r, bad in enumerate(summed) if bad]
        if not failed:
            return
        messages: list[str | None] = [None] * self.comm.world_size
        dist.all_gather_object(messages, None if failure is None else str(failure), group=self.comm.topology.group)
        causes = "; ".join(f"rank {self.comm.topology.ranks[r]}: {messages[r]}" for r in failed)
        text = (f"{what} failed reading or writing the NVMe offload's swap files on rank(s) "
                f"{[self.comm.topology.ranks[r] for r in failed]} ({causes})")
        if consequence is None:
            raise OffloadError(text) from failure
        self._failure = (f"{text}; {consequence}: build a new engine and load the last checkpoint "
                         "(engine.load_checkpoint)")
        raise OffloadError(self._failure) from failure

    def _place_states(self) -> None:
        """``memory_budget``, after the first step: choose each unit's tier from what it measured (the same on every
        rank; ``zeropp.engine.placement``), move the states there and say so on the first rank."""
        self._placement_due = False
        chosen = placement.choose(self)
        reads = any(old == "nvme" != new for old, new in zip(self.offload.tiers, chosen.tiers))
        failure: SwapError | None = None
        try:
            self.offload.migrate(self.units, self.optimizer.state, chosen.tiers)
        except SwapError as e:
            failure = e
        if reads:
            self._agree_on_swap(failure, "moving the optimizer states to the tiers memory_budget chose",
                                "some units were moved and some not")
        self.placement = chosen
        if self.topology.rank == 0:
            print(chosen.describe(), flush=True)

    def _check_usable(self) -> None:
        failure = self._failure or self.param_offload.agreed
        if failure is not None:
            raise OffloadError(f"this engine cannot go on: {failure}")

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()``: release what the engine holds beyond its tensors — the NVMe offloads'
        swap files (also deleted when the engine is collected or the process exits), its hooks on the module (stage
        3's gather/free, entry and state-dict hooks; stages 2 and 3's gradient hooks) and its claim on the module's
        parameters (``zeropp.zero.GatheredParameters`` takes them for plain parameters from then on). On this rank
        only (not a collective); a second call does nothing. Afterwards every use of the engine (forward, backward,
        step, a save or load, a state dict, ``gathered_parameters``) raises ``EngineUsageError``. The module keeps
        what it holds: at stages 1 and 2 (and at one rank) the whole current weights, a plain model again; at stage 3
        on several ranks empty parameters (take the weights out first: ``save_16bit_model``,
        ``consolidated_state_dict``)."""
        if self._destroyed:
            return
        self._settle_deltas()  # no exchange left in flight, writing into this engine's secondaries
        self._destroyed = True
        gathered.unregister(self)
        self.offload.close()
        self.param_offload.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.state_dict_gathering is not None:
            self.state_dict_gathering.remove()
        if self._readiness is not None:
            self._readiness.remove()

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a parameter of this engine's module (and the engine is not destroyed)."""
        return not self._destroyed and self._params_by_id.get(id(param)) is param

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise EngineUsageError(f"{what} after engine.destroy(): the engine has released its hooks and swap files; "
                                   "build a new one with zeropp.initialize (and load_checkpoint to go on)")

    def _gradient_stats(self) -> torch.Tensor:
        """At the boundary, before clipping and the optimizer: under fp16 divide every ``grad_shard`` by the loss
        scale; then compute one float64 vector of ``1 + len(units)`` values over this rank's units and sum it over
        the data-parallel group (one all-reduce of ``8 * (1 + len(units))`` bytes), leaving it on the device:

        * ``[0]``, clipping on: the sum of the squares of the fp32 gradient shards (each unit's in float64, the
          units added in order): the squared global norm (0 with clipping off);
        * ``[1 + i]``: how many ranks' shards of unit ``i`` hold an Inf or NaN. With clipping that is read off the
          unit's float64 sum of squares (squares of finite fp32 values cannot overflow float64, so it is non-finite
          exactly when the shard holds an Inf or NaN: no second pass); without, one ``aminmax`` pass (the smallest
          and largest element are finite exactly when all are; no temporary of the shard's size).

        Read: every element of this rank's fp32 ``grad_shard`` of every unit (OneBitAdam's compressed phase: of its
        own full gradient, ``OneBitAdam.gradients``), after the reduce-scatter (exact: an
        Inf/NaN anywhere in a unit's gradient on any rank lands in the owning rank's shard; qgZ: a block holding one
        gets a non-finite scale and dequantizes to NaN in the owning rank's shard)."""
        clip = self.config.gradient_clipping > 0
        grads = self.onebit.gradients() if self.onebit is not None else [unit.grad_shard for unit in self.units]
        if self.loss_scaler is not None:
            inv = 1.0 / self.loss_scaler.scale
            for grad in grads:
                grad.mul_(inv)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        flags = []
        for grad in grads:  # an offloaded grad_shard: reduced where it lives, the value moved to the device
            if clip:  # a float64 dot: one temporary, the squares exact (fp32 squared fits float64's mantissa)
                wide = grad.reshape(-1).double()
                sq = moved(torch.dot(wide, wide), self.device)
                total += sq
                flags.append(torch.isfinite(sq).logical_not())
            elif grad.numel():  # min and max: finite exactly when every element is (NaN propagates),
                # read in one pass with no temporary of the shard's size (isfinite's would be one byte per element)
                extremes = torch.stack(torch.aminmax(grad))
                flags.append(moved(torch.isfinite(extremes).all().logical_not(), self.device))
            else:
                flags.append(torch.zeros((), dtype=torch.bool, device=self.device))
        stats = [total.view(1), torch.stack(flags).to(torch.float64)]
        if self.param_offload.shards:
            stats.append(self.param_offload.flags(self.comm))
        return self.comm.all_reduce_sum(torch.cat(stats))

    def _nonfinite_message(self, units: list[Unit]) -> str:
        """What the warning (``skip``) or the error (``raise``) says about a boundary whose gradients held an
        Inf/NaN in ``units``."""
        names = [unit.name or "<root>" for unit in units]
        return f"step {self.global_steps}: non-finite gradients (Inf/NaN) on some rank in units {names}"

    def _clip_gradients(self, sq: torch.Tensor) -> None:
        """Scale the gradient shards by ``min(clip / (norm + 1e-6), 1)`` (``torch.nn.utils.clip_grad_norm_``: the
        coefficient clamped at 1, applied always), ``norm = sqrt(sq)`` (``sq``: the 0-dim squared norm from
        ``_gradient_stats``), all on the device; the norm is read by the host only when ``get_global_grad_norm()``
        asks for it."""
        clip = self.config.gradient_clipping
        if clip <= 0:
            self._global_grad_norm = None
            return
        norm = sq.sqrt()
        self._global_grad_norm = norm
        # clip / (norm + 1e-6) as a division (Tensor.__rtruediv__ would multiply by a reciprocal), then min(., 1):
        # the float64 arithmetic of the host formula, so the result is bit-identical to it
        coef = torch.full_like(norm, clip).div_(norm + 1e-6).clamp_(max=1.0)
        for unit in self.units:
            unit.grad_shard.mul_(moved(coef, unit.grad_shard.device))

    # ---- weights ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole, as new tensors, by name (tied ones once). In stage 3 a collective
        (every rank calls it): each unit not already whole is gathered and freed in turn. These are the weights the
        model computes with: under qwZ, the dequantized copy of the fp32 master shards the optimizer keeps."""
        self._check_alive("full_parameters()")
        out: dict[str, torch.Tensor] = {}
        by_id: dict[int, torch.Tensor] = {}
        gathers = any(not unit.gathered for unit in self.units)  # else no communication (stages 1/2, all held)
        with self.entry_check.entered("engine.full_parameters()") if gathers else contextlib.nullcontext():
            for unit in self.units:
                was = unit.gathered
                unit.gather()
                for p in unit.params + (unit.frozen.params if unit.frozen is not None else []):
                    by_id[id(p)] = p.detach().clone()
                if not was:
                    unit.free()
            if gathers:
                self.param_offload.check(self.comm, "engine.full_parameters()")
        for name, p in self.module.named_parameters():
            out[name] = by_id[id(p)] if id(p) in by_id else p.detach().clone()
        return out

    def gathered_parameters(self, modules: nn.Module | Iterable[nn.Module] | None = None, *,
                            modifier_rank: int | None = None) -> contextlib.AbstractContextManager[None]:
        """DeepSpeed's ``GatheredParameters``: inside the ``with`` block the parameters of ``modules`` (default: the
        whole model), trainable and frozen, are whole on every rank, with the compute shards' exact values; on exit
        they are freed again (stage 3). With ``modifier_rank`` (a global rank), the values that rank wrote into them
        in place are broadcast on exit and become the weights: compute shards and fp32 masters (the elements whose
        compute-dtype value changed). A collective (checked on entry, ``zeropp.engine.entry_check``); not between a
        forward and its ``step()``. Inside, ``model.state_dict()`` reads the units the block holds without
        communicating, so one rank may save: ``with engine.gathered_parameters(): if rank == 0:
        model.save_pretrained(d)``. Details: ``zeropp.engine.gathered``; ``zeropp.zero.GatheredParameters`` takes
        the parameters instead of the modules."""
        if modules is None:
            modules = [self.module]
        elif isinstance(modules, nn.Module):
            modules = [modules]
        return self._gathered_params([p for m in modules for p in m.parameters()], modifier_rank=modifier_rank)

    def _gathered_params(self, params: Iterable[torch.Tensor], *,
                         modifier_rank: int | None = None) -> contextlib.AbstractContextManager[None]:
        """``gathered_parameters`` over the units owning any of ``params`` (parameters of the module): what
        ``zeropp.zero.GatheredParameters`` enters."""
        self._check_alive("gathered_parameters()")
        if self._forward_pending or self._backward_pending:
            raise EngineUsageError("gathered_parameters() between a forward and its step(): use it before the forward "
                                   "or after engine.step()")
        self._settle_deltas()
        return gathered.gathered_parameters(self.units, params, modifier_rank, self.comm, self.entry_check,
                                            self.offload, self.param_offload)

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None) -> Path:
        """Save the training state to ``save_dir/tag`` (default tag ``global_step<global_steps>``) with
        ``torch.distributed.checkpoint``, each rank writing its own shards, and ``tag`` to ``save_dir/latest``
        (layout and contents: ``zeropp.engine.checkpoint``). ``client_state`` is saved from the first rank and
        returned by ``load_checkpoint``. A collective; only at an accumulation boundary (after ``step()``). Returns
        the checkpoint's directory.

        Atomic (``zeropp.engine.checkpoint_files``): the files are written and checksummed in a staging directory
        next to the target, renamed into place (replacing a checkpoint of the same tag) and only then named in
        ``latest``, so a process killed at any point leaves ``latest`` naming a complete checkpoint. ``save_dir``
        must be one filesystem that every rank sees (as ``torch.distributed.checkpoint`` assumes).

        Raises:
            zeropp.engine.checkpoint.CheckpointError: on every rank when the save failed on any (``save_dir`` not
                writable, a full disk, an exception on one rank); ``save_dir`` is left as it was.
            EngineUsageError: on the ranks that called it, when not every rank did within
                ``zero_optimization.zeropp.entry_check_timeout`` seconds (``zeropp.engine.entry_check``).
        """
        if self._backward_pending or self.micro_steps % self._accumulation_steps != 0:
            raise EngineUsageError(
                f"save_checkpoint() in the middle of an accumulation window (micro step {self.micro_steps}, "
                f"gradient_accumulation_steps {self._accumulation_steps}"
                f"{', backward() without step()' if self._backward_pending else ''}): the accumulated gradients are "
                "not saved; call it after the step() that ends the window"
            )
        self._check_alive("save_checkpoint()")
        self._check_usable()
        with self.entry_check.entered("engine.save_checkpoint()", save_hint=False):
            self._settle_deltas()
            if self.mics is not None:
                return self.mics.save(lambda: checkpoint.save(self, save_dir, tag, client_state))
            return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None) -> tuple[Path, dict[str, Any]]:
        """Restore the state saved by ``save_checkpoint`` from ``load_dir/tag`` (``tag`` from ``load_dir/latest``
        when ``None``), at this engine's world size and layout whatever they were at save (the qgZ residuals and the
        RNG of ranks the save did not have start afresh; see ``zeropp.engine.checkpoint``). A collective; only at an
        accumulation boundary. Returns ``(checkpoint directory, client_state)``.

        Every file is verified against the sha256 the save recorded (``manifest.json``) before anything is read
        into the engine; a checkpoint saved without one loads with a warning.

        Raises (on every rank, nothing loaded):
            FileNotFoundError: ``load_dir``, its ``latest`` file or the tag is missing.
            zeropp.engine.checkpoint.CheckpointError: ``latest`` holds no tag; a file of the checkpoint is missing,
                truncated or corrupted (the file is named); the checkpoint is of another model (the parameter is
                named), optimizer type or number of parameter groups.
            EngineUsageError (on the ranks that called it): not every rank did within
                ``zero_optimization.zeropp.entry_check_timeout`` seconds (``zeropp.engine.entry_check``).
        """
        if self._backward_pending or self.micro_steps % self._accumulation_steps != 0:
            raise EngineUsageError(
                "load_checkpoint() in the middle of an accumulation window would mix its gradients into the loaded "
                "state; call it before the first micro-batch or after a step() that ends a window"
            )
        self._check_alive("load_checkpoint()")
        with self.entry_check.entered("engine.load_checkpoint()", save_hint=False):
            self._settle_deltas()
            loaded = checkpoint.load(self, load_dir, tag)
            if self.weight_deltas is not None:
                self.weight_deltas.refresh()
            return loaded

    def _settle_deltas(self) -> None:
        """Land the weight-delta exchange still in flight (``WeightDeltas.settle``; local, no collective) before
        anything reads or replaces the secondaries, the reconstructions or the weights they follow."""
        if self.weight_deltas is not None:
            self.weight_deltas.settle()

    def refresh_weight_deltas(self) -> None:
        """``zeropp.weight_deltas``: make every hpZ secondary and reconstruction the exact current weights again (an
        exact all-gather per unit, ``zeropp.engine.weight_deltas``; at the resident point ``(p, W, W)`` one exchange
        of the exact shards); every rank calls it, at an accumulation boundary. No-op when neither is on."""
        self._check_alive("refresh_weight_deltas()")
        if self._backward_pending or self._forward_pending:
            raise EngineUsageError("refresh_weight_deltas() between a forward/backward and its step(); call it at an "
                                   "accumulation boundary")
        if self.weight_deltas is not None:
            with self.entry_check.entered("engine.refresh_weight_deltas()", save_hint=False):
                self.weight_deltas.refresh()

    def consolidated_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The unwrapped model's state dict with the trainable parameters whole from the exact fp32 master weights
        (buffers and frozen parameters as the module holds them), for ``model.load_state_dict``. A collective (checked
        on entry, ``zeropp.engine.entry_check``; one exact all-gather per unit); with ``rank0_only`` the other ranks
        get ``{}``. Offline, from a checkpoint: ``zeropp.engine.checkpoint.consolidate``."""
        self._check_alive("consolidated_state_dict()")
        with self.entry_check.entered("engine.consolidated_state_dict()"):
            self._settle_deltas()
            out = checkpoint.consolidated_state_dict(self, rank0_only=rank0_only)
            if self.stage == 3:
                self.param_offload.check(self.comm, "engine.consolidated_state_dict()")
            return out

    def __repr__(self) -> str:
        return (f"ZeroEngine(stage={self.stage}, units={len(self.units)}, world_size={self.comm.world_size}, "
                f"optimizer={self.optimizer.type})")


class LoadResult(NamedTuple):
    """What ``ZeroEngine.load_state_dict`` did not match (as ``nn.Module.load_state_dict``'s result)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _device_of(plans: list[Any], meta_init: MetaInit | None) -> torch.device:
    """The compute device: where a meta model is materialised, else that of the first unit's parameters."""
    if meta_init is not None:
        return torch.device(meta_init.device)
    for plan in plans:
        for _, p in [*plan.params, *plan.frozen]:
            return p.device
    return torch.device("cpu")


def compute_dtype(config: Config) -> torch.dtype:
    """The dtype the model's parameters are held and computed in: bfloat16 (``bf16.enabled``), float16
    (``fp16.enabled``) or float32."""
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return torch.float32


def _holders(model: nn.Module, unit: Unit, unit_module: nn.Module) -> list[nn.Module]:
    """The modules other than ``unit_module`` that directly hold a parameter of ``unit`` (trainable or frozen)."""
    mine = {id(p) for p in unit.params + (unit.frozen.params if unit.frozen is not None else [])}
    return [m for m in model.modules()
            if m is not unit_module and any(id(p) in mine for p in m.parameters(recurse=False))]


_COMMUNICATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def communication_dtype(config: Config) -> torch.dtype:
    """The dtype of the exact gradient reduce-scatter: ``communication_data_type`` when given, else the compute dtype
    (DeepSpeed's default)."""
    if config.communication_data_type is None:
        return compute_dtype(config)
    return _COMMUNICATION_DTYPES[config.communication_data_type]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
