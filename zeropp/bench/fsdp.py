"""The training benchmark's FSDP2 and HSDP runners (``torch.distributed.fsdp.fully_shard``), for rows side by side
with the engine's (``zeropp.bench.training``).

``FSDPTrainer`` wraps the byte-level GPT the way FSDP2's documentation does for a transformer: ``fully_shard`` on
every block, then on the model (the root: embeddings, final norm, tied head), and drives it with the calls the
benchmark makes of ``zeropp``'s engine (``trainer(inputs, targets)``, ``backward``, ``step``, ``optimizer``,
``train``/``eval``), so both do the same work: the same AdamW hyperparameters on fp32 master weights, clipping by
global norm, one micro-batch per step.

* ``fsdp2``: a 1-D mesh of every rank: parameters sharded over all of them (ZeRO-3's layout);
* ``hsdp``: a 2-D mesh ``(nodes, ranks per node)`` named ``("replicate", "shard")``: sharded inside a node,
  replicated across nodes (gradients all-reduced between the replicas; parameters gathered inside the node only);
* ``fsdp2-zeropp``: ``fsdp2`` with ZeRO++ through ``zeropp.fsdp.enable``: qwZ (int8 forward all-gathers), hpZ
  (``fully_shard(..., reshard_after_forward=ranks_per_node)`` on every module, root included: after forward each
  module keeps a shard over its node only, so backward re-gathers inside the node, exactly) and qgZ (int4 two-hop
  reduce-scatter);
* ``hsdp-zeropp``: ``hsdp`` with ``zeropp.fsdp.enable``: qwZ int8 and qgZ int4 inside the node, and the
  cross-replica gradient all-reduce in int4 (``zeropp.fsdp.hsdp``), counted by ``zeropp.comm.stats()``;
* ``fsdp2-qwz``, ``fsdp2-hpz``, ``fsdp2-qgz``: one of the three alone; the other collectives run zeropp's exact
  comms (``enable`` with those bits ``None``: bit-identical to torch's), so every byte of these rows goes through
  ``zeropp.comm`` and is counted by ``zeropp.comm.stats()``.

bf16 (``dtype="bf16"``): ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``: fp32 sharded
parameters (the masters), bf16 compute and gradient reduction, as the engine with ``bf16.enabled`` and its default
``communication_data_type``. The collectives of ``fsdp2`` and ``hsdp`` are torch's own, so ``zeropp.comm.stats()``
does not count them: those rows carry the NIC counters only. The ``fsdp2-*`` rows' all-gathers move the
``param_dtype`` (bf16 or fp32) and their reduce-scatters the ``reduce_dtype``, as torch's would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# the FSDP2 configs with zeropp comms: (weight_bits, hpZ, gradient_bits) for zeropp.fsdp.enable / fully_shard
ZEROPP_KINDS: dict[str, tuple[int | None, bool, int | None]] = {
    "fsdp2-zeropp": (8, True, 4),
    "fsdp2-qwz": (8, False, None),
    "fsdp2-hpz": (None, True, None),
    "fsdp2-qgz": (None, False, 4),
    "hsdp-zeropp": (8, False, 4),
}
HSDP_KINDS = ("hsdp", "hsdp-zeropp")  # the 2-D (replicate, shard) mesh
KINDS = ("fsdp2", "hsdp", *ZEROPP_KINDS)


class FSDPTrainer:
    """FSDP2 (``kind="fsdp2"``, or with zeropp comms ``"fsdp2-zeropp"`` etc.) or HSDP (``"hsdp"``) training of
    ``model`` with AdamW and clipping.

    Args:
        model: a ``zeropp.models.GPT`` in fp32 (its ``blocks`` are sharded one by one).
        kind: one of ``KINDS``.
        ranks_per_node: ranks per (emulated) node: the shard dimension of HSDP's mesh, hpZ's reshard group size
            and the node layout ``zeropp.fsdp.enable`` accounts bytes with.
        dtype: ``"fp32"`` or ``"bf16"`` (compute and gradient reduction).
        lr, weight_decay: AdamW's.
        clip: gradient clipping by global norm (0: off).
        block_size: elements per quantization block of the ``fsdp2-*`` kinds (default: the library's).
    """

    def __init__(self, model: nn.Module, kind: str, *, ranks_per_node: int, dtype: str = "fp32", lr: float = 1e-3,
                 weight_decay: float = 0.01, clip: float = 0.0, block_size: int | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        world = dist.get_world_size()
        if kind in HSDP_KINDS:
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
        weight_bits, hpz, gradient_bits = ZEROPP_KINDS.get(kind, (None, False, None))
        shard: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
        if hpz:
            shard["reshard_after_forward"] = ranks_per_node
        for block in model.blocks:
            fully_shard(block, **shard)
        fully_shard(model, **shard)
        if kind in ZEROPP_KINDS:
            import zeropp.fsdp
            from zeropp.quant import DEFAULT_BLOCK_SIZE

            zeropp.fsdp.enable(model, weight_bits=weight_bits, gradient_bits=gradient_bits,
                               hpz=ranks_per_node if hpz and ranks_per_node > 1 else None,
                               block_size=block_size or DEFAULT_BLOCK_SIZE, ranks_per_node=ranks_per_node)
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
