"""``zero_optimization.zeropp.rules``: each parameter's communication format, and the units split by format.

A rule (``zeropp.config.Rule``) gives the parameters whose qualified name its regular expression finds
(``re.search``, the name as ``model.named_parameters()`` gives it first: a tied parameter by its first name) a
weight format and a gradient format, ``None`` meaning exact; the first rule that matches wins, and a parameter no
rule matches keeps the global format (``zero_quantized_weights`` / ``zero_quantized_gradients`` with
``zeropp.weight_bits`` / ``gradient_bits``). The matching itself (``parameter_formats``) lives in
``zeropp.config.rules``, shared with ``zeropp.fsdp``.

Where formats differ inside a unit, the unit is split: one ``Unit`` per format, ``(weight_bits, gradient_bits)``,
of the unit module's parameters (in the order their formats first appear, parameters in model order inside each),
all on the same module and driven by the same hooks, each with its own flat buffer and one collective per format
(``Collectives.for_format``). A unit whose parameters all have the global format is built exactly as without
rules, so ``rules: []``, or rules that all give the global format, change nothing, bit for bit. An exact split unit has no
quantization alignment (``Collectives.alignment`` 1): its parameters are laid out as in exact ZeRO, so their
gathered weights and reduced gradients are bit-identical to an exact run's.

Trade-off (why split and not one collective carrying segments of several formats): a split costs one more
collective per extra format in a unit (its latency) and the padding of one more flat buffer (under ``P * align``
elements per split unit), but every collective keeps one format, so ``zeropp.comm``'s kernels, byte accounting and
qgZ's two hops are used as they are, a rank's shard stays one contiguous run of its buffer (checkpoints, offload and
``gathered_parameters`` unchanged), and the bytes of each format are those of its own parameters. A mixed-format
collective would need per-block formats in the kernels and unequal per-rank payloads (an all-gather-v).
Gradient buckets (``reduce_bucket_size``) and bucketed gathers hold units of one format each.

Frozen parameters (stage 3) take their rule's weight format and go with the trainable part of the same
``(weight_bits, gradient_bits)``, or form a part of their own.

A rule that takes no parameter (its pattern finds none, or earlier rules took every one it finds) is a
``ConfigError`` at ``initialize``: such a rule is almost always a misspelt pattern, which would otherwise leave
parameters meant to be exact quantized without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..config import Rule
from ..config.rules import Format, parameter_formats
from .policy import UnitPlan

__all__ = ["Format", "UnitPart", "parameter_formats", "split_plans"]


@dataclass
class UnitPart:
    """The parameters of one unit plan that share one format: they become one ``Unit``."""

    format: Format
    params: list[tuple[str, nn.Parameter]]
    frozen: list[tuple[str, nn.Parameter]]


def split_plans(plans: Sequence[UnitPlan], rules: Sequence[Rule], default: Format, *,
                sharded: bool) -> list[list[UnitPart]]:
    """For each plan, its parts (module docstring); ``sharded`` (stage 3): frozen parameters go into the parts,
    else they stay whole in no unit. Without rules each plan is one part of ``default`` (none for a plan with
    nothing to build). Raises ``ConfigError`` as ``parameter_formats``."""
    named = [(name, param) for plan in plans for name, param in (*plan.params, *plan.frozen)]
    formats = dict(zip(map(id, (p for _, p in named)),
                       parameter_formats([n for n, _ in named], rules, default) if rules else [default] * len(named)))
    out = []
    for plan in plans:
        parts: dict[Format, UnitPart] = {}
        for name, param in plan.params:
            parts.setdefault(formats[id(param)], UnitPart(formats[id(param)], [], [])).params.append((name, param))
        for name, param in plan.frozen if sharded else []:
            parts.setdefault(formats[id(param)], UnitPart(formats[id(param)], [], [])).frozen.append((name, param))
        out.append(list(parts.values()))
    return out
