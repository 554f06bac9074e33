"""The flat-tensor collectives of torch.distributed under their current names (torch 2.13 renamed
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and deprecated the old names). Looked up on
``torch.distributed`` at each call, not bound at import: a wrapper installed on ``torch.distributed`` after zeropp is
imported (a profiler, a test counting calls) sees zeropp's calls too."""

from typing import Any

import torch.distributed as dist


def all_gather_flat(*args: Any, **kwargs: Any) -> Any:
    """``all_gather_single`` (``all_gather_into_tensor`` before torch 2.13) with these arguments."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args: Any, **kwargs: Any) -> Any:
    """``reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13) with these arguments."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)
