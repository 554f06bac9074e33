"""Workers for tests/hf: ``transformers.Trainer`` on a tiny GPT-2 built from a config (no download), over the gloo
group ``comm_launch`` made, with DeepSpeed ZeRO-3 (its CPU accelerator) or accelerate's FSDP2, with and without
zeropp. Each run trains ``steps`` steps from one seed on the same data, saving a Trainer checkpoint at ``save_at``;
a resumed run continues from that checkpoint. ``hpz_trainers`` runs hpZ through both paths in one launch.

accelerate (1.x) serves FSDP only on GPU-like devices: on ``use_cpu`` it makes a MULTI_CPU (DDP) state and drops
the FSDP plugin. ``_fsdp_on_cpu`` makes its ``AcceleratorState`` keep the plugin on MULTI_CPU as it does on
MULTI_GPU (the same assignments), so that the Trainer runs accelerate's own FSDP2 path (``fully_shard`` by
its wrap policy, its FSDP checkpointing) on CPU.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

VOCAB, SEQ, BATCH = 250, 32, 2  # no multiple of 8; even (see fsdp_trainer)


def _setup_env(rank: int, world: int) -> None:
    # torchrun's variables, which transformers/accelerate read (the gloo group is already made by comm_launch)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import transformers

    transformers.logging.set_verbosity_error()


def _model() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def _dataset() -> Any:
    """Arithmetic sequences mod ``VOCAB`` with one of 8 strides: learnable, so the loss falls within a few dozen
    steps."""
    import torch

    g = torch.Generator().manual_seed(7)
    n = 256
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 9, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB

    class Sequences(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": ids[i], "labels": ids[i]}

    return Sequences()


def _args(out: Path, steps: int, save_at: int | None, **backend: Any) -> Any:
    """The runs' ``TrainingArguments``: a checkpoint at step ``save_at`` (``None``: no checkpoint), ``backend``'s
    arguments added."""
    from transformers import TrainingArguments

    saving = {"save_strategy": "no"} if save_at is None else {"save_strategy": "steps", "save_steps": save_at}
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=3e-3,
        logging_steps=1, save_only_model=False, report_to="none", disable_tqdm=True, seed=0, data_seed=0,
        **saving, **backend)


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _save_mismatches(trainer: Any, out: Path, whole: dict[str, Any]) -> list[str]:
    """``trainer.save_model(out)``, then what ``from_pretrained(out)`` loads differently from the ``whole`` weights
    (names missing, extra, or not equal bit for bit); empty when it loads them exactly."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    trainer.save_model(str(out))
    dist.barrier()
    # load whole, as a process without the Trainer would: while a Trainer's ZeRO-3 config is registered,
    # from_pretrained loads into DeepSpeed's zero.Init (partitioned parameters)
    unset_hf_deepspeed_config()
    loaded = dict(GPT2LMHeadModel.from_pretrained(str(out)).named_parameters())
    bad = [f"missing {n}" for n in sorted(set(whole) - set(loaded))] + [f"extra {n}" for n in sorted(set(loaded) - set(whole))]
    for n in sorted(set(whole) & set(loaded)):
        if not torch.equal(loaded[n], whole[n]):
            bad.append(f"{n}: max diff {(loaded[n].float() - whole[n].float()).abs().max().item():.3g}")
    return bad


