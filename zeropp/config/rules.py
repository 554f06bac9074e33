"""Matching ``zero_optimization.zeropp.rules`` (``Rule``, parsed by ``parse_rules``) to parameter names: pure name
matching, shared by the engine (``zeropp.engine.rules``) and ``zeropp.fsdp`` (``enable(rules=...)``).

The first rule whose regular expression ``re.search`` finds in a parameter's qualified name gives that parameter
its ``(weight_bits, gradient_bits)``; a parameter no rule matches keeps the default. A rule that takes no
parameter (its pattern finds none, or earlier rules took every one it finds) is an error: such a rule is almost
always a misspelt pattern, which would otherwise leave parameters meant to be exact quantized without a word.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .blocks import Rule
from .errors import Problems

Format = tuple[int | None, int | None]
"""``(weight_bits, gradient_bits)`` of a parameter; ``None`` is exact."""

RULES_KEY = "zero_optimization.zeropp.rules"


def parameter_formats(names: Sequence[str], rules: Sequence[Rule], default: Format, *,
                      key: str = RULES_KEY) -> list[Format]:
    """The format of each parameter of ``names`` (qualified names): the first rule whose pattern ``re.search``
    finds in the name, else ``default``. ``key`` names the rules in messages (``rules[i]`` for ``zeropp.fsdp``).

    Raises:
        ConfigError: a rule takes no parameter (its pattern finds no name, or earlier rules took every name it
            finds); the message names the rule, its pattern and some of the names.
    """
    patterns = [re.compile(rule.match) for rule in rules]
    taken = [0] * len(rules)
    found = [0] * len(rules)
    out = []
    for name in names:
        chosen = None
        for i, pattern in enumerate(patterns):
            if pattern.search(name):
                found[i] += 1
                if chosen is None:
                    chosen = i
                    taken[i] += 1
        out.append(default if chosen is None else (rules[chosen].weight_bits, rules[chosen].gradient_bits))
    p = Problems()
    for i, rule in enumerate(rules):
        if taken[i]:
            continue
        why = ("earlier rules take every parameter it matches" if found[i] else
               "no parameter's qualified name contains a match (re.search)")
        p.add(f"{key}[{i}]", f"{key}[{i}] (match {rule.match!r}) takes no parameter: {why}; fix its pattern or "
                             f"remove the rule (parameter names look like: {', '.join(list(names)[:6])})")
    p.raise_if_any()
    return out
