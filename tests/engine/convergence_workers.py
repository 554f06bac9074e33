"""Worker for ``test_convergence.py``: the same training job with exact ZeRO-3 and with full ZeRO++, in one process
group (start-up costs seconds), on real text from ``zeropp.data``."""

from __future__ import annotations

import time

import torch

import zeropp
from zeropp.data import TextBatches, stdlib_corpus
from zeropp.models import GPT, GPTConfig

MODEL = GPTConfig.preset("tiny")
SEQ, GLOBAL_BATCH, LR = 32, 16, 1e-3
CORPUS_BYTES = 1 << 20
EVAL_BATCHES, EVAL_SEED = 16, 777


def train(rank: int, world: int, zero: dict, steps: int, data: TextBatches, evals: list) -> dict:
    """Train the tiny GPT ``steps`` AdamW steps with ``zero`` (the ``zero_optimization`` block); return the per-step
    training losses (averaged over the ranks) and the eval loss on ``evals`` (mean over batches and ranks)."""
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_clipping": 1.0,
              "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=config)
    losses = torch.zeros(steps)
    start = time.perf_counter()
    for step in range(steps):
        inputs, targets = data.micro_batch(step, rank=rank, world_size=world)
        _, loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
    seconds = time.perf_counter() - start
    engine.eval()
    with torch.no_grad():
        ev = torch.tensor([sum(engine(*b)[1].item() for b in evals) / len(evals)])
    engine.comm.all_reduce_sum(losses)
    engine.comm.all_reduce_sum(ev)
    return {"losses": (losses / world).tolist(), "eval": ev.item() / world, "seconds": seconds}


def exact_vs_zeropp(rank: int, world: int, steps: int = 200, variants: dict | None = None) -> dict:
    """Exact ZeRO-3, then ZeRO-3 with qwZ (int8), hpZ (2) and qgZ (int4), block 128 (the defaults), same seeds and
    data; eval on held-out crops (another seed), each rank its own quarter of the eval batches."""
    data = TextBatches(stdlib_corpus(CORPUS_BYTES), seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=0)
    held_out = TextBatches(data.corpus, seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=EVAL_SEED)
    evals = [held_out.micro_batch(k, rank=rank, world_size=world) for k in range(EVAL_BATCHES)]
    zeropp_flags = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    out = {
        "exact": train(rank, world, {"stage": 3}, steps, data, evals),
        "zeropp": train(rank, world, {"stage": 3, **zeropp_flags}, steps, data, evals),
    }
    for name, extra in (variants or {}).items():
        out[name] = train(rank, world, {"stage": 3, **zeropp_flags, **extra}, steps, data, evals)
    return out
