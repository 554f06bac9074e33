"""Worker functions for tests/engine/test_partition.py: MiCS (``zeropp.engine.partition``) on real gloo processes,
against plain single-process training (engine_workers.py's reference), its byte counters against the formulas, and
checkpoints moved between MiCS and ZeRO-3. One launch per layout runs every case."""

from __future__ import annotations

from pathlib import Path

import torch
from engine_workers import MODEL, batches, relative_errors, torch_optimizer

import zeropp
from zeropp import comm
from zeropp.comm.accounting import gather_traffic
from zeropp.config import ConfigError
from zeropp.models import GPT

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}


def _config(micro: int, accum: int, zero: dict, clip: float = 0.0) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "gradient_clipping": clip, "optimizer": ADAMW, "zero_optimization": zero}


def _train(engine, rank: int, world: int, micro: int, accum: int, data) -> None:
    """Micro-step ``k`` of rank ``r`` takes samples ``[(k * P + r) * m, ...)`` of each global batch."""
    for inputs, targets in data:
        for k in range(accum):
            lo = (k * world + rank) * micro
            _, loss = engine(inputs[lo : lo + micro], targets[lo : lo + micro])
            engine.backward(loss)
            engine.step()


def _expected_all_reduce(engine) -> dict[str, int]:
    """``comm.all_reduce``'s counters for one boundary: a ring all-reduce of every unit's fp32 gradient shard laid
    end to end over the replica group (``zeropp.comm.accounting``)."""
    mics = engine.mics
    numel = sum(u.shard_numel for u in engine.units)
    r = mics.replicas
    same = sum(mics.world.node_of(q) == mics.world.node for q in mics.replica_ranks)
    once = gather_traffic(-(-numel // r) * 4, r, same)
    t = once + once
    return {"calls": 1, "sent_intra": t.sent_intra, "sent_inter": t.sent_inter, "recv_intra": t.recv_intra,
            "recv_inter": t.recv_inter}


def mics_cases(rank: int, world: int, root: str, sizes: list[int], checkpoints: bool, steps: int = 4) -> dict:
    """For each MiCS group size in ``sizes`` (and accumulation 1 and 2, clipping on in the second): train against
    the single-process reference and return the worst relative errors; check the groups' layout, that every rank
    ends with the same weights, the byte counters of one boundary; then, with ``checkpoints``, move a checkpoint
    MiCS -> ZeRO-3 -> MiCS."""
    out: dict = {}
    for k in sizes:
        for micro, accum, clip in ((2, 1, 0.0), (1, 2, 0.5)):
            zero = {"stage": 3, "mics_shard_size": k} if accum == 1 else \
                {"stage": 3, "zeropp": {"partition": {"parameters": k, "gradients": k, "optimizer": k}}}
            config = _config(micro, accum, zero, clip)
            model, ref = GPT(MODEL, seed=rank), GPT(MODEL, seed=0)  # the engine starts from rank 0's weights
            engine, _, _, _ = zeropp.initialize(model=model, config=config)
            mics = engine.mics
            assert mics is not None and mics.size == k and engine.comm.world_size == k
            assert engine.world_size == world and engine.train_batch_size() == micro * accum * world
            node = mics.world.nodes[mics.world.node]
            assert set(mics.groups[mics.index]) <= set(node) or set(node) <= set(mics.groups[mics.index])
            ref_opt = torch_optimizer(ADAMW, list(ref.parameters()))
            data = batches(steps, micro * accum * world)
            norms = []
            for step, (inputs, targets) in enumerate(data):
                if step == steps - 1:
                    comm.reset_stats()
                _train(engine, rank, world, micro, accum, [(inputs, targets)])
                _, ref_loss = ref(inputs, targets)
                ref_loss.backward()
                if clip:
                    norms.append((engine.get_global_grad_norm(),
                                  torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()))
                ref_opt.step()
                ref_opt.zero_grad()
            stats = comm.stats()
            assert stats["all_reduce"] == _expected_all_reduce(engine), (stats["all_reduce"],
                                                                          _expected_all_reduce(engine))
            rs = stats["reduce_scatter"]
            same = sum(mics.world.node_of(q) == mics.world.node for q in mics.groups[mics.index])
            assert rs["sent_inter"] == 0 if same == k else rs["sent_inter"] > 0, rs
            for got, want in norms:
                assert abs(got - want) <= 1e-5 * want, (got, want)
            errors = relative_errors(engine.full_parameters(), ref)
            key = f"k{k}-m{micro}-a{accum}-clip{clip}"
            out[key] = {"norm": max(e[0] for e in errors.values()), "max": max(e[1] for e in errors.values())}
            out[key + "-weights"] = {n: float(p.double().sum()) for n, p in engine.full_parameters().items()}
            engine.destroy()
    if checkpoints:
        out.update(_checkpoints(rank, world, root, sizes[0]))
        try:  # initialize refuses what MiCS does not combine with, before building anything
            zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, {
                "stage": 3, "mics_shard_size": sizes[0], "zero_quantized_weights": True}))
            raise AssertionError("MiCS with qwZ was accepted")
        except ConfigError as e:
            out["refused"] = str(e)
    return out


def _checkpoints(rank: int, world: int, root: str, k: int) -> dict:
    """Save under MiCS over ``k``, load under ZeRO-3 over the world (the same weights, bit for bit), train both on,
    save under ZeRO-3 and load under MiCS (bit for bit)."""
    out: dict = {}
    data = batches(2, 2 * world)
    first, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=_config(2, 1, {"stage": 3,
                                                                                         "mics_shard_size": k}))
    _train(first, rank, world, 2, 1, data[:1])
    path = first.save_checkpoint(Path(root) / "ckpt", tag="mics")
    assert path == Path(root) / "ckpt" / "mics"
    saved = first.full_parameters()
    zero3, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=5), config=_config(2, 1, {"stage": 3}))
    zero3.load_checkpoint(Path(root) / "ckpt", tag="mics")
    assert all(torch.equal(saved[n], p) for n, p in zero3.full_parameters().items())
    _train(first, rank, world, 2, 1, data[1:])
    _train(zero3, rank, world, 2, 1, data[1:])
    out["resumed_zero3_vs_mics"] = max(e[0] for e in relative_errors(
        zero3.full_parameters(), _as_module(first.full_parameters())).values())
    zero3.save_checkpoint(Path(root) / "ckpt", tag="zero3")
    back, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=6), config=_config(2, 1, {"stage": 3,
                                                                                        "mics_shard_size": k}))
    back.load_checkpoint(Path(root) / "ckpt", tag="zero3")
    assert all(torch.equal(zero3.full_parameters()[n], p) for n, p in back.full_parameters().items())
    for e in (first, zero3, back):
        e.destroy()
    return out


def _as_module(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = GPT(MODEL, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    return model
