"""The engine on a given device against plain single-process training there: agreement and step time.

    torchrun --nproc-per-node 1 bench/engine_device.py --device cuda --backend nccl          # world size 1, NCCL
    ZEROPP_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 bench/engine_device.py --device cuda --backend gloo
    torchrun --nproc-per-node 1 bench/engine_device.py --device cuda --backend nccl --dtype bf16
    torchrun --nproc-per-node 1 bench/engine_device.py                                        # CPU, gloo

Every rank trains the byte-level GPT (``--preset``) on the stdlib text corpus (``zeropp.data``) for ``--steps``
steps in each config (ZeRO-3 exact; with more than one rank also full ZeRO++: qwZ, hpZ over the ranks of a node,
qgZ), and, on its own, the same model without zeropp (the reference):

* ``--dtype fp32``: ``torch.optim.AdamW`` on the whole global batch;
* ``--dtype bf16`` (the engine's ``bf16`` config: bf16 compute, fp32 masters, gradients averaged in fp32): a bf16
  copy of the model runs each rank's micro-batch, the bf16 gradients are averaged in fp32, AdamW steps fp32
  masters, which are rounded back into the bf16 model (``tests/engine/precision_workers.py``'s reference loop).

The first rank prints one row per config: the largest relative L2 difference of any parameter's fp32 master to
the reference after training, the distance of all masters to the reference relative to the reference's update
(``||masters - ref|| / ||ref - initial||``), the final losses, and the median step time next to the plain run's
(at world size 1 that ratio is the engine's overhead; with several ranks on one GPU it is not a speed figure).
``check``: exact ZeRO-3 must be within 1% of the update (a summation order can flip a bf16 rounding; a real
defect costs O(1)), ZeRO++ (quantized) within 100% and finite; the exit status is 1 otherwise. Several ranks on
one GPU need gloo: NCCL refuses two ranks on one device.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import zeropp
from zeropp.data import TextBatches, stdlib_corpus
from zeropp.models import GPT, GPTConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_run(cfg: GPTConfig, data: TextBatches, steps: int, lr: float, device: torch.device, world: int,
              bf16: bool) -> tuple:
    """Training without zeropp (see the module docstring): (fp32 parameters or masters by name, their initial
    values, last loss, step times)."""
    model = GPT(cfg, seed=0).to(device)
    if bf16:
        model = model.bfloat16()
        params = dict(model.named_parameters())
        weights = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
    else:
        weights = dict(model.named_parameters())
    initial = {n: w.detach().float().clone() for n, w in weights.items()}
    opt = torch.optim.AdamW(list(weights.values()), lr=lr, weight_decay=0.01, foreach=False)
    times, loss = [], None
    for step in range(steps):
        if bf16:
            batches = [tuple(t.to(device) for t in data.micro_batch(step, rank=r, world_size=world))
                       for r in range(world)]
        else:
            batches = [tuple(t.to(device) for t in data.global_batch(step))]
        _sync(device)
        start = time.perf_counter()
        if bf16:  # each rank's micro-batch in bf16, the gradients averaged in fp32
            sums = {n: torch.zeros_like(w) for n, w in weights.items()}
            loss = 0.0
            for x, y in batches:
                _, micro_loss = model(x, y)
                micro_loss.float().backward()
                loss = loss + micro_loss.detach().float() / world
                for n, p in params.items():
                    sums[n] += p.grad.float()
                    p.grad = None
            for n, w in weights.items():
                w.grad = sums[n] / world
        else:
            _, loss = model(*batches[0])
            loss.backward()
        opt.step()
        opt.zero_grad()
        if bf16:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(weights[n])
        _sync(device)
        times.append(time.perf_counter() - start)
    return {n: w.detach() for n, w in weights.items()}, initial, float(loss), times


def engine_run(cfg: GPTConfig, data: TextBatches, steps: int, lr: float, device: torch.device, zero: dict,
               bf16: bool = False) -> tuple:
    """The engine on this rank's micro-batches: (consolidated fp32 masters, mean last loss, step times); with
    ``bf16`` the model computes in bfloat16 (fp32 masters)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": data.global_batch_size // world,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
              "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": 3, **zero}}
    engine, _, _, _ = zeropp.initialize(model=GPT(cfg, seed=0).to(device), config=config)
    times, loss = [], None
    for step in range(steps):
        x, y = (t.to(device) for t in data.micro_batch(step, rank=rank, world_size=world))
        _sync(device)
        start = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    mean = loss.detach().float().reshape(1).clone()
    engine.comm.all_reduce_sum(mean)
    return engine.consolidated_state_dict(), mean.item() / world, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (each rank uses cuda:LOCAL_RANK mod device count)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--preset", default="mini")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="compute dtype of the engine and of the reference (bf16: the engine's bf16 config, fp32 "
                        "masters)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    rpn = int(os.environ.get("ZEROPP_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE") or world)
    # no biases: the attention key bias has an identically zero gradient, whose rounding noise Adam turns into O(lr)
    # steps, so any change of summation order would move it (see tests/engine/engine_workers.py)
    cfg = GPTConfig.preset(args.preset, block_size=args.seq, bias=False)
    data = TextBatches(stdlib_corpus(), seq_len=args.seq, global_batch=args.global_batch, seed=0)
    configs = {"zero3": {}}
    if world > 1:
        configs["zeropp"] = {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                             "zero_hpz_partition_size": rpn}
    bf16 = args.dtype == "bf16"
    runs = {name: engine_run(cfg, data, args.steps, args.lr, device, zero, bf16) for name, zero in configs.items()}
    ref, initial, ref_loss, ref_times = plain_run(cfg, data, args.steps, args.lr, device, world, bf16)
    plain_s = statistics.median(ref_times[args.warmup:])
    flat = lambda d: torch.cat([d[n].reshape(-1).float().to(device) for n in sorted(ref)])  # noqa: E731
    want, start = flat(ref), flat(initial)
    rows, failed = [], []
    for name, (masters, loss, times) in runs.items():
        worst = max(((masters[n].to(device) - w).norm() / w.norm()).item() for n, w in ref.items())
        to_update = ((flat(masters) - want).norm() / (want - start).norm()).item()
        bound = 1.0 if name == "zeropp" else 1e-2
        ok = math.isfinite(worst) and math.isfinite(loss) and to_update <= bound
        failed += [] if ok else [name]
        step_s = statistics.median(times[args.warmup:])
        rows.append(f"| {name:6} | {worst:.2e} | {to_update:.2e} | {loss:.4f} | {ref_loss:.4f} | {step_s * 1e3:9.1f} | "
                    f"{plain_s * 1e3:9.1f} | {step_s / plain_s:5.3f} | {'PASS' if ok else 'FAIL'} (<= {bound:g}) |")
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"{name}, torch {torch.__version__}, {args.backend}, world size {world} ({rpn} per node), "
              f"{args.preset} GPT {args.dtype}, global batch {args.global_batch} x {args.seq}, median of "
              f"{args.steps - args.warmup} steps after {args.warmup}")
        print("| config | max rel. param diff vs plain | rel. to update | loss | plain loss | step ms | plain step ms "
              "| ratio | check |")
        print("|--------|------------------------------|----------------|------|------------|---------|---------------"
              "|-------|-------|")
        print("\n".join(rows))
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
