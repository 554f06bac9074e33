"""Loading a native backend once, on first use, from a path an environment variable may override; shared by the CPU
library (``native.py``) and the CUDA kernels (``native_cuda.py``).

A backend that cannot load is not an error until it is asked to run: ``available()`` says whether it loads and
``unavailable_reason()`` why not (the loader's exception message, which says how to fix it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch

from .format import BlockFormat

Loaded = TypeVar("Loaded")


class NativeBackend(Generic[Loaded]):
    """The four ops of a native backend, run by what ``load(path)`` returns; ``load`` raises ``error`` (an exception
    type whose message says how to fix it) when the path does not hold a usable build."""

    def __init__(self, env: str, default: Path, load: Callable[[Path], Loaded], error: type[Exception]) -> None:
        self.env, self.default, self._load, self._error = env, default, load, error
        self._loaded: dict[Path, Loaded | Exception] = {}

    def path(self) -> Path:
        """Where the build is looked for: ``$<env>`` if set, else the default path."""
        return Path(os.environ.get(self.env) or self.default)

    def _get(self) -> Loaded | Exception:
        path = self.path()
        if path not in self._loaded:
            try:
                self._loaded[path] = self._load(path)
            except self._error as e:
                self._loaded[path] = e
        return self._loaded[path]

    def library(self) -> Loaded:
        """The build at ``path()``, loaded once; its loader's exception, saying why, if it cannot be."""
        loaded = self._get()
        if isinstance(loaded, Exception):
            raise loaded
        return loaded

    def available(self) -> bool:
        """Whether the build at ``path()`` loads."""
        return not isinstance(self._get(), Exception)

    def unavailable_reason(self) -> str | None:
        """Why the build at ``path()`` does not load (``None`` when it does)."""
        loaded = self._get()
        return str(loaded) if isinstance(loaded, Exception) else None

    def quantize_chunks(self, x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor) -> None:
        """As ``reference.quantize_chunks``."""
        self.library().quantize_chunks(x, fmt, chunks, nodes, out)

    def dequantize_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                          out: torch.Tensor) -> None:
        """As ``reference.dequantize_chunks``."""
        self.library().dequantize_chunks(buf, fmt, chunks, chunk_numel, out)

    def reduce_requantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int,
                          out: torch.Tensor) -> None:
        """As ``reference.reduce_requantize``."""
        self.library().reduce_requantize(buf, fmt, groups, chunks, chunk_numel, out)

    def reduce_dequantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int,
                          out: torch.Tensor, divisor: float) -> None:
        """As ``reference.reduce_dequantize``."""
        self.library().reduce_dequantize(buf, fmt, groups, chunk_numel, out, divisor)
