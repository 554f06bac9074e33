"""The hooks that drive the units through forward and backward.

Stage 3 (``install_stage3_hooks``): a unit module's forward pre-hook gathers the unit, its post-hook frees it (unless
it is kept whole) and hooks the gradient of its outputs to gather it again before autograd enters its backward; a
unit holding frozen parameters is freed only once the gradients of its inputs are complete. ``install_entry_hooks``
gathers a unit whose submodules a method other than ``forward`` (``generate``) calls directly. Stages 2 and 3
(``GradientReadiness``): post-accumulate-grad hooks count each unit's finished gradients and reduce-scatter the unit
as soon as they are complete, while autograd goes on. Why hooks: the model's code runs unchanged, and each unit is
whole only while it is used.

docs/engine.md ("Hooks") has each hook, why frozen parameters need the input hook, activation checkpointing and what
the entry hooks do not see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from .._torch_internals import in_backward, tree_leaves
from .prefetch import Prefetcher
from .unit import Unit


def _gather_before_backward(unit: Unit, output: Any, prefetcher: Prefetcher) -> None:
    """Gather ``unit`` when autograd computes the gradient of any of its output tensors: that is before autograd
    runs the unit's own backward (a tensor's gradient hooks run before its ``grad_fn`` consumes the gradient)."""
    tensors = [x for x in tree_leaves(output) if isinstance(x, torch.Tensor) and x.requires_grad]
    if tensors:

        def hook(_grad: Any) -> None:
            unit.gather()
            prefetcher.after_backward_gather(unit)

        register_multi_grad_hook(tensors, hook, mode="any")


def _release_after_inputs(unit: Unit, args: Any, kwargs: Any, release: Callable[[Unit], None]) -> None:
    """Units with frozen parameters: count a gradient hook on the inputs that require grad (see the module
    docstring); when it runs, call ``release(unit)``."""
    inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.requires_grad]
    if inputs:
        unit.pending_input_grads += 1

        def hook(_grads: Any) -> None:
            unit.pending_input_grads -= 1
            release(unit)

        register_multi_grad_hook(inputs, hook, mode="all")


def install_stage3_hooks(
    unit: Unit, module: nn.Module, *, root: bool, prefetcher: Prefetcher, keep: Callable[[Unit], bool],
    release: Callable[[Unit], None],
) -> list[RemovableHandle]:
    """Forward pre/post hooks of a stage-3 unit on its module (see the module docstring). ``keep(unit)``: whether
    the unit stays whole after a forward with grad, for its backward; ``release(unit)`` is called when the
    gradients of the unit's inputs are complete (units with frozen parameters)."""

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        unit.gather()
        prefetcher.after_forward_gather(unit)

    def post_forward(_module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            if not in_backward():
                unit.free()
            return output
        if not root:
            if not in_backward() and not keep(unit):
                unit.free()
            _gather_before_backward(unit, output, prefetcher)
            if unit.frozen is not None:
                _release_after_inputs(unit, args, kwargs, release)
        return output  # the root unit stays whole until the engine finishes backward

    return [module.register_forward_pre_hook(pre_forward),
            module.register_forward_hook(post_forward, with_kwargs=True)]


def install_entry_hooks(unit: Unit, modules: list[nn.Module], *, prefetcher: Prefetcher) -> list[RemovableHandle]:
    """Stage 3: hooks on ``modules`` (those directly holding a parameter of ``unit``, the unit's module excepted)
    that gather the unit for a call made outside the unit module's forward (see the module docstring)."""
    opened: list[bool] = []  # per call in progress: whether its pre-hook gathered the unit

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        was = unit.gathered
        unit.gather()  # also waits for a prefetched gather in flight
        opened.append(not was)

    def post_forward(_module: nn.Module, _args: Any, output: Any) -> Any:
        if opened.pop():
            if not in_backward():
                unit.free()
            if torch.is_grad_enabled():
                _gather_before_backward(unit, output, prefetcher)
        return output

    handles = []
    for module in modules:
        handles += [module.register_forward_pre_hook(pre_forward), module.register_forward_hook(post_forward)]
    return handles


class GradientReadiness:
    """Counts, per unit, the parameters whose gradient is complete in the current backward; calls
    ``on_ready(unit)`` once all of them are."""

    def __init__(self, units: list[Unit], on_ready: Callable[[Unit], None]) -> None:
        self.on_ready = on_ready
        self.counts = {id(u): 0 for u in units}
        self.done: set[int] = set()
        self.handles: list[RemovableHandle] = []
        for unit in units:
            for p in unit.params:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(unit)))

    def _hook(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self.counts[id(unit)] += 1
            if self.counts[id(unit)] == len(unit.params):
                self.done.add(id(unit))
                self.on_ready(unit)

        return hook

    def reset(self) -> None:
        """Start counting a new backward."""
        for key in self.counts:
            self.counts[key] = 0
        self.done.clear()

    def is_done(self, unit: Unit) -> bool:
        return id(unit) in self.done

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
