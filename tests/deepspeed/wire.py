"""Bytes each rank hands ``torch.distributed``, by destination node: DeepSpeed's collectives and zeropp's alike.

``WireCounter.install()`` wraps torch.distributed's collective functions (before DeepSpeed's communication
backend binds them: at the start of a worker; ``zeropp.comm`` looks them up at each call). Each call adds, per
destination rank of its group, the bytes this rank must send it in the direct (point-to-point) model that zeropp's
accounting and the formulas use, not what a ring or tree algorithm puts on a link:

* all-gather (``all_gather_into_tensor`` / ``all_gather_single`` / ``_all_gather_base`` / ``all_gather``): the
  input to every other member;
* reduce-scatter (``reduce_scatter_tensor`` / ``reduce_scatter_single`` / ``_reduce_scatter_base``): chunk ``j``
  (``1 / P`` of the input) to member ``j``; ``reduce_scatter``: list entry ``j`` to member ``j``;
* ``all_to_all_single``: input split ``j`` to member ``j``;
* ``all_reduce`` (and ``all_reduce_coalesced``): ``2 / P`` of the tensor to every other member (a reduce-scatter
  then an all-gather, the bandwidth-optimal volume);
* ``broadcast``: the tensor from the source to every other member; ``isend`` / ``send``: the tensor to its peer.

Bytes to a rank of this node count as ``intra``, to another node as ``inter``; the worker says which node holds a
global rank (``node_of``). Calls are told apart by their caller (the caller of ``zeropp/comm/_dist.py``'s shims for
the renamed collectives where it is one): ``zeropp_checks`` (``zeropp/comm/checks.py``: the
agreement check, once per distinct call), ``zeropp`` (another file of ``zeropp/comm``: the collectives
``zeropp.comm.stats()`` accounts for), ``deepspeed`` (DeepSpeed's files), ``other``. A call made inside another
counted call (a deprecated name calling its successor) is counted once.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

GATHERS = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base")
REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")
KIND = {**dict.fromkeys((*GATHERS, "all_gather"), "all_gather"),
        **dict.fromkeys((*REDUCE_SCATTERS, "reduce_scatter"), "reduce_scatter"),
        "all_to_all_single": "all_to_all", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
        "broadcast": "broadcast", "isend": "p2p", "send": "p2p"}


ORIGINS = ("zeropp", "zeropp_checks", "deepspeed", "other")


class WireCounter:
    """Per caller (``ORIGINS``) and kind (``all_gather``, ``reduce_scatter``, ``all_to_all``, ``all_reduce``,
    ``broadcast``, ``p2p``): ``{"calls", "intra", "inter"}``, bytes this rank sent since the last ``reset()``."""

    def __init__(self, node_of: Callable[[int], int]) -> None:
        self.node_of = node_of
        self.counts: dict[str, dict[str, dict[str, int]]] = {}
        self._depth = threading.local()
        self.reset()

    def reset(self) -> None:
        self.counts = {o: {k: {"calls": 0, "intra": 0, "inter": 0} for k in sorted(set(KIND.values()))}
                       for o in ORIGINS}

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        return {o: {k: dict(v) for k, v in kinds.items()} for o, kinds in self.counts.items()}

    def install(self) -> None:
        for name in KIND:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                caller = sys._getframe(1)
                if caller.f_code.co_filename.endswith("/zeropp/comm/_dist.py"):  # a renamed-collective shim
                    caller = caller.f_back
                self._add(_origin(caller.f_code.co_filename), KIND[name], name, bound.arguments)
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def _add(self, origin: str, kind: str, name: str, a: dict[str, Any]) -> None:
        group = a.get("group")
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        me, size = dist.get_rank(), len(ranks)
        sends: list[tuple[int, int]] = []  # (destination global rank, bytes)
        if name in GATHERS:
            sends = [(g, _nbytes(a["input_tensor"])) for g in ranks]
        elif name == "all_gather":
            sends = [(g, _nbytes(a["tensor"])) for g in ranks]
        elif name in REDUCE_SCATTERS:
            sends = [(g, _nbytes(a["input"]) // size) for g in ranks]
        elif name == "reduce_scatter":
            sends = [(g, _nbytes(t)) for g, t in zip(ranks, a["input_list"])]
        elif name == "all_to_all_single":
            t, splits = a["input"], a["input_split_sizes"]
            if splits:
                row = _nbytes(t) // max(t.shape[0], 1)
                sends = [(g, s * row) for g, s in zip(ranks, splits)]
            else:
                sends = [(g, _nbytes(t) // size) for g in ranks]
        elif name == "all_reduce":
            sends = [(g, 2 * _nbytes(a["tensor"]) // size) for g in ranks]
        elif name == "all_reduce_coalesced":
            sends = [(g, 2 * sum(_nbytes(t) for t in a["tensors"]) // size) for g in ranks]
        elif name == "broadcast":
            src = a["src"] if a.get("group_src") is None else ranks[a["group_src"]]
            sends = [(g, _nbytes(a["tensor"])) for g in ranks] if src == me else []
        else:  # isend, send
            dst = a["dst"] if a.get("group_dst") is None else ranks[a["group_dst"]]
            sends = [(dst, _nbytes(a["tensor"]))]
        c = self.counts[origin][kind]
        c["calls"] += 1
        for g, n in sends:
            if g != me:
                c["intra" if self.node_of(g) == self.node_of(me) else "inter"] += n


def _origin(filename: str) -> str:
    if "/zeropp/comm/" in filename:
        return "zeropp_checks" if filename.endswith("/checks.py") else "zeropp"
    return "deepspeed" if "/deepspeed/" in filename else "other"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
