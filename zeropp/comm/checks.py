"""Input checks for the collectives: local ones (always on) and a cross-rank agreement check (``ZEROPP_DEBUG=1``).

Local checks catch what one rank can see: wrong types, non-contiguous tensors, a wrong ``out``. What only the
group can see (ranks passing different sizes, dtypes or formats, which otherwise hangs or corrupts data) is checked
when ``ZEROPP_DEBUG=1``: one small all-gather of a description of the call before each collective.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..quant.format import FLOAT_DTYPES
from ._dist import all_gather_flat

SUPPORTED_BITS = (None, 8, 4)
_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
         torch.int64, torch.int16, torch.bool)
    )
}


def debug_enabled() -> bool:
    """Whether ``ZEROPP_DEBUG=1`` asks for cross-rank checks before each collective."""
    return os.environ.get("ZEROPP_DEBUG", "0") not in ("", "0")


def check_bits(bits: int | None) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use None (exact), 8 or 4")


def check_input(t: torch.Tensor, name: str, *, quantized: bool) -> None:
    """``t`` must be a contiguous tensor; a float tensor when it is to be quantized."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); the collectives read flat "
            f"memory: pass {name}.contiguous()"
        )
    if quantized and t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; this collective takes {', '.join(map(str, FLOAT_DTYPES))}: "
            f"convert with {name}.float() (all_gather with bits=None takes any dtype)"
        )


def check_out(
    out: torch.Tensor, numel: int, device: torch.device, *, dtype: torch.dtype | None, float_only: bool
) -> None:
    """``out`` must be a contiguous tensor of ``numel`` elements on ``device`` (of ``dtype`` when given)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements (shape {tuple(out.shape)}) but this call needs {numel}")
    if not out.is_contiguous():
        raise ValueError(f"out is not contiguous (stride {out.stride()}); pass a contiguous tensor or a flat view")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the input is on {device}")
    if dtype is not None and out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype} but this call produces {dtype}")
    if float_only and out.dtype not in FLOAT_DTYPES:
        raise TypeError(f"out has dtype {out.dtype}; dequantized results are one of {FLOAT_DTYPES}")


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, -1)


def verify_agreement(group: ProcessGroup, device: torch.device, what: str, fields: dict[str, int]) -> None:
    """Raise on every rank if the ranks of ``group`` disagree on any of ``fields`` (one small all-gather)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    all_gather_flat(everyone, mine, group=group)
    table = everyone.view(size, -1).cpu().tolist()
    ranks = dist.get_process_group_ranks(group)
    bad = [
        f"{name}: " + ", ".join(f"rank {r}={row[i]}" for r, row in zip(ranks, table))
        for i, name in enumerate(fields)
        if len({row[i] for row in table}) > 1
    ]
    if bad:
        raise ValueError(
            f"ZEROPP_DEBUG: the ranks called {what} with different arguments ({'; '.join(bad)}); every rank of "
            "the group must pass tensors of the same numel and dtype and the same bits/op/block_size"
        )
