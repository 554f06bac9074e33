"""Partitioned AdamW / Adam / SGD (and OneBitAdam: AdamW until its ``freeze_step``, then ``zeropp.engine.onebit``):
each rank steps only the fp32 master shards it owns.

The update of every element depends on that element alone, so stepping the shards is the same computation as
stepping whole tensors, if every element is rounded as the whole tensor's step rounds it. The reference is torch.optim's
own fused step (``torch.optim.AdamW/Adam(fused=True)``, one pass over the 28 bytes per element an fp32 Adam step must
read and write, against about eight passes of the single-tensor arithmetic) and foreach SGD:

* Adam/AdamW with CPU masters (the CPU, and the offload tiers): the native step (``zeropp.optim.native``), one call per
  piece of a parameter in the shard, bit for bit torch's fused step on the whole parameter: torch's kernel rounds a
  tensor's last ``numel % 8`` (AVX2) elements in its scalar loop, differently, so each piece is given its share of its
  parameter's tail. When the compute shard is on the CPU the new weights are written into it in the same pass (30
  bytes per element instead of 28 + a 6-byte copy). Without the native library: torch's functional fused step
  (``torch.optim.adam.adam(..., fused=True)``) on the unit's segments, which rounds the segments' own tails: about 1%
  of the elements then differ from the whole-tensor step by rounding (``tests/engine/test_optimizer_step.py``).
* Adam/AdamW with CUDA masters: torch's functional fused step on the segments, one call per unit and group.
* SGD: ``torch.optim.sgd.sgd(..., foreach=True)`` on the segments: bit for bit ``SGD`` on the whole parameters.

The units are stepped one after the other, so an offload tier (``zeropp.engine.offload``) can hold only the unit being
stepped (and those read ahead) in memory.

Parameter groups work as in torch.optim: ``param_groups`` is a list of dicts holding ``params`` (the original
``nn.Parameter`` objects) and the hyperparameters, read again at every step (so a learning-rate schedule may set
``group["lr"]``). A unit's shard may span parameters of several groups: it is cut into *segments*, runs of
consecutive elements of one group, and each segment is stepped with its group's hyperparameters.

Differences from torch.optim, shared with DeepSpeed: a trainable parameter that got no gradient in a step is
stepped with a zero gradient (torch.optim skips it); the step count is per group, not per parameter.

``PartitionedOptimizer`` is a ``torch.optim.Optimizer`` for what schedulers and training scripts use of one:
``param_groups``, ``defaults``, ``step()`` (the engine calls it) and ``zero_grad()``; so ``torch.optim.lr_scheduler``
classes (``LambdaLR``, ``CosineAnnealingLR``, Hugging Face's ``get_scheduler``) drive its learning rates. Its state
is the units' sharded fp32 tensors, not torch's per-parameter dict: ``state_dict``/``load_state_dict`` and
``add_param_group`` raise, naming what to use instead (``engine.save_checkpoint``/``load_checkpoint``; pass every
group to ``initialize``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from ..config import ConfigError, OptimizerConfig
from ..optim import native as native_optim
from .unit import Unit

if TYPE_CHECKING:
    from .onebit import OneBitAdam

_HYPER = {
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "Adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "OneBitAdam": ("lr", "betas", "eps", "weight_decay"),
}


def state_kinds(optimizer_type: str) -> tuple[str, ...]:
    """The optimizer state kinds of ``optimizer_type``, one fp32 shard per unit each: Adam/AdamW's ``exp_avg`` and
    ``exp_avg_sq``, SGD's ``momentum_buffer``."""
    return ("exp_avg", "exp_avg_sq") if optimizer_type != "SGD" else ("momentum_buffer",)


@dataclass
class _Segment:
    """Elements ``[start, stop)`` of one unit's shard, all in parameter group ``group``."""

    unit: Unit
    group: int
    start: int
    stop: int


