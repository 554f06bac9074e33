"""The native CPU Adam / AdamW step: ``kernels/cpu/adam.cpp`` in ``libzeropp_cpu.so``, called through ctypes.

``adam_step`` updates one set of contiguous float32 tensors in place (``param``, ``exp_avg``, ``exp_avg_sq``, all
``numel`` elements, flat; ``grad`` is read) and, with ``out``, writes the new ``param`` cast to ``out``'s dtype in
the same pass. Its spec: bit for bit what

    torch.optim.adam.adam([param], [grad], [exp_avg], [exp_avg_sq], [], [state_step], fused=True,
                          decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                          weight_decay=weight_decay, eps=eps, maximize=False)
    out.copy_(param)

computes, ``state_step`` being a float32 scalar tensor holding ``step - 1`` (torch adds 1 before it steps): the
fused step of the torch in this process, on this CPU. That step's rounding depends on how torch's kernel was
built (whether its vector code uses FMA, and its vector length, which splits the tensor into a vector part and a
scalar tail; see kernels/cpu/adam.cpp), so the library, when loaded, runs torch's step on small probes and takes
the variant that reproduces it; if none does, it is unavailable and ``unavailable_reason()`` says so. The cast
rounds to nearest even (float16 overflows to Inf); a NaN parameter gives a NaN (its payload bits may differ from
torch's). It runs on ``torch.get_num_threads()`` OpenMP threads; the result does not depend on their number.

The library is the one ``zeropp.quant.native`` loads (``ZEROPP_NATIVE_LIB``, else ``native.DEFAULT_PATH``);
``available()`` says whether it loads here with this op, ``unavailable_reason()`` why not.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.optim.adam import adam as torch_adam

from zeropp.quant.native import BUILD_HINT, DEFAULT_PATH, NativeLibraryError
from zeropp.quant.native_loader import NativeBackend

ABI_VERSION = 2
"""The ``zeropp_cpu_optim_abi_version()`` this module is written for (kernels/cpu/adam.cpp)."""

_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = -1


@dataclass(frozen=True)
class Arithmetic:
    """How torch's fused CPU Adam rounds (kernels/cpu/adam.cpp): with FMAs or not, and its vector length in floats
    (its scalar tail is the last ``numel % width`` elements; with FMAs that tail rounds differently)."""

    fma: bool
    width: int


# The variants torch's kernels have on x86-64: its AVX2 and AVX-512 kernels (GCC contracts products and sums into
# FMAs), and its default kernels (no FMA; the width does not matter there).
_VARIANTS = (Arithmetic(True, 8), Arithmetic(True, 16), Arithmetic(False, 8))


class Library:
    """``zeropp_adam_step`` of one loaded ``libzeropp_cpu`` (a path, for tests that load a second build), with the
    variant of torch's arithmetic that it reproduces (found when loaded)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise NativeLibraryError(f"{self.path} does not exist; {BUILD_HINT}")
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise NativeLibraryError(f"{self.path} did not load ({e}); rebuild it: {BUILD_HINT}") from e
        try:
            version = lib.zeropp_cpu_optim_abi_version()
        except AttributeError:
            raise NativeLibraryError(
                f"{self.path} was built without kernels/cpu/adam.cpp; rebuild it: {BUILD_HINT}"
            ) from None
        if version != ABI_VERSION:
            raise NativeLibraryError(
                f"{self.path} has optimizer ABI version {version}, this zeropp needs {ABI_VERSION}; rebuild it: "
                f"{BUILD_HINT}"
            )
        i32, i64, ptr, f64 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
        fn = lib.zeropp_adam_step
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f64, f64, f64, f64, f64, i32, ptr, i32, i32, i64, i64, i32]
        fn.restype = i32
        self._step = fn
        self.arithmetic = self._find_arithmetic()

    def adam_step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  decoupled: bool, out: torch.Tensor | None = None, tail: int | None = None) -> None:
        """As the module's ``adam_step``."""
        _check(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, out)
        if tail is not None and not 0 <= tail <= param.numel():
            raise ValueError(f"tail={tail}: must be in [0, {param.numel()}] (the last elements of param that torch's "
                             "scalar loop computes), or None for param's own")
        self._run(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled, out,
                  self.arithmetic, torch.get_num_threads(), tail)

    def _run(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
             out: torch.Tensor | None, arithmetic: Arithmetic, threads: int, tail: int | None = None) -> None:
        status = self._step(
            param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), param.numel(), step,
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(decoupled),
            None if out is None else out.data_ptr(), _NO_OUT if out is None else _OUT_DTYPES[out.dtype],
            int(arithmetic.fma), arithmetic.width, -1 if tail is None else tail, threads)
        if status:
            raise NativeLibraryError(f"zeropp_adam_step refused its arguments (status {status})")

    def _find_arithmetic(self) -> Arithmetic:
        """The variant whose steps equal torch's fused step on probes: tensors of 47 elements (a tail of 7 or 15,
        per vector length), Adam with L2 weight decay and AdamW, two steps each."""
        gen = torch.Generator().manual_seed(0)
        count, numel = 8, 47
        cases = ((0.9, 0.999, 1e-3, 1e-8, 0.01, False), (0.3, 0.95, 0.07, 1e-6, 0.1, True))

        def tensors() -> list[torch.Tensor]:
            return [torch.randn(numel, generator=gen) for _ in range(count)]

        variants = list(_VARIANTS)
        for beta1, beta2, lr, eps, weight_decay, decoupled in cases:
            params, exp_avgs = tensors(), [0.1 * t for t in tensors()]
            exp_avg_sqs = [0.01 * t.abs() for t in tensors()]
            ours = {v: [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs)] for v in variants}
            steps = [torch.zeros((), dtype=torch.float32) for _ in range(count)]
            for step in (1, 2):
                grads = tensors()
                try:
                    torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True,
                               decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                               weight_decay=weight_decay, eps=eps, maximize=False)
                except (RuntimeError, TypeError) as e:  # no fused CPU step in this torch: nothing to reproduce
                    raise NativeLibraryError(f"torch {torch.__version__}'s fused CPU Adam does not run here ({e}); "
                                             "use torch's step") from e
                for variant, (p, m, v) in ours.items():
                    for i in range(count):
                        self._run(p[i], grads[i], m[i], v[i], step, lr, beta1, beta2, eps, weight_decay, decoupled,
                                  None, variant, 1)
            expected = [torch.cat(ts).view(torch.int32) for ts in (params, exp_avgs, exp_avg_sqs)]
            variants = [v for v, ts in ours.items()
                        if all(torch.equal(torch.cat(t).view(torch.int32), e) for t, e in zip(ts, expected))]
        if not variants:
            raise NativeLibraryError(
                f"torch {torch.__version__}'s fused CPU Adam (CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}) rounds unlike every variant of {self.path}'s "
                f"zeropp_adam_step ({', '.join(map(str, _VARIANTS))}); use torch's fused step"
            )
        return variants[0]


