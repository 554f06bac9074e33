"""ZeRO++ for the Hugging Face ``transformers.Trainer``: one line per backend.

DeepSpeed (``TrainingArguments(deepspeed=<config with the ZeRO++ flags>)``): DeepSpeed's own ZeRO-3 engine runs
on zeropp's collectives once ``zeropp.deepspeed.install()`` has run, before the Trainer trains (the Trainer
builds the engine in ``train()``); nothing here is needed:

    zeropp.deepspeed.install()

FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``): accelerate shards the model with
``fully_shard`` inside ``train()``, so ``zeropp.fsdp.enable`` can only run after that and before the first
forward. ``Trainer.train`` calls its callbacks' ``on_train_begin`` exactly there (after ``accelerator.prepare``
and after a ``resume_from_checkpoint`` load, before the first batch), with the sharded model:

    trainer = Trainer(..., callbacks=[zeropp.hf.ZeroppCallback(weight_bits=8, gradient_bits=4)])

Checkpoints are unaffected: the weights and optimizer state stay FSDP2's own (DTensor shards), so the Trainer's
``save_model``, checkpoints and ``resume_from_checkpoint`` work as without zeropp. hpZ needs
``fully_shard(block, reshard_after_forward=N)``, which accelerate's plugin does not offer (transformers passes it
a bool): shard the model yourself with it before building the Trainer (accelerate keeps a model that is already
an FSDP2 module as it is) and pass ``hpz=N``.
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
