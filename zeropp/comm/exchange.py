"""``exchange``: send one byte buffer to chosen ranks of the data-parallel group and receive theirs, in one collective.

Every rank passes a payload of the same ``B`` bytes, the ranks it sends it to and the ranks it receives from (the
plan must be mutual: ``a`` lists ``b`` in ``send_to`` exactly when ``b`` lists ``a`` in ``receive_from``; the
caller derives it on every rank from the same layout). ONE ``all_to_all_single`` over the data-parallel group moves
it, with a split of ``B`` bytes to and from each listed peer and zero to the others (no bytes for them on any
transport). Used by the engine's weight-delta tier (``zeropp.engine.weight_deltas``): each shard owner sends its
quantized delta to the ranks whose hpZ secondary holds its shard.

``exchange_parts`` is the same call with the payload given in parts (one per unit): one ``all_to_all_single`` per
part, all issued at once, each with its own handle, so that a part can be used as soon as it arrived while the later
parts are still on the wire (the weight-delta tier lands each unit's part at that unit's first gather). It is one
call in the counters, with the bytes of the whole payload.

Bytes (``zeropp.comm.accounting``, kind ``"exchange"``): ``B`` sent to each peer of ``send_to`` and received from
each of ``receive_from``, intra-node or inter-node by the node of that peer; this rank itself is never a peer.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch
import torch.distributed as dist

from . import accounting
from .checks import call_record, dtype_code, verify_agreement
from .topology import Topology
from .work import CollectiveWork, Pending, run


def exchange(
    payload: torch.Tensor,
    *,
    send_to: Sequence[int],
    receive_from: Sequence[int],
    topology: Topology,
    async_op: bool = False,
) -> torch.Tensor | CollectiveWork:
    """Send ``payload`` (flat contiguous uint8, ``B`` bytes, the same ``B`` on every rank) to the data-parallel
    ranks ``send_to`` and receive the payloads of ``receive_from`` (positions in ``topology.group``, this rank
    excluded from both, each listed once; see the module docstring for the plan's rule). Every rank of the group
    calls it.

    Returns the ``(len(receive_from), B)`` uint8 tensor whose row ``k`` is the payload of the ``k``-th rank of
    ``sorted(receive_from)`` (a ``CollectiveWork`` returning it when ``async_op``).
    """
    _check(payload, send_to, receive_from, topology)
    nbytes = payload.numel()
    _agree_and_count(nbytes, payload.device, sorted(send_to), sorted(receive_from), topology)
    what = (f"exchange of {nbytes} bytes from rank {topology.rank} to {sorted(send_to)}, from {sorted(receive_from)}, "
            f"over ranks {topology.ranks}")
    out = torch.empty(len(receive_from), nbytes, dtype=torch.uint8, device=payload.device)
    return run(_exchange_steps(payload, out, sorted(send_to), sorted(receive_from), topology), async_op,
               (payload, out), what)


def exchange_parts(
    parts: Sequence[torch.Tensor],
    *,
    send_to: Sequence[int],
    receive_from: Sequence[int],
    topology: Topology,
) -> list[CollectiveWork]:
    """``exchange`` of the payload ``torch.cat(parts)`` (each part flat contiguous uint8, the same sizes in the same
    order on every rank), sent part by part (see the module docstring). Every rank of the group calls it.

    Returns one handle per part, all in flight: ``wait()`` of the ``k``-th gives the ``(len(receive_from),
    parts[k].numel())`` uint8 tensor whose row ``j`` is part ``k`` of the ``j``-th rank of ``sorted(receive_from)``.
    The handles may be waited for in any order (``wait()`` issues no communication). Counted as one ``"exchange"``
    call of ``sum(parts[k].numel())`` bytes per peer."""
    for part in parts:
        _check(part, send_to, receive_from, topology)
    nbytes = sum(part.numel() for part in parts)
    device = parts[0].device if parts else torch.device("cpu")
    _agree_and_count(nbytes, device, sorted(send_to), sorted(receive_from), topology)
    works = []
    for k, part in enumerate(parts):
        what = (f"exchange part {k} of {len(parts)} ({part.numel()} of {nbytes} bytes) from rank {topology.rank} to "
                f"{sorted(send_to)}, from {sorted(receive_from)}, over ranks {topology.ranks}")
        out = torch.empty(len(receive_from), part.numel(), dtype=torch.uint8, device=part.device)
        steps = _exchange_steps(part, out, sorted(send_to), sorted(receive_from), topology)
        work = run(steps, True, (part, out), what)
        assert isinstance(work, CollectiveWork)
        works.append(work)
    return works


def _check(payload: torch.Tensor, send_to: Sequence[int], receive_from: Sequence[int], topology: Topology) -> None:
    """Raise unless ``payload`` is flat contiguous uint8 and the peers are valid (see ``exchange``)."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(f"payload must be a flat contiguous uint8 tensor, got {payload.dtype} of shape "
                         f"{tuple(payload.shape)}")
    size, me = topology.world_size, topology.rank
    for name, peers in (("send_to", send_to), ("receive_from", receive_from)):
        bad = [q for q in peers if not 0 <= q < size or q == me]
        if bad or len(set(peers)) != len(peers):
            raise ValueError(f"{name}={list(peers)}: each peer must appear once and be a rank of the data-parallel "
                             f"group (0..{size - 1}) other than this rank ({me})")


def _agree_and_count(nbytes: int, device: torch.device, send_to: list[int], receive_from: list[int],
                     topology: Topology) -> None:
    """Check that the ranks agree on the call (``verify_agreement``) and count its bytes: ``nbytes`` to each peer
    of ``send_to`` and from each of ``receive_from``, intra- or inter-node by the peer's node."""
    record = call_record("exchange", numel=nbytes, dtype=dtype_code(torch.uint8))
    verify_agreement(topology.verified_calls, topology.group, device, record)
    node = topology.node

    def split(peers: list[int]) -> tuple[int, int]:  # (same node, other nodes)
        same = sum(1 for q in peers if topology.node_of(topology.ranks[q]) == node)
        return same, len(peers) - same

    sent_same, sent_other = split(send_to)
    recv_same, recv_other = split(receive_from)
    accounting.record("exchange", accounting.Traffic(sent_same * nbytes, sent_other * nbytes,
                                                     recv_same * nbytes, recv_other * nbytes))


def _exchange_steps(payload: torch.Tensor, out: torch.Tensor, send_to: list[int], receive_from: list[int],
                    topology: Topology) -> Generator[Pending, None, torch.Tensor]:
    nbytes = payload.numel()
    if topology.world_size == 1 or nbytes == 0:  # the same on every rank: nobody enters the collective
        return out
    send = payload.repeat(len(send_to)) if send_to else payload[:0]
    in_splits = [nbytes if q in send_to else 0 for q in range(topology.world_size)]
    out_splits = [nbytes if q in receive_from else 0 for q in range(topology.world_size)]
    work = dist.all_to_all_single(out.view(-1), send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=topology.group, async_op=True)
    yield work, (send,), ""
    return out