def _check(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, out: torch.Tensor | None) -> None:
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the native Adam step runs on CPU tensors (use torch's fused "
                             "step on other devices)")
        if not t.is_contiguous():
            raise ValueError(f"{name} (shape {tuple(t.shape)}, stride {t.stride()}) is not contiguous; pass "
                             f"{name}.contiguous() and copy the result back, or keep the state contiguous")
        if t.numel() != param.numel():
            raise ValueError(f"{name} has {t.numel()} elements, param has {param.numel()}; they must match")
        if name == "out":
            if t.dtype not in _OUT_DTYPES:
                raise ValueError(f"out has dtype {t.dtype}; it must be one of {list(_OUT_DTYPES)}")
        elif t.dtype != torch.float32:
            raise ValueError(f"{name} has dtype {t.dtype}; the native Adam step takes float32 (master) tensors")
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in named.items()]
    for i, (a, a0, a1) in enumerate(spans):
        for b, b0, b1 in spans[i + 1:]:
            if a0 < b1 and b0 < a1 and param.numel():
                raise ValueError(f"{a} and {b} share memory; each must be its own tensor")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the count after this step), got {step!r}")
    for name, value, ok, rule in (
        ("lr", lr, lr >= 0, ">= 0"),
        ("beta1", beta1, 0 <= beta1 < 1, "in [0, 1)"),
        ("beta2", beta2, 0 <= beta2 < 1, "in [0, 1)"),
        ("eps", eps, eps >= 0, ">= 0"),
        ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
    ):
        if not (math.isfinite(value) and ok):
            raise ValueError(f"{name}={value!r} must be finite and {rule}")


_backend = NativeBackend("ZEROPP_NATIVE_LIB", DEFAULT_PATH, Library, NativeLibraryError)
library_path = _backend.path
library = _backend.library
available = _backend.available
unavailable_reason = _backend.unavailable_reason
warn_unavailable = _backend.warn_unavailable


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
              out: torch.Tensor | None = None, tail: int | None = None) -> None:
    """One Adam (``decoupled=False``: L2 weight decay added to the gradient) or AdamW (``decoupled=True``) step,
    in place, bit for bit torch's fused CPU step (see the module docstring), and ``out.copy_(param)`` after it.

    ``param``, ``grad``, ``exp_avg``, ``exp_avg_sq``: contiguous float32 CPU tensors of one numel (any shape, read
    flat), each its own memory; ``grad`` is only read. ``step``: this step's count, from 1 (bias correction uses
    it as torch's float32 ``state_step``). ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``: as torch's
    Adam. ``out``: None, or a contiguous CPU tensor of the same numel in float32, bfloat16 or float16 that receives
    the updated ``param`` rounded to nearest even. ``tail``: how many of the last elements torch's scalar loop
    computes; ``None`` (torch stepping ``param`` as one tensor) is its ``numel % width``; for a piece ``[a, b)`` of a
    tensor of ``N`` elements that torch steps whole, the piece's share of that tensor's last ``N % width`` elements,
    so the piece gets the bits the whole tensor's step gives it (``tail_in_piece``). Raises
    ``ValueError``/``TypeError`` on bad arguments before
    touching anything, ``NativeLibraryError`` (its message says why and how to fix it) when the library does not
    load here.
    """
    library().adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, decoupled=decoupled, out=out, tail=tail)


def tail_in_piece(start: int, stop: int, numel: int) -> int:
    """How many elements of the piece ``[start, stop)`` of a tensor of ``numel`` elements lie in the part torch's
    fused step computes in its scalar loop (the last ``numel % width`` elements; ``width``: torch's vector length
    here, ``library().arithmetic.width``): the ``tail`` that makes ``adam_step`` on the piece give the piece the bits
    of torch's step on the whole tensor."""
    first = numel - numel % library().arithmetic.width
    return max(0, stop - max(start, first))
