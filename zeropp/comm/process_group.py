"""``init_distributed``: DeepSpeed's ``deepspeed.init_distributed`` (also ``zeropp.init_distributed``), the default
process group from a launcher's environment.

Under torchrun (or DeepSpeed's launcher) every rank has ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
(and ``LOCAL_RANK``) in its environment; ``init_distributed()`` joins them with NCCL when CUDA is available, else
gloo, and does nothing when the default group exists (``zeropp.initialize`` calls it, as DeepSpeed's does)::

    zeropp.init_distributed()                   # torchrun --nproc-per-node 2 train.py
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_LOG = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MINUTES = 10
"""DeepSpeed's default collective timeout, in minutes (``$DEEPSPEED_TIMEOUT`` overrides it, as in DeepSpeed)."""


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialize the default ``torch.distributed`` process group unless it already is (then nothing happens,
    whatever the arguments, as DeepSpeed).

    Args:
        dist_backend: ``"nccl"``, ``"gloo"``, ...; default NCCL when CUDA is available, else gloo. With NCCL the
            current CUDA device becomes ``$LOCAL_RANK`` (when set), as DeepSpeed's engine does.
        timeout: the default group's collective timeout; default ``$DEEPSPEED_TIMEOUT`` minutes, else 10
            (DeepSpeed's).
        init_method: torch's (default ``"env://"``: ``$MASTER_ADDR``, ``$MASTER_PORT``, and ``$RANK``/``$WORLD_SIZE``
            unless ``rank``/``world_size`` are given, non-negative).
        dist_init_required: ``False`` asserts that the group already exists (a ``RuntimeError`` if not).
        auto_mpi_discovery: DeepSpeed reads the rank and world size from MPI (``mpi4py``) when the environment
            lacks them; zeropp does not: a missing variable raises a ``RuntimeError`` naming it.
        distributed_port: the port DeepSpeed's MPI discovery sets; accepted and unused.
        verbose: log the backend and ranks (``logging``, this module's logger) on rank 0.
        config: DeepSpeed's comms-logging config; accepted and unused.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False) but torch.distributed is not initialized: "
                           "leave dist_init_required out (or True), or call init_process_group first")
    if init_method is None or init_method.startswith("env://"):
        needed = ["MASTER_ADDR", "MASTER_PORT", *(["RANK"] if rank < 0 else []),
                  *(["WORLD_SIZE"] if world_size < 0 else [])]
        missing = [v for v in needed if not os.environ.get(v)]
        if missing:
            raise RuntimeError(
                f"init_distributed: ${', $'.join(missing)} not set, so this process does not know its rank and peers "
                "(zeropp does not discover them from MPI): launch with torchrun (or DeepSpeed's launcher), or for one "
                "process set RANK=0 WORLD_SIZE=1 MASTER_ADDR=localhost MASTER_PORT=29500")
    if timeout is None:
        value = os.environ.get("DEEPSPEED_TIMEOUT", str(DEFAULT_TIMEOUT_MINUTES))
        try:
            timeout = timedelta(minutes=int(value))
        except ValueError:
            raise ValueError(f"$DEEPSPEED_TIMEOUT={value!r} is not a whole number of minutes") from None
    if dist_backend is None:
        dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = os.environ.get("LOCAL_RANK")
    if dist_backend == "nccl" and local_rank:
        torch.cuda.set_device(int(local_rank))
    dist.init_process_group(dist_backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
    if verbose and dist.get_rank() == 0:
        _LOG.info("init_distributed: %s process group of %d ranks", dist_backend, dist.get_world_size())