def deepspeed_trainer(rank: int, world: int, *, steps: int, save_at: int, tmp: str, hpz: int = 1) -> dict[str, Any]:
    """Train DeepSpeed's exact ZeRO-3, then ZeRO-3 with qwZ and qgZ (and ``zero_hpz_partition_size=hpz``) after
    ``zeropp.deepspeed.install()``, then resume the latter from its checkpoint at ``save_at``. Per run: the losses by
    step, whether ``save_model`` + ``from_pretrained`` give the whole weights (assembled here from every rank's
    DeepSpeed partition), and the ranks of the parameters' hpZ groups (``[]`` for none)."""
    _setup_env(rank, world)
    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from transformers import Trainer

    import zeropp.deepspeed
    from zeropp import comm

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    def config(zeropp_flags: bool) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_gather_16bit_weights_on_model_save": True}
        if zeropp_flags:
            zero.update(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=hpz)
        return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto", "zero_optimization": zero, "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}

    def whole_weights(engine: Any) -> dict[str, Any]:
        """Each parameter from every rank's partition (``ds_tensor``), gathered with plain torch collectives."""
        out = {}
        for name, p in engine.module.named_parameters():
            parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
            dist.all_gather(parts, p.ds_tensor.detach())
            out[name] = torch.cat(parts)[: p.ds_numel].view(p.ds_shape)
        return out

    root = Path(tmp)
    results: dict[str, Any] = {}
    for name, flags, resume in (("exact", False, None), ("zeropp", True, None), ("resumed", True, "zeropp")):
        if flags:
            zeropp.deepspeed.install()
        else:
            zeropp.deepspeed.uninstall()
        out = root / name
        args = _args(out, steps, save_at, deepspeed=config(flags), ddp_backend="gloo")
        trainer = Trainer(model=_model(), args=args, train_dataset=_dataset())
        comm.reset_stats()
        checkpoint = None if resume is None else str(root / resume / f"checkpoint-{save_at}")
        trainer.train(resume_from_checkpoint=checkpoint)
        stats = comm.stats()
        hpz_groups = {tuple(dist.get_process_group_ranks(p.ds_zero_param_process_group))
                      if p.ds_zero_param_process_group is not None else () for p in trainer.model_wrapped.parameters()}
        results[name] = {
            "losses": _losses(trainer),
            "zeropp_bytes": sum(s.get("sent_inter", 0) + s.get("sent_intra", 0) for s in stats.values()),
            "hpz_groups": sorted(hpz_groups),
            "save_mismatches": _save_mismatches(trainer, root / f"{name}_model", whole_weights(trainer.model_wrapped)),
        }
        trainer.model_wrapped.destroy()
    zeropp.deepspeed.uninstall()
    return results


def _fsdp_on_cpu() -> None:
    import accelerate.state
    from accelerate.utils import DistributedType

    original = accelerate.state.AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            accelerate.state.PartialState._shared_state["distributed_type"] = self.distributed_type

    init._fsdp_on_cpu = True  # type: ignore[attr-defined]
    accelerate.state.AcceleratorState.__init__ = init


