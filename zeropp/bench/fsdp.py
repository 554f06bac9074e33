"""The training benchmark's FSDP2 and HSDP runners (``torch.distributed.fsdp.fully_shard``), for rows side by side
with the engine's (``zeropp.bench.training``).

``FSDPTrainer`` wraps the byte-level GPT the way FSDP2's documentation does for a transformer: ``fully_shard`` on
every block, then on the model (the root: embeddings, final norm, tied head), and drives it with the calls the
benchmark makes of ``zeropp``'s engine (``trainer(inputs, targets)``, ``backward``, ``step``, ``optimizer``,
``train``/``eval``), so both do the same work: the same AdamW hyperparameters on fp32 master weights, clipping by
global norm, one micro-batch per step.

* ``fsdp2``: a 1-D mesh of every rank: parameters sharded over all of them (ZeRO-3's layout);
* ``hsdp``: a 2-D mesh ``(nodes, ranks per node)`` named ``("replicate", "shard")``: sharded inside a node,
  replicated across nodes (gradients all-reduced between the replicas; parameters gathered inside the node only).

bf16 (``dtype="bf16"``): ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``: fp32 sharded
parameters (the masters), bf16 compute and gradient reduction, as the engine with ``bf16.enabled`` and its default
``communication_data_type``. Its collectives are torch's own, so ``zeropp.comm.stats()`` does not count them: the
rows carry the NIC counters only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

KINDS = ("fsdp2", "hsdp")


class FSDPTrainer:
    """FSDP2 (``kind="fsdp2"``) or HSDP (``"hsdp"``) training of ``model`` with AdamW and clipping.

    Args:
        model: a ``zeropp.models.GPT`` in fp32 (its ``blocks`` are sharded one by one).
        kind: ``"fsdp2"`` or ``"hsdp"``.
        ranks_per_node: ranks per (emulated) node: the shard dimension of HSDP's mesh.
        dtype: ``"fp32"`` or ``"bf16"`` (compute and gradient reduction).
        lr, weight_decay: AdamW's.
        clip: gradient clipping by global norm (0: off).
    """

    def __init__(self, model: nn.Module, kind: str, *, ranks_per_node: int, dtype: str = "fp32", lr: float = 1e-3,
                 weight_decay: float = 0.01, clip: float = 0.0) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        world = dist.get_world_size()
        if kind == "hsdp":
            if world % ranks_per_node:
                raise ValueError(f"world size {world} is not a multiple of ranks_per_node={ranks_per_node}")
            mesh = init_device_mesh("cpu", (world // ranks_per_node, ranks_per_node),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy()
        if dtype == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        elif dtype != "fp32":
            raise ValueError(f"dtype={dtype!r} must be fp32 or bf16")
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.module = model
        self.clip = clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.float().backward()

    def step(self) -> None:
        """Clip by global norm (when on), step AdamW, drop the gradients."""
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> FSDPTrainer:
        self.module.train(mode)
        return self

    def eval(self) -> FSDPTrainer:
        return self.train(False)
