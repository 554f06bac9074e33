"""qwZ blocks under FSDP2: per-parameter blocks (what ``zeropp.fsdp`` runs) against blocks cut from FSDP2's flat
all-gather input (which straddle parameters).

    python bench/fsdp_blocks.py                      # tiny and small GPT, 4 ranks, int8 and int4, block 128
    python bench/fsdp_blocks.py --presets tiny --train-steps 100

FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_all_gather``) all-gathers one flat buffer per ``fully_shard``-ed
module: on rank ``r``, the concatenation, in the module's parameter order, of every parameter's dim-0 shard ``r``
(``ceil(dim0 / P)`` rows, zero-padded), flattened, nothing in between. Blocks cut from that buffer ("flat", what
``zeropp.fsdp`` ran first) may hold the end of one parameter and the start of the next (a LayerNorm gain of ~1
beside a weight of ~0.02). ``zeropp.fsdp`` now quantizes every parameter's shard on its own ("per-param", as
zeropp's engine does): its all-gather stages each segment at a block boundary (``ZeroppAllGather``), so the codes
are those of each shard quantized alone and the packed bytes are the sum over shards of ``packed_bytes``. This
script rebuilds FSDP2's layout for a GPT wrapped as the benchmarks wrap it (``fully_shard`` per block, then the
root: embeddings, final norm), round-trips each rank's buffer through ``zeropp.quant`` both ways, and reports, per
parameter, the relative L2 error ``||w' - w|| / ||w||`` of the reassembled tensor (float64), the packed bytes of
both layouts, and the loss of the model on held-out text with the round-tripped weights (what qwZ's forward sees),
for:

* ``init``: GPT-2 initialisation (LayerNorm gains 1, biases 0, weights N(0, 0.02));
* ``trained``: after ``--train-steps`` AdamW steps (lr 1e-3, batch 16 x 64 bytes) on the stdlib text corpus;
* ``trained, gains x10``: the trained weights with every LayerNorm gain multiplied by 10, a stand-in for the large
  gains of big trained models (the loss is then not meaningful and is not shown).

A parameter with ``||w|| = 0`` (zero biases at init) reports its absolute error (it is exact either way).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from zeropp.data import TextBatches, stdlib_corpus
from zeropp.models import GPT, GPTConfig
from zeropp.quant import BlockFormat, dequantize_chunks, quantize_chunks


def fsdp_groups(model: GPT) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters of each FSDP2 unit in FSDP2's order: one per block, then the root's (the rest, once each)."""
    groups, seen = [], set()
    for i, block in enumerate(model.blocks):
        groups.append([(f"blocks.{i}.{n}", p) for n, p in block.named_parameters()])
        seen.update(id(p) for _, p in groups[-1])
    groups.append([(n, p) for n, p in model.named_parameters() if id(p) not in seen])
    return groups


