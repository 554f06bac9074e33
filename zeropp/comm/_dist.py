"""The flat-tensor collectives of torch.distributed under their current names (torch 2.13 renamed
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` and deprecated the old names)."""

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
