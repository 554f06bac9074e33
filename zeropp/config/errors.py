"""``ConfigError`` and ``Problems``: every problem of a config is collected while it is parsed, then reported in
one error, one line per problem, each naming the key and what to change."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad training configuration; the message names each offending key and what to change."""


class Problems:
    """The problems found so far in one config. Parsing goes on past a problem (the reader returns a fallback value)
    so that ``raise_if_any`` can report all of them at once.

    ``"auto"`` values (the Hugging Face Trainer's placeholders) are collected apart and reported as one line naming
    every such key. ``ok(*keys)`` tells whether the given keys parsed cleanly, so that checks between keys are made
    only on values that were read (no follow-on error from a fallback)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.autos: list[str] = []
        self._failed: set[str] = set()

    def add(self, key: str, message: str) -> None:
        """Record ``message`` about ``key`` (its dotted name, e.g. ``zero_optimization.stage``)."""
        self.messages.append(message)
        self._failed.add(key)

    def auto(self, key: str) -> None:
        """Record that ``key`` is ``"auto"``."""
        self.autos.append(key)
        self._failed.add(key)

    def ok(self, *keys: str) -> bool:
        """Whether none of ``keys`` had a problem (or was ``"auto"``)."""
        return not any(key in self._failed for key in keys)

    def lines(self) -> list[str]:
        """Every problem, one line each; the ``"auto"`` keys first, together on one line."""
        out = list(self.messages)
        if self.autos:
            out.insert(0, f"'auto' values ({', '.join(self.autos)}) are placeholders that the Hugging Face Trainer "
                          "fills in; outside the Trainer replace each with a value (or remove the key where it has a "
                          "default)")
        return out

    def raise_if_any(self) -> None:
        """Raise one ``ConfigError`` listing every problem, if there is any."""
        lines = self.lines()
        if len(lines) == 1:
            raise ConfigError(lines[0])
        if lines:
            raise ConfigError(f"{len(lines)} problems in the config:\n" + "\n".join(f"- {line}" for line in lines))