class PartitionedOptimizer(torch.optim.Optimizer):
    """AdamW, Adam, SGD or OneBitAdam over the units' master shards (see the module docstring for what of
    ``torch.optim.Optimizer`` it supports).

    Args:
        config: the ``optimizer`` block (type and default hyperparameters).
        units: the engine's units.
        param_groups: ``model_parameters`` as given to ``initialize``: an iterable of parameters, or of dicts with
            ``params`` and per-group hyperparameter overrides. Every parameter that requires grad in the units
            must appear exactly once.
        make_state: ``(unit index, kind) ->`` that unit's zero-filled fp32 state of ``kind``, shaped as its master
            (``OptimizerOffload.zeros``: an NVMe tier's holds no memory until the unit is stepped); by default
            ``torch.zeros_like(master)``.
    """

    # torch.optim.Optimizer.__init__ is not called: it would build torch's per-parameter state for the whole
    # (empty, at stage 3) parameters; the members schedulers read are set here.
    def __init__(self, config: OptimizerConfig, units: list[Unit], param_groups: Iterable[Any],
                 make_state: Callable[[int, str], torch.Tensor] | None = None) -> None:
        self.type = config.type
        self.defaults: dict[str, Any] = dict(config.params)
        self.units = units
        self.param_groups = _make_groups(param_groups, self.defaults, self.type)
        group_of: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in group_of:
                    raise ValueError("a parameter appears in more than one parameter group")
                group_of[id(p)] = g
        owned = {id(p) for unit in units for p in unit.params}
        for unit in units:
            for name, p in zip(unit.param_names, unit.params):
                if id(p) not in group_of:
                    raise ValueError(
                        f"parameter {name!r} requires grad but is not in model_parameters; pass it, or freeze it "
                        "with requires_grad_(False) before initialize"
                    )
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    raise ValueError(
                        "model_parameters holds a parameter that is not a trainable parameter of the model "
                        f"(shape {tuple(p.shape)}, requires_grad={p.requires_grad})"
                    )
        self.segments: list[_Segment] = []
        for unit in units:
            for i, a, b in unit.param_ranges():
                g = group_of[id(unit.params[i])]
                last = self.segments[-1] if self.segments else None
                if last is not None and last.unit is unit and last.group == g and last.stop == a:
                    last.stop = b
                else:
                    self.segments.append(_Segment(unit, g, a, b))
        # optimizer state, one fp32 shard per unit and kind
        make = make_state or (lambda u, kind: torch.zeros_like(units[u].master))
        self.state: dict[str, list[torch.Tensor]] = {  # on each master's device (an offload tier's home)
            k: [make(u, k) for u in range(len(units))] for k in state_kinds(self.type)
        }
        self._unit_index = {id(u): i for i, u in enumerate(units)}
        # per unit, its segments by parameter group: one fused call steps a unit's segments of one group
        self._by_unit: list[dict[int, list[_Segment]]] = [{} for _ in units]
        for seg in self.segments:
            self._by_unit[self._unit_index[id(seg.unit)]].setdefault(seg.group, []).append(seg)
        self._group_of_param = [[group_of[id(p)] for p in unit.params] for unit in units]
        self.steps = [0 for _ in self.param_groups]
        self.onebit: OneBitAdam | None = None  # OneBitAdam: its compressed phase (set by the engine)

    @torch.no_grad()
    def step(self, order: Iterable[int] | None = None,
             after: Callable[[Unit, bool], None] | None = None) -> None:
        """One update of every master shard from its gradient shard (``Unit.grad_shard``).

        ``order`` yields the index of each unit, in the order to step them (all units in turn by default; the
        engine passes ``OptimizerOffload.stream``, which has each unit's state in memory while it is stepped), and
        ``after(unit, copied)`` runs once the unit is stepped, before the next is asked for (the engine publishes
        it); ``copied``: the native step already wrote the new values into the compute shard."""
        onebit = self.onebit if self.onebit is not None and self.onebit.compressing else None
        if onebit is not None:
            onebit.begin()
        for g in range(len(self.param_groups)):
            self.steps[g] += 1
        for u in range(len(self.units)) if order is None else order:
            unit = self.units[u]
            if onebit is not None:
                onebit.step_unit(u)
                copied = False
            else:
                native = self.type != "SGD" and self._native_usable(unit)
                copied = self._native_unit(u) if native else False
                if not native:
                    self._torch_unit(u)
            if after is not None:
                after(unit, copied)

    def segments_of(self, u: int) -> dict[int, list[_Segment]]:
        """Unit ``u``'s segments by parameter group."""
        return self._by_unit[u]

    def _torch_unit(self, u: int) -> None:
        """Step unit ``u`` with torch's functional fused Adam (or foreach SGD), one call per parameter group."""
        unit = self.units[u]
        for g, segments in self._by_unit[u].items():
            group = self.param_groups[g]
            params = [unit.master[seg.start : seg.stop] for seg in segments]
            grads = [unit.grad_shard[seg.start : seg.stop] for seg in segments]
            state = {k: [v[u][seg.start : seg.stop] for seg in segments] for k, v in self.state.items()}
            if self.type == "SGD":
                _sgd(params, grads, state["momentum_buffer"], group, first=self.steps[g] == 1)
            else:
                decoupled = self.type != "Adam" or group["adam_w_mode"]
                _adam(params, grads, state["exp_avg"], state["exp_avg_sq"], group, self.steps[g], decoupled)

    def _native_usable(self, unit: Unit) -> bool:
        if unit.master.device.type != "cpu":
            return False
        if native_optim.available():
            return True
        native_optim.warn_unavailable("The CPU optimizer step runs torch's fused Adam instead (slower).")
        return False

    def _native_unit(self, u: int) -> bool:
        """Step unit ``u`` with the native fused Adam (``zeropp.optim.native``), one call per piece of a parameter,
        each with its share of that parameter's tail (``tail_in_piece``): bit for bit torch's fused step on the
        whole parameters. When the compute shard is a CPU tensor of a dtype the kernel writes, the new values go
        into it in the same pass (returns True: the engine need not copy them)."""
        unit = self.units[u]
        out_ok = (unit.shard.device.type == "cpu" and unit.shard.dtype in (torch.float32, torch.bfloat16, torch.float16)
                  and unit.shard_swap is None)  # a swapped shard has no storage now: publish_shard writes it
        m, v = self.state["exp_avg"][u], self.state["exp_avg_sq"][u]
        for i, a, b in unit.param_ranges():
            g = self._group_of_param[u][i]
            group = self.param_groups[g]
            beta1, beta2 = group["betas"]
            lo = unit.start + a - unit.offsets[i]  # the piece within parameter i
            native_optim.adam_step(
                unit.master[a:b], unit.grad_shard[a:b], m[a:b], v[a:b], step=self.steps[g], lr=group["lr"],
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=self.type != "Adam" or group["adam_w_mode"], out=unit.shard[a:b] if out_ok else None,
                tail=native_optim.tail_in_piece(lo, lo + b - a, unit.shapes[i].numel()))
        return out_ok

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients accumulated since the last optimizer step (``ZeroEngine.zero_grad``): every unit's
        fp32 gradient shard (and ``(1, g, o)``'s accumulated rows, ``Unit.grad_accumulator``) and the parameters'
        ``.grad``. ``set_to_none`` is accepted for torch's signature."""
        for unit in self.units:
            unit.grad_shard.zero_()
            if unit.grad_accumulator is not None:
                unit.grad_accumulator.zero_()
            for p in unit.params:
                p.grad = None
        if self.onebit is not None:
            self.onebit.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "the partitioned optimizer's state is sharded over the ranks: save it with engine.save_checkpoint(dir) "
            "(and restore it with engine.load_checkpoint(dir))")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError(
            "the partitioned optimizer's state is sharded over the ranks: restore it with engine.load_checkpoint(dir) "
            "from a checkpoint engine.save_checkpoint wrote")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "parameter groups are fixed when the units are built: pass every group to zeropp.initialize("
            "model_parameters=[{'params': ..., 'lr': ...}, ...])")

    def __repr__(self) -> str:
        return f"PartitionedOptimizer({self.type}, groups={len(self.param_groups)}, segments={len(self.segments)})"


