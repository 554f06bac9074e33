"""Input checks for the collectives: local ones and a cross-rank agreement check, both always on.

Local checks catch what one rank can see: wrong types, non-contiguous tensors, a wrong ``out``. What only the
group can see (ranks passing different sizes, dtypes or formats, or calling different collectives, which otherwise
hangs, aborts or silently corrupts data) is checked by one small all-gather of a fixed-size record describing the
call (``RECORD_FIELDS``), once per distinct call per group: the steady state of a training loop, which repeats the
same calls, costs no communication. ``ZEROPP_DEBUG=1`` exchanges the record before every call.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..quant.format import FLOAT_DTYPES
from ._dist import all_gather_flat
from .work import wait_backend

SUPPORTED_BITS = (None, 8, 4, 2)
_DTYPE_CODES = {
    dt: i
    for i, dt in enumerate(
        (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
         torch.int64, torch.int16, torch.bool)
    )
}


def debug_enabled() -> bool:
    """Whether ``ZEROPP_DEBUG=1`` asks for the cross-rank agreement check before every collective call (not only
    the first call of each kind of call)."""
    return os.environ.get("ZEROPP_DEBUG", "0") not in ("", "0")


def check_bits(bits: int | None) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use None (exact), 8, 4 or 2")


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


RECORD_FIELDS = (
    "kind", "numel", "dtype", "bits", "block_size", "op", "out_dtype", "reduce_dtype", "wire_dtype", "rotation",
    "intra_bits",
)
"""The fields of the record each rank sends in an agreement check: the same for every collective kind, so that a
rank calling one kind while another calls a different one still exchanges records of the same size (gloo aborts
the process on a size mismatch instead of raising)."""
_KINDS = ("all_gather", "reduce_scatter", "exchange")
UNUSED = -2
"""Value of a field that does not apply to the collective (e.g. ``op`` for an all-gather)."""


def call_record(kind: str, **fields: int) -> tuple[int, ...]:
    """The fixed-size record (``RECORD_FIELDS``, unused fields ``UNUSED``) describing one collective call."""
    unknown = set(fields) - set(RECORD_FIELDS[1:])
    if unknown:
        raise ValueError(f"unknown agreement fields {sorted(unknown)}; the record has {RECORD_FIELDS}")
    return (_KINDS.index(kind), *(fields.get(name, UNUSED) for name in RECORD_FIELDS[1:]))


def _describe(name: str, value: int) -> str:
    if value == UNUSED:
        return "-"
    if name == "kind":
        return _KINDS[value] if 0 <= value < len(_KINDS) else str(value)
    if name.endswith("dtype"):
        return next((str(dt) for dt, code in _DTYPE_CODES.items() if code == value), str(value))
    return str(value)


def verify_agreement(
    verified: dict[ProcessGroup, set[tuple[int, ...]]], group: ProcessGroup, device: torch.device,
    record: tuple[int, ...],
) -> None:
    """Raise on every rank if the ranks of ``group`` describe different calls (one small all-gather of ``record``).

    ``verified`` caches, per group, the records already found to agree: a record seen before is not exchanged
    again (no communication in the steady state), unless ``ZEROPP_DEBUG=1`` asks to check every call. Every rank
    sees the same sequence of calls when the ranks agree, so they all skip or all exchange. A rank that makes a
    *new* call while another repeats an agreed one cannot be caught this way (set ``ZEROPP_DEBUG=1``); the
    collective then fails or times out, with an error naming it (``CollectiveError``).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    seen = verified.setdefault(group, set())
    if record in seen and not debug_enabled():
        return
    kind = _describe("kind", record[0])
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    everyone = torch.empty(size * len(RECORD_FIELDS), dtype=torch.int64, device=device)
    ranks = dist.get_process_group_ranks(group)
    wait_backend(all_gather_flat(everyone, mine, group=group, async_op=True),
                 f"the agreement check before {kind} over ranks {ranks}")
    table = [tuple(row) for row in everyone.view(size, -1).cpu().tolist()]
    bad = [
        f"{name}: " + ", ".join(f"rank {r}={_describe(name, row[i])}" for r, row in zip(ranks, table))
        for i, name in enumerate(RECORD_FIELDS)
        if len({row[i] for row in table}) > 1
    ]
    if bad:
        raise ValueError(
            f"the ranks {ranks} called {kind} with different arguments ({'; '.join(bad)}); every rank of the group "
            "must make the same collective calls in the same order, with tensors of the same numel and dtype and "
            "the same bits/op/block_size"
        )
    seen.add(record)
