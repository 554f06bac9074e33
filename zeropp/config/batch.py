"""DeepSpeed's batch-size arithmetic: ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world size``, the missing values derived from the given ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import Problems
from .readers import as_int

_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def batch_sizes(p: Problems, config: Mapping[str, Any], world: int) -> tuple[int, int, int]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` for ``world`` ranks.

    Any two determine the third; ``train_batch_size`` alone or ``train_micro_batch_size_per_gpu`` alone mean one
    accumulation step; all three must agree. Problems go to ``p`` (then ``(1, 1, 1)`` is returned)."""
    read = {key: as_int(p, config[key], key, minimum=1) if config.get(key) is not None else None for key in _KEYS}
    if not p.ok(*_KEYS):
        return 1, 1, 1
    train, micro, accum = (read[key] for key in _KEYS)
    if train is None and micro is None:
        p.add("train_batch_size", "give train_batch_size or train_micro_batch_size_per_gpu (or both); "
                                  "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                                  f"world size ({world})")
        return 1, 1, 1
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world:
            p.add("train_batch_size", f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} * "
                                      f"gradient_accumulation_steps={accum} * world size {world} = "
                                      f"{micro * accum * world}; change one of them")
        return train, micro, accum
    if train is not None and micro is not None:
        if train % (micro * world):
            p.add("train_batch_size", f"train_batch_size={train} is not a multiple of train_micro_batch_size_per_gpu"
                                      f"={micro} * world size {world}; gradient_accumulation_steps would not be an "
                                      "integer")
            return train, micro, 1
        return train, micro, train // (micro * world)
    if train is not None:
        accum = 1 if accum is None else accum
        if train % (accum * world):
            p.add("train_batch_size", f"train_batch_size={train} is not a multiple of gradient_accumulation_steps="
                                      f"{accum} * world size {world}; train_micro_batch_size_per_gpu would not be an "
                                      "integer")
            return train, 1, accum
        return train, train // (accum * world), accum
    assert micro is not None
    accum = 1 if accum is None else accum
    return micro * accum * world, micro, accum
