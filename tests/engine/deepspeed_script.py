"""A training script written as for DeepSpeed, with ``import zeropp as deepspeed`` as the only change; run by
test_deepspeed_api.py under torchrun (2 ranks, gloo): argparse with ``add_config_arguments``, ``init_distributed``,
a model built under ``zero.Init``, ``initialize(args=...)``, the engine's queries, ``zero.GatheredParameters`` with
``modifier_rank=0``, ``save_fp16_model`` and ``destroy``. Each rank pickles what it saw to ``--out``/rank<r>.pkl.
"""

import argparse
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn

import zeropp as deepspeed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, batch):
        x, y = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.mse_loss(self.head(x).float(), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    deepspeed.init_distributed()  # already initialized: nothing happens
    rank = dist.get_rank()
    out = {"backend": dist.get_backend(), "world": dist.get_world_size(), "deepspeed_flag": args.deepspeed}

    with deepspeed.zero.Init():
        model = Net()
    model.layers[0].bias.requires_grad_(False)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                   model_parameters=[p for p in model.parameters() if p.requires_grad])
    out.update(stage=engine.zero_optimization_stage(), clipping=engine.gradient_clipping(),
               fp16=engine.fp16_enabled(), bf16=engine.bf16_enabled(), bfloat16=engine.bfloat16_enabled(),
               dp_world_size=engine.dp_world_size)

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(4)]
    for x, y in batches[rank::2]:
        loss = engine((x.to(engine.device, torch.bfloat16), y.to(engine.device)))
        engine.backward(loss)
        engine.step()

    head = engine.module.head.weight
    with deepspeed.zero.GatheredParameters(head, modifier_rank=0):
        out["gathered_shape"] = tuple(head.shape)
        if rank == 0:
            with torch.no_grad():
                head.fill_(0.25)
    plain = nn.Linear(2, 2)
    with deepspeed.zero.GatheredParameters(plain.parameters(), modifier_rank=0):  # not an engine's: a no-op
        with torch.no_grad():
            plain.weight.fill_(float(rank))
    out["plain_weight"] = plain.weight.detach().clone()

    x, y = batches[0]
    with torch.no_grad():
        out["loss"] = engine((x.to(engine.device, torch.bfloat16), y.to(engine.device))).item()
    out["consolidated"] = engine.consolidated_state_dict()
    out["saved"] = engine.save_fp16_model(args.out)
    out["saved_trainable"] = engine.save_fp16_model(args.out, "trainable.bin", exclude_frozen_parameters=True)

    engine.destroy()
    engine.destroy()  # a second call does nothing
    try:
        engine(batches[0])
    except Exception as e:  # EngineUsageError
        out["after_destroy"] = f"{type(e).__name__}: {e}"

    # stage 2 on an eagerly built model: after destroy() it is a plain model (whole weights, no engine hooks)
    eager = Net()
    stage2, *_ = deepspeed.initialize(model=eager, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2}})
    out["stage2"] = (stage2.zero_optimization_stage(), stage2.gradient_clipping(), stage2.bf16_enabled(),
                     stage2.fp16_enabled())
    with torch.no_grad():
        engine_loss = stage2(batches[0]).item()
    stage2.destroy()
    loss = eager(batches[0])
    loss.backward()  # the engine's gradient hooks would have taken .grad away for its reduce-scatter
    out["stage2_after_destroy"] = (loss.item() == engine_loss, all(p.grad is not None for p in eager.parameters()))
    with open(os.path.join(args.out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


if __name__ == "__main__":
    main()
