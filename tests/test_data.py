"""``zeropp.data``: the stdlib corpus and the batch cutting, against a plain re-reading of the files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from zeropp.data import TextBatches, stdlib_corpus


def test_corpus_is_the_stdlib_sources_in_name_order() -> None:
    corpus = stdlib_corpus(200_000)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    want = b"".join(f.read_bytes() + b"\n" for f in files)[:200_000]
    assert corpus.dtype == torch.long and corpus.numel() == len(want)
    assert bytes(corpus.to(torch.uint8).tolist()) == want


def test_micro_batches_tile_the_global_batch() -> None:
    corpus = stdlib_corpus(100_000)
    data = TextBatches(corpus, seq_len=16, global_batch=8, seed=3)
    x, y = data.global_batch(5)
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in range(8):  # each row is a crop of the corpus
        hits = [s for s in range(corpus.numel() - 16) if torch.equal(corpus[s : s + 16], x[row])]
        assert hits
    pieces = [data.micro_batch(5, rank=r, world_size=2, micro=k, micro_batches=2) for k in range(2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)
    assert torch.equal(torch.cat([p[1] for p in pieces]), y)
    assert torch.equal(TextBatches(corpus, seq_len=16, global_batch=8, seed=3).global_batch(5)[0], x)
    assert not torch.equal(data.global_batch(6)[0], x)


def test_bad_arguments_name_the_value() -> None:
    corpus = stdlib_corpus(1000)
    with pytest.raises(ValueError, match="not divisible"):
        TextBatches(corpus, seq_len=8, global_batch=6).micro_batch(0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="longer than seq_len"):
        TextBatches(corpus[:5], seq_len=8, global_batch=2)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(1)
