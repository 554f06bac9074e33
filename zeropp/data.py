"""Real text for training runs that need no download: the Python standard library's own sources, as bytes.

Every machine that runs zeropp has them (``sysconfig.get_paths()["stdlib"]``), so the engine tests, the end-to-end
benchmark and the demo train the byte-level GPT presets on real, learnable text. The corpus is the top-level
``*.py`` files of the stdlib in file-name order, concatenated (each followed by a newline), cut at ``max_bytes``;
its exact content depends on the Python version, so compare runs made with one interpreter.

``TextBatches`` cuts the corpus into global batches of random crops, the same on every rank for a given seed, and
hands each rank its micro-batches::

    data = TextBatches(stdlib_corpus(), seq_len=64, global_batch=8, seed=0)
    inputs, targets = data.global_batch(step)              # (8, 64) int64 each: targets are inputs shifted by one
    inputs, targets = data.micro_batch(step, rank=r, world_size=4, micro=0, micro_batches=1)   # (2, 64)
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

DEFAULT_CORPUS_BYTES = 4 << 20


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the concatenated top-level stdlib sources, as int64 token ids (0..255)."""
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be at least 2 (one input and one target byte), got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        if total >= max_bytes:
            break
        chunk = path.read_bytes() + b"\n"
        parts.append(chunk)
        total += len(chunk)
    if total < 2:
        raise FileNotFoundError(f"no Python sources found under {root}: this interpreter ships without its stdlib")
    data = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


class TextBatches:
    """Deterministic global batches of ``global_batch`` random crops of ``seq_len + 1`` tokens from ``corpus``.

    Batch ``step`` depends on ``seed`` and ``step`` alone (not on how many batches were drawn before), so a resumed
    run or another rank sees the same data. Rank ``r`` of ``P``, micro-batch ``k`` of ``K`` takes rows
    ``[(k * P + r) * m, (k * P + r + 1) * m)`` of the global batch, ``m = global_batch / (P * K)``: one optimizer
    step over all ranks and micro-batches sees exactly the global batch.
    """

    def __init__(self, corpus: torch.Tensor, *, seq_len: int, global_batch: int, seed: int = 0) -> None:
        if corpus.dim() != 1 or corpus.numel() < seq_len + 2:
            raise ValueError(
                f"the corpus must be a 1-D tensor longer than seq_len + 1 = {seq_len + 1} tokens, got shape "
                f"{tuple(corpus.shape)}"
            )
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of step ``step``, each ``(global_batch, seq_len)`` int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.corpus.numel() - self.seq_len - 1, (self.global_batch_size,), generator=g)
        rows = starts[:, None] + torch.arange(self.seq_len + 1)
        tokens = self.corpus[rows]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def micro_batch(
        self, step: int, *, rank: int, world_size: int, micro: int = 0, micro_batches: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s micro-batch ``micro`` (of ``micro_batches``) of step ``step`` (see the class docstring)."""
        parts = world_size * micro_batches
        if self.global_batch_size % parts:
            raise ValueError(
                f"global_batch {self.global_batch_size} is not divisible by world_size * micro_batches = {parts}"
            )
        if not (0 <= rank < world_size and 0 <= micro < micro_batches):
            raise ValueError(f"rank {rank} / micro {micro} out of range for world_size {world_size}, "
                             f"micro_batches {micro_batches}")
        m = self.global_batch_size // parts
        row = (micro * world_size + rank) * m
        inputs, targets = self.global_batch(step)
        return inputs[row : row + m], targets[row : row + m]