def _make_groups(given: Iterable[Any], defaults: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    items = list(given)
    if not items:
        raise ValueError("model_parameters is empty: there is nothing to optimize")
    if all(isinstance(x, torch.Tensor) for x in items):
        items = [{"params": items}]
    groups = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or "params" not in item:
            raise TypeError("model_parameters must be an iterable of parameters or of dicts with a 'params' key "
                            f"(item {i} is a {type(item).__name__})")
        extra = set(item) - {"params", *_HYPER[kind]}
        if extra:
            raise ConfigError(f"parameter group {i} sets {sorted(extra)}, which {kind} does not take; valid: "
                              f"{list(_HYPER[kind])}")
        params = item["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        groups.append({**defaults, **{k: v for k, v in item.items() if k != "params"}, "params": params})
    return groups


def _adam(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
          exp_avg_sqs: list[torch.Tensor], group: Mapping[str, Any], step: int, decoupled: bool) -> None:
    """Step ``params`` (fp32 views of the masters) with torch's fused Adam (``decoupled``: AdamW's weight decay);
    ``step`` counts this step (1 on the first). The fused kernel increments its step tensors before using them."""
    beta1, beta2 = group["betas"]
    steps = list(torch.full((len(params),), float(step - 1), device=params[0].device).unbind())
    torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, decoupled_weight_decay=decoupled,
               amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
               eps=group["eps"], maximize=False)


def _sgd(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor],
         group: Mapping[str, Any], first: bool) -> None:
    """Step ``params`` with torch's foreach SGD. On the first step torch starts each momentum buffer as a copy of
    the gradient (no dampening): it is given no buffers then, and the ones it makes are copied into ``bufs``."""
    momentum = group["momentum"]
    given: list[torch.Tensor | None] = [None] * len(bufs) if first and momentum != 0 else list(bufs)
    torch_sgd(params, grads, given, foreach=True, weight_decay=group["weight_decay"], momentum=momentum,
              lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"], maximize=False)
    if first and momentum != 0:
        for buf, made in zip(bufs, given):
            buf.copy_(made)
