"""Workers for tests/deepspeed: DeepSpeed's ZeRO-3 engine on its CPU accelerator over gloo, with and without
``zeropp.deepspeed.install()``, training the byte-level GPT (``zeropp.models.gpt``) from one seed."""

from __future__ import annotations

import math
import os
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "exact": {},
    "qwz": {"zero_quantized_weights": True},
    "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": "rpn", "zero_quantized_gradients": True},
}
BLOCK = 128  # zeropp.quant.DEFAULT_BLOCK_SIZE, the block both collectives use
SCALE_BYTES = 4


def _model(vocab: int, dtype: str) -> Any:
    import torch

    from zeropp.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny", vocab_size=vocab), seed=0)
    return model.to(torch.bfloat16) if dtype == "bf16" else model


def _engine(name: str, vocab: int, dtype: str, ranks_per_node: int) -> Any:
    import deepspeed
    import torch

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every parameter partitioned and gathered
    zero.update({k: ranks_per_node if v == "rpn" else v for k, v in CONFIGS[name].items()})
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "steps_per_print": 10**9,
              "bf16": {"enabled": dtype == "bf16"}}
    model = _model(vocab, "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _shard_bound(full: Any, world: int, bf16: bool) -> Any:
    """Per element of ``full``, the largest error an int8 qwZ gather may make: half the scale of its block, the
    blocks being ``BLOCK`` elements of each rank's DeepSpeed shard (``ceil(numel / world)`` elements from
    ``rank * shard``), plus the rounding of the dequantized value to bf16."""
    import torch

    flat = full.detach().float().reshape(-1)
    shard = math.ceil(flat.numel() / world)
    bound = torch.empty_like(flat)
    for start in range(0, flat.numel(), shard):
        part = flat[start:start + shard]
        for b in range(0, part.numel(), BLOCK):
            block = part[b:b + BLOCK]
            bound[start + b:start + b + block.numel()] = block.abs().max() / 254 * (1 + 2**-20)
    if bf16:
        bound += (flat.abs() + bound) * 2**-8
    return bound.view_as(full)


def train(rank: int, world: int, *, cases: list[str], steps: int, vocab: int, dtype: str,
          ranks_per_node: int) -> dict[str, Any]:
    """Train each case (a key of ``CONFIGS``, run after ``install()`` unless ``exact``) for ``steps`` steps from
    the same model and data. Returns per case the losses, zeropp's byte counters over the steps, and for qwZ
    cases how the weights forward used at step 0 compare with the exact ones (the worst error / bound ratio and
    how many differ); also the install/uninstall checks."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(ranks_per_node))
    import deepspeed
    import deepspeed.ops
    import torch
    from deepspeed.runtime.zero import partition_parameters, stage3

    import zeropp.deepspeed
    from zeropp import comm

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    originals = (partition_parameters.CUDAQuantizer, partition_parameters.Init._convert_to_deepspeed_param,
                 stage3.all_to_all_quant_reduce)
    reference = _model(vocab, dtype)
    exact_weights = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    shard_sizes = [math.ceil(p.numel() / world) for p in reference.parameters()]  # the tied weight once
    g = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, vocab, (2, 32), generator=g) for _ in range(steps)]
    out: dict[str, Any] = {}
    for name in cases:
        if name == "exact":
            zeropp.deepspeed.uninstall()
        else:
            zeropp.deepspeed.install()
            zeropp.deepspeed.install()  # a second call is a no-op
        engine = _engine(name, vocab, dtype, ranks_per_node)
        seen: dict[str, Any] = {}

        def capture(module: Any, _inputs: Any) -> None:
            for pname, p in module.named_parameters(recurse=False):
                full = f"{names[module]}.{pname}" if names[module] else pname
                seen.setdefault(full, p.data.detach().clone())

        names = {m: n for n, m in engine.module.named_modules()}
        hooks = [m.register_forward_pre_hook(capture) for m in engine.module.modules()]
        comm.reset_stats()
        losses = []
        for step, x in enumerate(batches):
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step == 0:
                for h in hooks:
                    h.remove()
        record: dict[str, Any] = {"losses": losses, "stats": comm.stats()}
        ratios, differ, equal = [], 0, 0
        for pname, used in seen.items():
            ref = exact_weights[pname]
            err = (used.float() - ref.float()).abs()
            ratios.append(float((err / _shard_bound(ref, world, dtype == "bf16").clamp_min(1e-30)).max()))
            differ += int((err > 0).sum())
            equal += int(torch.equal(used, ref))
        record.update(worst_ratio=max(ratios), differ=differ, params_equal=equal, params_seen=len(seen),
                      dtypes=sorted({str(t.dtype) for t in seen.values()}))
        record["padded_shard_elems"] = sum(math.ceil(s / BLOCK) * BLOCK for s in shard_sizes)
        out[name] = record
        engine.destroy()
    zeropp.deepspeed.uninstall()
    out["restored"] = originals == (partition_parameters.CUDAQuantizer,
                                    partition_parameters.Init._convert_to_deepspeed_param,
                                    stage3.all_to_all_quant_reduce)
    return out
