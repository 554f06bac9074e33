"""ZeRO++ for the Hugging Face ``transformers.Trainer``: one line per backend.

DeepSpeed (``TrainingArguments(deepspeed=<config with the ZeRO++ flags>)``): ``zeropp.deepspeed.install()`` before
``train()`` runs DeepSpeed's own engine on zeropp's collectives; nothing here is needed. FSDP2
(``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``): accelerate shards the model inside ``train()``, so
``zeropp.fsdp.enable`` must run after that and before the first forward, which is where the Trainer calls
``on_train_begin``; ``ZeroppCallback`` does it there:

    trainer = Trainer(..., callbacks=[zeropp.hf.ZeroppCallback(weight_bits=8, gradient_bits=4)])

docs/hf.md has hpZ on both backends (sharding the model yourself for FSDP2, and why ``"auto_wrap_policy":
"NO_WRAP"``), checkpoints and what is tested.
"""

from __future__ import annotations

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


class ZeroppCallback(TrainerCallback):
    """A ``TrainerCallback`` that turns on ZeRO++ (``zeropp.fsdp.enable``) on the Trainer's FSDP2 model when
    training begins.

    Its keyword arguments are ``zeropp.fsdp.enable``'s (``weight_bits``, ``gradient_bits``, ``hpz``,
    ``block_size``, ``error_feedback``, ``gradient_rotation``, ``topology``, ``ranks_per_node``), checked when the
    callback is made.
    ``enable`` runs once per model: a second ``train()`` on the same Trainer keeps the comms (and their
    error-feedback state) installed by the first. ``topology`` holds the ``zeropp.comm.Topology`` used, after
    training began.
    """

    def __init__(self, **enable_kwargs: Any) -> None:
        fsdp.check_enable_kwargs("ZeroppCallback", enable_kwargs)
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
