"""Error feedback of several buffers reduced in one qgZ ``reduce_scatter`` (a bucket), each keeping its own residuals.

Layout: buffer ``i`` of ``rows * S_i`` elements, viewed as ``(rows, S_i)`` (row ``r``: rank ``r``'s slice), goes
into the bucket as columns, ``(rows, W)`` with ``W = sum S_i``, row ``r`` the buffers' rows ``r`` end to end
(``zeropp.engine.unit.reduce_bucketed``). Every residual of a ``reduce_scatter`` of the bucket is of that form:
the hop-1 residual ``(P, W)``, the partial sums' one ``(n, W)`` (with a ``gradient_split``'s group of ``g``, slices
of ``P / g`` rows: the same rows). With every ``S_i`` a multiple of the block size (hence of the rotation size),
the bucket's quantization blocks, rotation blocks and residual packs are exactly buffer ``i``'s own in its
columns, so the bucket's residual is buffer ``i``'s residual in columns ``i``: ``BucketErrorFeedback`` reads the
buffers' ``ErrorFeedback`` objects as one bucket residual (``add_to``: added into the bucket's values in place,
part by part; ``values``) and writes what the bucket's quantization dropped back into each, columns by columns
(``store_error``), by each store's own recurrence. The buffers' residuals keep the layout, key and checkpoint form
of a ``reduce_scatter`` of the buffer alone.
"""

from __future__ import annotations

from typing import Any

import torch

from .reduce_scatter import ErrorFeedback


class BucketErrorFeedback(ErrorFeedback):
    """The ``ErrorFeedback`` to pass to one ``reduce_scatter`` of a bucket of buffers (see the module docstring).

    Args:
        parts: each buffer's ``ErrorFeedback`` (one store and ``beta`` for all), in the bucket's column order.
        widths: each buffer's elements per row ``S_i`` (its slice of a reduce-scatter of it alone), multiples of
            the block size.

    It holds no residual of its own: ``residual`` and ``partial_residual`` stay ``None``; the parts' are
    allocated at the first reduction (zeros), with the keys of their own reduce-scatters.
    """

    def __init__(self, parts: list[ErrorFeedback], widths: list[int]) -> None:
        if not parts or len(parts) != len(widths):
            raise ValueError(f"BucketErrorFeedback needs one width per part; got {len(parts)} parts and widths "
                             f"{widths}")
        kinds = {(p.store, p.beta) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"the parts of a bucket have stores and betas {sorted(kinds)}; one reduce_scatter "
                             "has one store: bucket only buffers of one error_feedback setting")
        super().__init__(parts[0].store, parts[0].beta)
        self.parts, self.widths = parts, widths

    def allocate(self, key: tuple[Any, ...], numel: int, partial: int, device: torch.device,
                 slices: tuple[int, int] = (1, 1)) -> None:
        """Allocate each part's residuals (zeros, unless they exist for its key) for a ``reduce_scatter`` of the
        bucket ``key`` (``ErrorFeedback.key``'s fields, ``numel`` the bucket's) with residuals of ``numel`` and
        ``partial`` elements; raises when a width is not a multiple of the block size or the residuals do not
        have whole rows of the bucket's width."""
        block, total = key[2], sum(self.widths)
        if any(w % block for w in self.widths):
            raise ValueError(f"bucket widths {self.widths} must be multiples of block_size={block} (each block "
                             "inside one buffer); pad the buffers' slices to whole blocks")
        if numel % total or partial % total or key[0] % total:
            raise ValueError(f"a reduce_scatter of {key[0]} elements with residuals of {numel} and {partial} "
                             f"elements does not have whole rows of the bucket's {total} columns")
        rows, partial_rows = numel // total, partial // total
        for part, width in zip(self.parts, self.widths):
            part.allocate((key[0] // total * width, *key[1:]), rows * width, partial_rows * width, device, slices)
        self._key = (*key[:6], 8 if self.store == "loco" else 0)
        self._shapes = ((numel, slices[0]), (partial, slices[1]))

    def values(self, partial: bool = False) -> torch.Tensor:
        """The bucket's residual (``partial``: the partial sums' one) as a new flat float32 tensor: the parts'
        residuals as columns."""
        assert self._shapes is not None, "allocate() first"
        rows = self._shapes[partial][0] // sum(self.widths)
        parts = [part.values(partial).view(rows, width) for part, width in zip(self.parts, self.widths)]
        return torch.cat(parts, dim=1).view(-1)

    def add_to(self, x: torch.Tensor, partial: bool = False) -> None:
        """Add the bucket's residual into ``x`` (flat float32, the bucket residual's layout) in place: each part's
        into its columns (no bucket-sized copy of the residuals)."""
        assert self._shapes is not None, "allocate() first"
        columns = x.view(self._shapes[partial][0] // sum(self.widths), -1)
        at = 0
        for part, width in zip(self.parts, self.widths):
            part.add_to(columns[:, at : at + width], partial)
            at += width

    def store_error(self, error: torch.Tensor, partial: bool = False) -> None:
        """Record the bucket's ``error`` (flat float32, the bucket residual's layout) into each part, its columns
        by its store's recurrence."""
        assert self._shapes is not None, "allocate() first"
        columns = error.view(self._shapes[partial][0] // sum(self.widths), -1)
        at = 0
        for part, width in zip(self.parts, self.widths):
            part.store_error(columns[:, at : at + width], partial)
            at += width
