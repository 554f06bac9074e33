"""Loading a native backend once, on first use, from a path an environment variable may override; shared by the CPU
library (``native.py``) and the CUDA kernels (``native_cuda.py``).

A backend that cannot load is not an error until it is asked to run: ``available()`` says whether it loads and
``unavailable_reason()`` why not (the loader's exception message, which says how to fix it).

``build_path`` says where a build is looked for by default: in a source checkout, ``build/`` (where ``setup.sh``'s
CMake build puts it); in an installed zeropp, ``zeropp/_native/`` (where ``pip install`` puts it).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch

from .format import BlockFormat

Loaded = TypeVar("Loaded")

CHECKOUT = Path(__file__).resolve().parents[2]
"""The folder holding the ``zeropp`` package: a source checkout when ``CMakeLists.txt`` is there."""
INSTALL_DIR = "_native"
"""The folder inside the ``zeropp`` package where ``pip install`` puts the builds (CMakeLists.txt's
``ZEROPP_INSTALL_DIR``)."""


def build_path(name: str) -> Path:
    """Where the build file ``name`` is looked for when no environment variable names one: the first that exists of
    ``build/<name>`` in a source checkout (``setup.sh`` keeps it current with the sources) and ``<name>`` in the
    package's ``_native/`` folder, in each folder of ``zeropp.__path__`` (an editable install lists the one its build
    went to there); when none exists, the first of them, for the message that says how to build it."""
    package_dirs = [Path(d) for d in sys.modules[__name__.split(".")[0]].__path__]
    candidates = [d / INSTALL_DIR / name for d in package_dirs]
    if (CHECKOUT / "CMakeLists.txt").is_file():
        candidates.insert(0, CHECKOUT / "build" / name)
    return next((c for c in candidates if c.is_file()), candidates[0])


class NativeBackend(Generic[Loaded]):
    """The five ops of a native backend, run by what ``load(path)`` returns; ``load`` raises ``error`` (an exception
    type whose message says how to fix it) when the path does not hold a usable build."""

    def __init__(self, env: str, default: Path, load: Callable[[Path], Loaded], error: type[Exception]) -> None:
        self.env, self.default, self._load, self._error = env, default, load, error
        self._loaded: dict[str | None, Loaded | Exception] = {}  # by $<env>'s value (None: unset or empty)
        self._warned = False

    def path(self) -> Path:
        """Where the build is looked for: ``$<env>`` if set, else the default path."""
        return Path(os.environ.get(self.env) or self.default)

    def _get(self) -> Loaded | Exception:
        # Keyed by the variable's raw value, not by path(): every kernel call asks, and building a Path each time
        # cost 7.5 us against 2.2 (~160 calls per training step of the small GPT on 4 ranks).
        key = os.environ.get(self.env) or None
        loaded = self._loaded.get(key)
        if loaded is None:
            path = self.path()
            try:
                loaded = self._load(path)
            except self._error as e:
                loaded = e
            self._loaded[key] = loaded
        return loaded

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

    def warn_unavailable(self, instead: str) -> None:
        """Warn (``RuntimeWarning``, once per process) that the build does not load, why, and what runs ``instead``:
        a missing build must not go unnoticed where a slower path takes its place."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.unavailable_reason()}. {instead}", RuntimeWarning, stacklevel=3)

    def quantize_chunks(self, x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor,
                        seed: int | None = None) -> None:
        """As ``reference.quantize_chunks``."""
        self.library().quantize_chunks(x, fmt, chunks, nodes, out, seed)

    def dequantize_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                          out: torch.Tensor) -> None:
        """As ``reference.dequantize_chunks``."""
        self.library().dequantize_chunks(buf, fmt, chunks, chunk_numel, out)

    def dequantize_add_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                              out: torch.Tensor) -> None:
        """As ``reference.dequantize_add_chunks``."""
        self.library().dequantize_add_chunks(buf, fmt, chunks, chunk_numel, out)

    def reduce_requantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int,
                          out: torch.Tensor, out_fmt: BlockFormat | None = None, seed: int | None = None) -> None:
        """As ``reference.reduce_requantize``."""
        self.library().reduce_requantize(buf, fmt, groups, chunks, chunk_numel, out, out_fmt, seed)

    def reduce_dequantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int,
                          out: torch.Tensor, divisor: float) -> None:
        """As ``reference.reduce_dequantize``."""
        self.library().reduce_dequantize(buf, fmt, groups, chunk_numel, out, divisor)
