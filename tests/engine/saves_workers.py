"""Workers for test_saves.py (issue 20, part 1): a stage-3 save from one rank never hangs. Run on every rank by
``engine_launch.launch``.

A PEFT LoRA model (``peft.get_peft_model`` on a tiny token model) is trained at stage 3; the reference is the same
PEFT model built on one process from the same seeds and trained with ``torch.optim.AdamW(fused=True)`` on the
whole global batch (``stage3_workers.train_reference``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from stage3_workers import FREE_ALL, TokenNet, lora_batches, train_engine, train_reference
from torch import nn

import zeropp
from zeropp import comm
from zeropp.engine import EngineUsageError


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(TokenNet):
    """Embedding, two blocks (the engine's units), head: the base model PEFT adds LoRA adapters to."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)


def peft_model(seed: int) -> nn.Module:
    """The base model and its LoRA adapters (PEFT freezes the base), from ``seed``; the same on every process."""
    torch.manual_seed(seed)
    base = Net()
    torch.manual_seed(seed + 1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"]))


def config(timeout: float, zero: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, **FREE_ALL, **(zero or {}),
                                  "zeropp": {"entry_check_timeout": timeout}}}


def timed_error(fn) -> tuple[float, str]:
    """Call ``fn``, which must raise ``EngineUsageError``; return the seconds it took and the message."""
    start = time.monotonic()
    try:
        fn()
    except EngineUsageError as e:
        return time.monotonic() - start, str(e)
    raise AssertionError("no EngineUsageError")


def suite(rank: int, world: int, save_dir: str, timeout_s: float, hpz: int) -> dict:
    """Train, then: (a) ``with engine.gathered_parameters(): if rank == 0: save`` (PEFT's ``save_pretrained`` and
    ``torch.save(model.state_dict())``), (b) ``if rank == 0: model.save_pretrained(d)`` without the block, which
    must raise within the bound; at world 2 also a rank other than the first calling alone, and ``state_dict``
    inside a block holding only some units (every rank: those units read, the others gathered); at world 4
    ``comm.Arrival`` with one rank missing."""
    out: dict = {}
    steps = 3
    data = lora_batches(steps, 2 * world)
    model = peft_model(seed=3)
    ref = peft_model(seed=3)
    zero = {"zero_hpz_partition_size": hpz} if hpz > 1 else {}
    engine, _, _, _ = zeropp.initialize(model=model, config=config(timeout_s, zero))
    train_engine(engine, rank, world, data, steps)
    train_reference(ref, data, steps)
    assert all(p.numel() == 0 for p in model.parameters())  # every unit sharded and freed
    masters = engine.consolidated_state_dict()  # the exact fp32 weights (fp32 compute: what the shards hold)
    out["adapter_ref"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(ref).items()}
    out["full_ref"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    out["adapter_exact"] = get_peft_model_state_dict(model, state_dict=masters)
    out["full_exact"] = masters
    adapter_dir, full_path = Path(save_dir) / "adapter", Path(save_dir) / "model.pt"

    # (a) the documented pattern: gathered once on every rank, written by one rank without communicating
    with engine.gathered_parameters():
        if rank == 0:
            calls = comm.stats()["all_gather"]["calls"]
            model.save_pretrained(adapter_dir)
            torch.save(model.state_dict(), full_path)
            out["sub"] = model.base_model.model.blocks[1].fc2.state_dict()  # a submodule of a unit
            out["gathers_while_saving"] = comm.stats()["all_gather"]["calls"] - calls
    assert all(p.numel() == 0 for p in model.parameters())  # freed again
    if rank == 0:
        out["adapter_saved"] = load_file(str(adapter_dir / "adapter_model.safetensors"))
        out["full_saved"] = torch.load(full_path)
    dist.barrier()  # the other ranks left the block at once and wait here, in an ordinary collective

    if world == 4:  # comm.Arrival itself: all arrive, then every rank but one
        bound = timedelta(seconds=timeout_s)
        arrival = comm.Arrival(list(range(world)), bound)
        arrival.wait_all(bound)
        if rank != 2:
            start = time.monotonic()
            try:
                arrival.wait_all(bound)
            except comm.ArrivalError as e:
                out["partial"] = (time.monotonic() - start, e.missing)
        dist.barrier()

    if world == 2:
        # state_dict inside a block holding one unit, on every rank: that unit read, the others gathered
        block = model.base_model.model.blocks[0]
        with engine.gathered_parameters(block):
            partial = model.state_dict()
        out["partial_equal"] = partial.keys() == masters.keys() and all(
            torch.equal(partial[k], masters[k]) for k in masters)
        dist.barrier()

        # a rank other than the first alone, on an engine over a topology of its own (a failed check closes the
        # check group that the engines over one topology share)
        topology = comm.Topology(group=dist.new_group(list(range(world))))
        other, _, _, _ = zeropp.initialize(model=peft_model(seed=3), config=config(timeout_s), topology=topology)
        if rank == world - 1:
            out["follower"] = timed_error(lambda: other.module.state_dict())
        dist.barrier()

    # (b) the mistake: a save from one rank without the block raises on that rank within the bound
    if rank == 0:
        out["alone"] = timed_error(lambda: model.save_pretrained(Path(save_dir) / "never"))
        out["wrote_nothing"] = not (Path(save_dir) / "never" / "adapter_model.safetensors").exists()
    dist.barrier()  # the other ranks went on to here and waited for rank 0 in an ordinary collective
    # afterwards every checked call raises at once on every rank (the ranks are out of step): no hang
    out["after"] = timed_error(lambda: engine.consolidated_state_dict())
    return out
