"""The offload tiers' storage (ZeRO-Infinity's NVMe swap), below the engine: no torch.distributed, no nn.Module.

* ``aio.py``: asynchronous file I/O: ``AioSettings`` (DeepSpeed's ``aio`` block), ``ALIGNMENT``-aligned host
  buffers, ``O_DIRECT`` files with a buffered fallback, a pool of I/O threads, ``SwapError``, ``measure_disk``;
* ``swap.py``: ``SwapSpace``, a rank's fixed-size named regions under ``<nvme_path>/zeropp-swap/``, written and
  read asynchronously (``SwapHandle``) through a bounded pool of host buffers, CRC-32C checked.

Example::

    space = SwapSpace("/local_nvme", {"exp_avg": shard.nbytes}, rank=rank,
                      config_key="zero_optimization.offload_optimizer.nvme_path")
    space.write("exp_avg", shard).wait()           # or keep the handle and wait later (write-behind)
    handle = space.read("exp_avg", out)             # read-ahead; use out after handle.wait()
    space.close()                                   # deletes the files
"""

from .aio import ALIGNMENT, AioSettings, DiskRates, SwapError, aligned_buffer, measure_disk
from .swap import SwapHandle, SwapSpace

__all__ = ["ALIGNMENT", "AioSettings", "DiskRates", "SwapError", "SwapHandle", "SwapSpace", "aligned_buffer",
           "measure_disk"]