def fsdp_trainer(rank: int, world: int, *, steps: int, save_at: int, tmp: str) -> dict[str, Any]:
    """Train accelerate's FSDP2 without zeropp, with ``ZeroppCallback`` and exact comms, with int8/int4 comms, then
    resume the int8/int4 run from its checkpoint at ``save_at``. Per run: the losses by step, zeropp's byte
    counters, the FSDP2 modules' names, zeropp's warnings during ``train()``, and whether ``save_model`` +
    ``from_pretrained`` give the whole weights (``DTensor.full_tensor()`` of the trained shards)."""
    _setup_env(rank, world)
    _fsdp_on_cpu()
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer

    import zeropp.hf
    from zeropp import comm

    root = Path(tmp)
    runs = (("plain", None, None), ("exact", {"weight_bits": None, "gradient_bits": None}, None),
            ("zeropp", {"weight_bits": 8, "gradient_bits": 4}, None),
            ("resumed", {"weight_bits": 8, "gradient_bits": 4}, "zeropp"))
    results: dict[str, Any] = {}
    for name, enable_kwargs, resume in runs:
        out = root / name
        args = _args(out, steps, save_at, fsdp=True, fsdp_config={"version": 2}, use_cpu=True, ddp_backend="gloo")
        callbacks = [] if enable_kwargs is None else [zeropp.hf.ZeroppCallback(**enable_kwargs)]
        trainer = Trainer(model=_model(), args=args, train_dataset=_dataset(), callbacks=callbacks)
        comm.reset_stats()
        checkpoint = None if resume is None else str(root / resume / f"checkpoint-{save_at}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=checkpoint)
        stats = comm.stats()
        fsdp_modules = [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
        whole = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
        results[name] = {
            "losses": _losses(trainer),
            "fsdp_modules": fsdp_modules,
            "zeropp_warnings": [str(w.message) for w in caught if "zeropp" in str(w.message)],
            "stats": stats,
            "save_mismatches": _save_mismatches(trainer, root / f"{name}_model", whole),
        }
    return results


def fsdp_hpz_trainer(rank: int, world: int, *, steps: int, hpz: int, tmp: str) -> dict[str, Any]:
    """hpZ on the Trainer's FSDP2 path, as ``zeropp.hf`` documents it: the model is sharded before the Trainer is
    built, each GPT-2 block with ``fully_shard(block, reshard_after_forward=hpz)``, then the root, and the Trainer
    gets ``fsdp_config={"version": 2, "auto_wrap_policy": "NO_WRAP"}``; accelerate must keep the model as it is. Trains it without zeropp, then with ``ZeroppCallback(weight_bits=8, gradient_bits=4,
    hpz=hpz)``. Per run: the losses, zeropp's byte counters, whether the Trainer trained the very model given,
    the FSDP2 modules' names, each block's post-forward mesh shape, and the elements of one block."""
    _setup_env(rank, world)
    _fsdp_on_cpu()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import Trainer

    import zeropp.hf
    from zeropp import comm

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    for name, callbacks in (("plain", []), ("zeropp", [zeropp.hf.ZeroppCallback(weight_bits=8, gradient_bits=4,
                                                                                 hpz=hpz)])):
        model = _model()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=hpz)
        fully_shard(model, mesh=mesh)
        post_forward: list[list[int]] = []
        model.transformer.h[0].register_forward_hook(
            lambda m, a, o: post_forward.append(
                [list(p.device_mesh.shape) if isinstance(p, DTensor) else [] for p in m.parameters()]))
        # NO_WRAP: with its default (transformer-based) policy accelerate looks the block class up by name before
        # it sees the model is sharded, and fully_shard renamed it (FSDPGPT2Block): "Could not find GPT2Block"
        args = _args(Path(tmp) / f"fsdp_hpz_{name}", steps, None, fsdp=True,
                     fsdp_config={"version": 2, "auto_wrap_policy": "NO_WRAP"}, use_cpu=True, ddp_backend="gloo")
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=callbacks)
        comm.reset_stats()
        trainer.train()
        results[name] = {
            "losses": _losses(trainer),
            "stats": comm.stats(),
            "same_model": trainer.model is model and trainer.model_wrapped is model,
            "fsdp_modules": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
            "post_forward_mesh": {tuple(map(tuple, shapes)) for shapes in post_forward},
            "block_numel": sum(p.numel() for p in model.transformer.h[0].parameters()),
        }
    return results


def hpz_trainers(rank: int, world: int, *, steps: int, save_at: int, fsdp_steps: int, tmp: str,
                 hpz: int) -> dict[str, Any]:
    """One launch for hpZ through the Trainer: ``deepspeed_trainer`` with ``zero_hpz_partition_size=hpz``, then
    ``fsdp_hpz_trainer``. ``TrainingArguments`` resets accelerate's state between the two, but an ``Accelerator``
    given a DeepSpeed plugin sets ``$ACCELERATE_USE_DEEPSPEED`` for good, which would give the FSDP2 Trainer a
    DeepSpeed plugin too: it is dropped in between."""
    out = {"deepspeed": deepspeed_trainer(rank, world, steps=steps, save_at=save_at, tmp=tmp, hpz=hpz)}
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    out["fsdp"] = fsdp_hpz_trainer(rank, world, steps=fsdp_steps, hpz=hpz, tmp=tmp)
    return out
