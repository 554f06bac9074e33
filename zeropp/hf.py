"""ZeRO++ for the Hugging Face ``transformers.Trainer``: one line per backend.

DeepSpeed (``TrainingArguments(deepspeed=<config with the ZeRO++ flags>)``): DeepSpeed's own ZeRO-3 engine runs
on zeropp's collectives once ``zeropp.deepspeed.install()`` has run, before the Trainer trains (the Trainer
builds the engine in ``train()``); nothing here is needed:

    zeropp.deepspeed.install()

hpZ there is the config's ``zero_hpz_partition_size`` (a divisor of the ranks per node): with ``install()`` its
groups are each node's ranks in zeropp's node layout (``zeropp.deepspeed.hpz``).

FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``): accelerate shards the model with
``fully_shard`` inside ``train()``, so ``zeropp.fsdp.enable`` can only run after that and before the first
forward. ``Trainer.train`` calls its callbacks' ``on_train_begin`` exactly there (after ``accelerator.prepare``
and after a ``resume_from_checkpoint`` load, before the first batch), with the sharded model:

    trainer = Trainer(..., callbacks=[zeropp.hf.ZeroppCallback(weight_bits=8, gradient_bits=4)])

Checkpoints are unaffected: the weights and optimizer state stay FSDP2's own (DTensor shards), so the Trainer's
``save_model``, checkpoints and ``resume_from_checkpoint`` work as without zeropp. accelerate's own wrapping puts
the final norm, the embedding and the head tied to it in one ``fully_shard([...])`` group; its qwZ blocks are per
parameter like every other group's.

hpZ needs ``fully_shard(block, reshard_after_forward=N)``, which accelerate's plugin does not offer (transformers
passes it a bool): shard the model yourself before building the Trainer, and pass ``hpz=N`` (N: a divisor of the
ranks per node, usually the ranks per node):

    mesh = init_device_mesh(device_type, (world_size,))
    for block in model.transformer.h:                 # the model's repeated blocks
        fully_shard(block, mesh=mesh, reshard_after_forward=N)
    fully_shard(model, mesh=mesh)
    args = TrainingArguments(..., fsdp=True, fsdp_config={"version": 2, "auto_wrap_policy": "NO_WRAP"})
    trainer = Trainer(model=model, args=args,
                      callbacks=[zeropp.hf.ZeroppCallback(weight_bits=8, gradient_bits=4, hpz=N)])

``"auto_wrap_policy": "NO_WRAP"`` is needed: with its default (transformer-based) policy accelerate 1.15 looks the
block class up by name before it sees the model is sharded, and ``fully_shard`` renamed that class
(``FSDPGPT2Block``): "Could not find the transformer layer class GPT2Block". Then accelerate
(``fsdp2_prepare_model``) returns the FSDP2 model as it is: the Trainer trains those units, and ``enable(hpz=N)``
checks at the first forward that the blocks resharded to ``N`` ranks (tests/hf: GPT-2, 4 ranks as 2 nodes of 2,
``N = 2``).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "zeropp.hf needs the Hugging Face transformers library, which is not installed: pip install transformers "
        "accelerate"
    ) from exc

from . import fsdp

__all__ = ["ZeroppCallback"]

_ENABLE_KWARGS = frozenset(inspect.signature(fsdp.enable).parameters) - {"modules"}


class ZeroppCallback(TrainerCallback):
    """A ``TrainerCallback`` that turns on ZeRO++ (``zeropp.fsdp.enable``) on the Trainer's FSDP2 model when
    training begins.

    Its keyword arguments are ``zeropp.fsdp.enable``'s (``weight_bits``, ``gradient_bits``, ``hpz``,
    ``block_size``, ``error_feedback``, ``topology``, ``ranks_per_node``), checked when the callback is made.
    ``enable`` runs once per model: a second ``train()`` on the same Trainer keeps the comms (and their
    error-feedback state) installed by the first. ``topology`` holds the ``zeropp.comm.Topology`` used, after
    training began.
    """

    def __init__(self, **enable_kwargs: Any) -> None:
        bad = sorted(set(enable_kwargs) - _ENABLE_KWARGS)
        if bad:
            raise TypeError(
                f"ZeroppCallback got {bad}, which zeropp.fsdp.enable does not take; it takes {sorted(_ENABLE_KWARGS)}"
            )
        self.enable_kwargs = enable_kwargs
        self.topology = None
        self._enabled: nn.Module | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is self._enabled:
            return
        if model is None or not any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                f"ZeroppCallback: the Trainer's model ({type(model).__name__}) holds no FSDP2 module; it serves "
                "TrainingArguments(fsdp=True, fsdp_config={'version': 2}). For a DeepSpeed config, call "
                "zeropp.deepspeed.install() before train() instead"
            )
        self.topology = fsdp.enable(model, **self.enable_kwargs)
        self._enabled = model
