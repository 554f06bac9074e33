"""The hooks that drive the units through forward and backward.

Stage 3 (``install_stage3_hooks``), per unit module:

* forward pre-hook: ``unit.gather()`` — all-gather the shards (qwZ when on) into the whole parameters;
* forward post-hook: ``unit.free()`` unless ``keep(unit)`` (the root unit stays whole until the end of backward,
  and so does a unit kept for reuse, ``zeropp.engine.reuse``, unless the forward ran without grad; a persistent
  unit is never freed), and a gradient hook on the module's output tensors (``register_multi_grad_hook``, mode "any"):
  it runs when the gradient of the unit's output arrives — before autograd enters the unit's own backward — and
  calls ``unit.gather()`` again (from the hpZ secondary shards once hpZ is on; no communication when the unit was
  kept whole). The outputs themselves are
  returned unchanged (no wrapping autograd function, no views).

Units holding frozen parameters: the backward of a frozen weight (the gradient of a frozen ``Linear``'s input) needs
the weight but accumulates no gradient, so it may run after every trainable parameter of the unit is done (autograd
runs ``AccumulateGrad`` as early as it can; a LoRA adapter's branch finishes before the frozen base's). The forward
post-hook therefore also registers a gradient hook on the unit module's inputs that require grad (mode "all"; counted
in ``Unit.pending_input_grads``): once it ran, every backward node between the unit's inputs and outputs has run, and
``release(unit)`` may free it (the engine frees when that count is zero and the trainable gradients are complete).

Other entry points (``install_entry_hooks``): a model method other than ``forward`` (``generate``) may call a unit's
submodules directly (``model.wte(idx)``, ``model.lm_head(x)``), bypassing the unit module's hooks. Every module that
directly holds a parameter of a stage-3 unit (other than the unit's own module) gets pre/post hooks that gather the
unit when it is not whole and, if they gathered it, free it afterwards as the unit module's hooks would (and, with
grad enabled, gather it again for the backward). Inside the unit module's forward the unit is whole already and
they do nothing. Parameters read directly in such a method (``self.pos_emb`` rather than a submodule call) are not
seen: wrap that method in ``engine.gathered_parameters()``.

With prefetching on (``zeropp.engine.prefetch``) each of those gathers is followed by starting the gathers of the
units expected next; the gather of a unit whose all-gather was started earlier only waits for it.

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) recomputes a unit's forward inside its
backward, after the output's gradient hook has gathered it, so the recomputation finds the parameters whole.
torch 2.13 runs no module hooks during that recomputation; should a version run them, the post-hook does not free
a unit while autograd is running a backward.

All stages 2 and 3 (``GradientReadiness``): a post-accumulate-grad hook on every parameter of the unit counts the
parameters whose gradient autograd has finished accumulating in this backward (autograd runs a leaf's
``AccumulateGrad`` once per backward, after all uses of the leaf, even for a module called twice). When the count
reaches the unit's parameter count the unit's gradients are complete, and ``on_ready(unit)`` reduce-scatters them
(and frees the unit in stage 3) while autograd goes on with the rest of the model. Units that are not complete at
the end of backward (a parameter got no gradient) are finished by the engine.
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
