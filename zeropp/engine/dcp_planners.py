"""DCP planners for a ``ZeroEngine``'s checkpoints (``zeropp.engine.checkpoint``): DCP's default planners plus one
chunk per ``Slice``, a rank's piece of a 1-D tensor at its offset in the whole.

Its own module so that ``torch.distributed.checkpoint`` (which brings DTensor and sympy: 1.4 s of the 4.3 s that
``import zeropp.engine`` took on the 2-core box, by ``python -X importtime``) is imported when a checkpoint is
saved or loaded, not by every process that trains.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import host_memory
from .checkpoint_files import CheckpointError

if TYPE_CHECKING:
    from .checkpoint import Slice


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner for the plain entries, plus one chunk (``WriteItemType.SHARD``) per ``Slice``
    at its offset in the whole 1-D tensor: the metadata a ``ShardedTensor`` of the same pieces gave."""

    def __init__(self, slices: Mapping[str, Slice]) -> None:
        super().__init__()
        self._slices = dict(slices)
        self._read: torch.Tensor | None = None  # the last piece read from swap files (``Slice.read``)

    @property
    def lazy(self) -> bool:
        """Whether some piece is read from swap files when written (then ``save`` makes DCP write serially)."""
        return any(piece.read is not None for piece in self._slices.values())

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for key, piece in self._slices.items():
            offsets = torch.Size([piece.offset])
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=piece.values.shape)
            data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=piece.values.dtype),
                                   size=torch.Size([piece.numel]))
            items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD, tensor_data=data))
        self.plan = replace(plan, items=[*plan.items, *items],
                            planner_data={**plan.planner_data, **{key: (key,) for key in self._slices}})
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        piece = self._slices.get(write_item.index.fqn)
        if piece is None:
            return super().resolve_data(write_item)
        if piece.read is None:
            return piece.values
        # DCP's file writer keeps every tensor it wrote referenced until the file is closed (for its safetensors
        # option), which would bring every swapped piece into memory by the end of the save. Serially (``save``
        # turns DCP's copy-ahead off for lazy pieces) the previous piece has been written when the next is asked
        # for: its memory can go, back to the OS (glibc keeps freed blocks of these sizes in its heap: host_memory)
        if self._read is not None:
            self._read.untyped_storage().resize_(0)
            host_memory.release_free_heap()
        self._read = piece.read()
        return self._read


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for the plain entries, plus each ``Slice``: read from whichever saved chunks
    of the whole 1-D tensor overlap it (any world size and layout wrote them)."""

    def __init__(self, slices: Mapping[str, Slice]) -> None:
        super().__init__()
        self._slices = dict(slices)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for key, piece in self._slices.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (piece.numel,):
                saved = ("missing" if md is None else "pickled bytes" if isinstance(md, BytesStorageMetadata)
                         else f"a tensor of shape {tuple(md.size)}")
                raise CheckpointError(f"{key!r} is {saved} in the checkpoint; this engine needs a 1-D tensor of "
                                      f"{piece.numel} elements (another model?)")
            chunk = ChunkStorageMetadata(offsets=torch.Size([piece.offset]), sizes=piece.values.shape)
            items += create_read_items_for_chunk_list(key, md, [chunk])
        return replace(plan, items=[*plan.items, *items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self._slices.get(read_item.dest_index.fqn)
        if piece is None:
            return super().resolve_tensor(read_item)
        return piece.values.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])
