"""Per-parameter formats for FSDP2 (``enable(rules=...)``): the rules of ``zero_optimization.zeropp.rules``
(``zeropp.config.Rule``), matched by ``zeropp.config.rules.parameter_formats`` exactly as the engine matches them,
resolved to one ``(weight_bits, gradient_bits)`` per parameter of every FSDP2 group.

Granularity: per parameter. FSDP2 hands each group's hooks one flat buffer holding every parameter's padded shard
(``zeropp.fsdp.segments``), so a group whose parameters have different formats is split by format inside the hooks:
one collective per format (``ZeroppAllGather`` / ``ZeroppReduceScatter``), each on its own parameters' segments.
What cannot be honoured is refused at ``enable``, naming the parameter and the fix:

* a group with a tensor-subclass parameter whose ``fsdp_pre_all_gather`` hands FSDP2 other all-gather inputs than
  its shard (float8 training): its flat input does not hold the segments, so it cannot be split; give its group
  one weight format, or wrap that module with its own ``fully_shard``.

and at the first backward where it happens (``ZeroppReduceScatter``): a group with several gradient formats some of
whose parameters got no gradient (FSDP2 then reduces a shorter buffer that no longer says whose columns are
whose).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict

from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError, Problems, Rule
from ..config.blocks import parse_rules
from ..config.rules import Format, parameter_formats
from .segments import managed_parameters

KEY = "rules"


def resolve_rules(rules: Sequence[Rule | Mapping] | None, default: Format) -> tuple[Rule, ...]:
    """``rules`` as ``Rule`` objects: each a ``Rule`` or a ``{"match", "weight_bits", "gradient_bits"}`` mapping
    (the config's schema; a left-out key takes ``default``, ``enable``'s ``weight_bits`` / ``gradient_bits``).

    Raises:
        ConfigError: a bad entry (named by its index), as ``zeropp.config``'s parser reports it.
    """
    if rules is None:
        return ()
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise ConfigError(f"rules must be a list of {{\"match\": <regex>, \"weight_bits\": ..., \"gradient_bits\": "
                          f"...}} objects or zeropp.config.Rule, got {type(rules).__name__}")
    entries = [asdict(r) if isinstance(r, Rule) else r for r in rules]
    p = Problems()
    parsed = parse_rules(entries, p, default)
    p.raise_if_any()
    return parsed


def group_formats(roots: Iterable[nn.Module], groups: Sequence[tuple[nn.Module, ...]], rules: Sequence[Rule],
                  default: Format) -> list[list[tuple[str, Format]]]:
    """Per FSDP2 group, ``(qualified name, format)`` of each sharded (DTensor) parameter, in FSDP2's segment order
    (``zeropp.fsdp.segments.shard_numels``). Names are those of ``named_parameters()`` of the first of ``roots``
    that holds the parameter (a tied parameter by its first name, as the engine names it).

    Raises:
        ConfigError: a rule takes no parameter (``parameter_formats``).
        ValueError: a group of several formats holds a tensor-subclass parameter (module docstring).
    """
    names: dict[int, str] = {}
    for root in roots:
        for name, param in root.named_parameters():
            names.setdefault(id(param), name)
    per_group = []
    for group in groups:
        params = [p for _, _, p in managed_parameters(group[0]) if isinstance(p, DTensor)]
        per_group.append([(names[id(p)], p) for p in params])
    flat = [name for group in per_group for name, _ in group]
    formats = iter(parameter_formats(flat, rules, default, key=KEY))
    out = []
    for group in per_group:
        resolved = [(name, next(formats)) for name, _ in group]
        weights = {fmt[0] for _, fmt in resolved}
        for name, p in group:
            if len(weights) > 1 and hasattr(p.to_local(), "fsdp_pre_all_gather"):
                raise ValueError(
                    f"zeropp.fsdp.enable(rules=...): {name} is a {type(p.to_local()).__name__} whose "
                    "fsdp_pre_all_gather hands FSDP2 other all-gather inputs than its shard, in a group whose "
                    f"parameters the rules give different weight formats ({sorted(map(str, weights))}); such a group "
                    "cannot be split by format: give all of its parameters one weight_bits, or wrap the module "
                    f"holding {name} with its own fully_shard"
                )
        out.append(resolved)
    return out