def shard(p: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s padded dim-0 shard of ``p``, flat (FSDP2's all-gather input for that parameter)."""
    rows = math.ceil(p.shape[0] / world)
    out = torch.zeros(rows, *p.shape[1:], dtype=p.dtype)
    part = p.detach()[rank * rows:(rank + 1) * rows]
    out[: part.shape[0]] = part
    return out.reshape(-1)


def round_trip(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    out = torch.empty_like(x)
    return dequantize_chunks(quantize_chunks(x, fmt), fmt, 1, x.numel(), out)


def quantized_weights(model: GPT, world: int, fmt: BlockFormat, flat: bool) -> dict[str, torch.Tensor]:
    """Every parameter after a qwZ round trip of each rank's shard, blocks cut from the module buffer (``flat``)
    or from each parameter's shard, reassembled into full tensors."""
    out: dict[str, torch.Tensor] = {}
    for group in fsdp_groups(model):
        per_rank = []
        for r in range(world):
            parts = [shard(p, world, r) for _, p in group]
            if flat:
                per_rank.append(torch.split(round_trip(torch.cat(parts), fmt), [t.numel() for t in parts]))
            else:
                per_rank.append([round_trip(t, fmt) for t in parts])
        for i, (name, p) in enumerate(group):
            rows = math.ceil(p.shape[0] / world)
            full = torch.cat([per_rank[r][i].view(rows, *p.shape[1:]) for r in range(world)])
            out[name] = full[: p.shape[0]]
    return out


def rel_error(w: torch.Tensor, q: torch.Tensor) -> float:
    diff = (q.double() - w.double()).norm().item()
    norm = w.double().norm().item()
    return diff / norm if norm > 0 else diff


def eval_loss(model: GPT, weights: dict[str, torch.Tensor] | None, batches: list) -> float:
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        if weights is not None:
            for n, p in model.named_parameters():
                p.copy_(weights[n])
        loss = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return loss


def train(model: GPT, steps: int, data: TextBatches) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        x, y = data.micro_batch(step, rank=0, world_size=1)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def report(label: str, model: GPT, world: int, bits: int, block: int, batches: list, loss: bool) -> None:
    fmt = BlockFormat(bits, block)
    flat, per = quantized_weights(model, world, fmt, True), quantized_weights(model, world, fmt, False)
    rows = []
    for name, p in model.named_parameters():
        rows.append((name, tuple(p.shape), p.detach().abs().max().item(), rel_error(p, flat[name]),
                     rel_error(p, per[name])))
    worst = sorted(rows, key=lambda r: r[3] / max(r[4], 1e-30), reverse=True)[:6]
    ln = [r for r in rows if ".ln" in r[0] or r[0].startswith("ln_")]
    big = [r for r in rows if len(r[1]) == 2]
    print(f"\n{label}, int{bits}, block {block}, {world} ranks")
    print(f"  {'parameter':<28} {'shape':<12} {'max|w|':>8} {'flat err':>10} {'per-param':>10} {'ratio':>6}"
          "   (per-param: what zeropp.fsdp runs)")
    for name, shape, amax, e_flat, e_per in worst:
        ratio = e_flat / max(e_per, 1e-30)
        print(f"  {name:<28} {shape!s:<12} {amax:8.3g} {e_flat:10.3e} {e_per:10.3e} {ratio:6.2f}")

    def mean(rs: list, i: int) -> float:
        return sum(r[i] for r in rs) / max(len(rs), 1)

    print(f"  mean over LayerNorm params: flat {mean(ln, 3):.3e}, per-param {mean(ln, 4):.3e}; over 2-D weights: "
          f"flat {mean(big, 3):.3e}, per-param {mean(big, 4):.3e}; worst flat/per-param ratio "
          f"{max(r[3] / max(r[4], 1e-30) for r in rows):.2f}")
    flat_bytes = sum(fmt.packed_bytes(sum(shard(p, world, 0).numel() for _, p in g)) for g in fsdp_groups(model))
    per_bytes = sum(fmt.packed_bytes(shard(p, world, 0).numel()) for g in fsdp_groups(model) for _, p in g)
    print(f"  packed bytes per rank per forward (all units): per-param (zeropp.fsdp) {per_bytes}, flat "
          f"{flat_bytes}: per-param {per_bytes / flat_bytes - 1:+.2%}")
    if loss:
        base = eval_loss(model, None, batches)
        lf, lp = eval_loss(model, flat, batches), eval_loss(model, per, batches)
        print(f"  held-out loss: fp32 {base:.5f}, per-param (zeropp.fsdp) {lp:.5f} ({lp / base - 1:+.4%}), flat "
              f"{lf:.5f} ({lf / base - 1:+.4%}); flat - per-param {lf - lp:+.5f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--world", type=int, default=4, help="ranks of the shard group (default 4)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--bits", default="8,4")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    corpus = stdlib_corpus()
    data = TextBatches(corpus, seq_len=64, global_batch=16, seed=0)
    held = TextBatches(corpus, seq_len=64, global_batch=16, seed=777)
    batches = [held.micro_batch(k, rank=0, world_size=1) for k in range(8)]
    bits = [int(b) for b in args.bits.split(",")]
    start = time.perf_counter()
    for preset in args.presets.split(","):
        model = GPT(GPTConfig.preset(preset, block_size=64), seed=0)
        for b in bits:
            report(f"{preset} init", model, args.world, b, args.block_size, batches, True)
        t0 = time.perf_counter()
        train(model, args.train_steps, data)
        print(f"\n({preset}: {args.train_steps} training steps in {time.perf_counter() - t0:.0f} s)")
        for b in bits:
            report(f"{preset} trained", model, args.world, b, args.block_size, batches, True)
        with torch.no_grad():
            for name, q in model.named_parameters():
                if (".ln" in name or name.startswith("ln_")) and name.endswith("weight"):
                    q.mul_(10)
        for b in bits:
            report(f"{preset} trained, gains x10", model, args.world, b, args.block_size, batches, False)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
