"""Workers for test_weight_deltas.py: ``zeropp.weight_deltas`` on 4 gloo ranks as 2 emulated nodes of 2, hpZ 2.

One function runs every case in one process group; the checks that need one rank's view raise there, the rest is
returned for the test. Rank ``r`` takes sample ``r`` of each global batch of ``text_batches`` (the tiny GPT of
``engine_workers``, AdamW lr 3e-3, fp32 unless said), so runs of different settings see the same data per rank.
"""

from __future__ import annotations

from unittest import mock

import torch
from engine_workers import MODEL, gather_masters, text_batches

import zeropp
from zeropp.engine.collectives import Collectives
from zeropp.models import GPT

HPZ = 2
EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def config(zeropp_block: dict | None = None, *, hpz: int = HPZ, every_gather: bool = True,
           dtype: str = "fp32", qwz: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz, **(EVERY_GATHER if every_gather else {}),
                                 "zero_quantized_weights": qwz, "zeropp": zeropp_block or {}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def deltas(bits: int = 4, **extra) -> dict:
    return {"weight_deltas": True, "delta_bits": bits, **extra}


def _engine(cfg: dict):
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=cfg)
    return engine


def _backward(engine, loss, spoil: bool = False) -> None:
    """``engine.backward(loss)``; with ``spoil``, one weight's gradient NaN on this rank (a step to skip)."""
    handle = None
    if spoil:
        weight = dict(engine.module.named_parameters())["blocks.0.mlp.c_fc.weight"]
        handle = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    engine.backward(loss)
    if handle is not None:
        handle.remove()


def _forward_backward(engine, batch, rank: int, spoil: bool = False) -> float:
    x, y = batch
    _, loss = engine(x[rank : rank + 1], y[rank : rank + 1])
    _backward(engine, loss, spoil)
    return float(loss)


def _train(engine, data, rank: int) -> list[float]:
    losses = []
    for batch in data:
        losses.append(_forward_backward(engine, batch, rank))
        engine.step()
    return losses


def _check_consistent(engine) -> None:
    """Every rank's secondary equals, bit for bit, the reconstructions its owners keep of their shards."""
    tier = engine.weight_deltas
    for unit in tier.units:
        every = torch.empty(unit.full.numel(), dtype=unit.full.dtype)
        zeropp.comm.all_gather(tier.reconstruction(unit), topology=engine.topology, out=every)
        a, b = unit.secondary_range()
        assert torch.equal(unit.secondary, every[a:b]), unit.name


def qwz_values(x: torch.Tensor, bits: int = 8, block: int = 128) -> torch.Tensor:
    """Plain torch, from the format's definition (``zeropp.quant.format``): ``x`` (fp32, whole blocks) quantized per
    block of ``block`` (``scale = absmax / qmax``, ``code = round_half_even(x * (1 / scale))`` with the product
    exact, an all-zero block all zeros) and dequantized (``code * scale`` in fp32)."""
    qmax = 2 ** (bits - 1) - 1
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(dim=1, keepdim=True) / qmax
    product = blocks.double() * (1 / scale).double()  # 24 x 24 significant bits: exact in float64
    codes = torch.where(scale > 0, torch.round(product), 0.0).clamp(-qmax, qmax)
    return (codes.float() * scale).view(-1)


def _check_forward(engine, bits: int | None) -> None:
    """Whole (persistent) units hold what this step's forward computed with: the owners' reconstructions (gathered
    exactly), exact without qwZ, under qwZ dequantize(quantize(.)) in ``bits`` per block (``qwz_values``), bit for
    bit, on every rank."""
    tier = engine.weight_deltas
    for unit in tier.units:
        assert unit.gathered, unit.name
        every = torch.empty(unit.full.numel(), dtype=unit.full.dtype)
        zeropp.comm.all_gather(tier.reconstruction(unit), topology=engine.topology, out=every)
        want = every if bits is None else qwz_values(every, bits)
        assert torch.equal(unit.full, want), (unit.name, float((unit.full - want).abs().max()))
        assert bits is None or not torch.equal(want, every), unit.name  # quantized: the check can tell


def _state(engine) -> dict[str, torch.Tensor]:
    tier = engine.weight_deltas
    out = {f"secondary{k}": u.secondary.clone() for k, u in enumerate(tier.units)}
    out.update({f"reconstruction{k}": tier.reconstruction(u).clone() for k, u in enumerate(tier.units)})
    out.update({f"master{k}": u.master.clone() for k, u in enumerate(engine.units)})
    return out


def tracked_run(rank: int, world: int, steps: int) -> dict:
    """int4 deltas, checked after every step: consistency, the error bound, the bytes."""
    engine = _engine(config(deltas(4)))
    tier = engine.weight_deltas
    shards = [u.shard_numel for u in tier.units]
    _check_consistent(engine)
    losses, errors, gather_inter, exchange = [], [], [], []
    for batch in text_batches(steps, world, seed=99):
        before = [tier.reconstruction(u).clone() for u in tier.units]
        zeropp.comm.reset_stats()
        losses.append(_forward_backward(engine, batch, rank))
        gather_inter.append(zeropp.comm.stats()["all_gather"]["sent_inter"])
        zeropp.comm.reset_stats()
        engine.step()
        stats = zeropp.comm.stats()
        exchange.append({**stats["exchange"], "all_gather_inter": stats["all_gather"]["sent_inter"]})
        _check_consistent(engine)
        worst = 0.0
        for unit, old in zip(tier.units, before):
            w = unit.shard
            assert torch.equal(w, unit.master)  # fp32: the compute shard is the master
            q = zeropp.quant.quantize(w - old, bits=4, block_size=128)
            scale = q.scales.repeat_interleave(128)[: w.numel()]
            err = (w - tier.reconstruction(unit)).abs()
            rounding = 2.0**-23 * (w.abs() + 7 * scale)  # the fp32 product and sum
            bound = 0.5 * scale * (1 + 2.0**-20) + rounding
            assert bool((err <= bound).all()), (unit.name, float((err - bound).max()))
            worst = max(worst, float(err.max()))
        errors.append(worst)
    return {"losses": losses, "errors": errors, "gather_inter": gather_inter, "exchange": exchange,
            "resident": tier.resident_bytes, "shards": shards}


def exact_run(rank: int, world: int, steps: int, cfg: dict) -> dict:
    engine = _engine(cfg)
    losses = _train(engine, text_batches(steps, world, seed=99), rank)
    return {"losses": losses, "masters": gather_masters(engine)[0]}


def refresh_every_step(rank: int, world: int, steps: int, qwz: bool = False) -> dict:
    """delta_refresh_interval 1 against hpZ with exact weights (default persistence: persistent units too), on the
    same flat layout: weight deltas align every parameter to the quantization block, and a different layout alone
    changes the last bits (which elements fall in the vectorized optimizer kernels' tails). ``qwz``: both with qwZ
    (int8), where the deltas' quantized intra-node gathers must give what hpZ's qwZ gather gives."""
    out = {}
    for name, block in (("hpz", {}), ("refresh1", deltas(4, delta_refresh_interval=1))):
        with mock.patch.object(Collectives, "alignment", property(lambda self: self.block_size)):
            engine = _engine(config(block, every_gather=False, qwz=qwz))
            losses = _train(engine, text_batches(steps, world, seed=7), rank)
        out[name] = {"losses": losses, "masters": gather_masters(engine)[0]}
    same = out["hpz"]["losses"] == out["refresh1"]["losses"] and all(
        torch.equal(out["hpz"]["masters"][k], v) for k, v in out["refresh1"]["masters"].items())
    return {"identical": same, "losses": out["refresh1"]["losses"]}


def resume(rank: int, world: int, steps: int, save_at: int, path: str, qwz: bool = False) -> dict:
    """Save at ``save_at`` then refresh, against a fresh engine loading that checkpoint (a load refreshes)."""
    data = text_batches(steps, world, seed=11)
    first = _engine(config(deltas(4), qwz=qwz))
    _train(first, data[:save_at], rank)
    first.save_checkpoint(path, tag="mid")
    first.refresh_weight_deltas()
    _check_consistent(first)
    tail = _train(first, data[save_at:], rank)
    second = _engine(config(deltas(4), qwz=qwz))
    second.load_checkpoint(path, tag="mid")
    _check_consistent(second)
    resumed = _train(second, data[save_at:], rank)
    _check_consistent(second)
    a, b = gather_masters(first)[0], gather_masters(second)[0]
    identical = tail == resumed and all(torch.equal(a[k], b[k]) for k in a) and all(
        torch.equal(x, y) for x, y in zip(_state(first).values(), _state(second).values()))
    return {"identical": identical}


def skip_nonfinite(rank: int, world: int, qwz: bool = False) -> dict:
    """A NaN gradient on rank 1 at the second step: the step is skipped, secondaries and reconstructions stay.
    Default persistence (the tiny GPT's units all persist: gathered once per step, from the secondaries too). Every
    step: the forward's weights (``_check_forward``; int8 under ``qwz``) and the gathers' bytes, returned."""
    engine = _engine(config(deltas(4), every_gather=False, qwz=qwz))
    assert engine.persistent
    data = text_batches(4, world, seed=3)
    kept, gather_inter, gather_intra = [], [], []
    for step, batch in enumerate(data):
        before = _state(engine)
        zeropp.comm.reset_stats()
        _forward_backward(engine, batch, rank, spoil=step == 1 and rank == 1)
        gather_inter.append(zeropp.comm.stats()["all_gather"]["sent_inter"])
        gather_intra.append(zeropp.comm.stats()["all_gather"]["sent_intra"])
        _check_forward(engine, 8 if qwz else None)
        engine.step()
        after = _state(engine)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        kept.append((engine.was_step_applied(), unchanged))
        _check_consistent(engine)
    return {"kept": kept, "gather_inter": gather_inter, "gather_intra": gather_intra}


def bf16_run(rank: int, world: int, steps: int) -> dict:
    """bf16 compute: the reconstructions stay bit-identical on senders and holders; the error against the bf16
    compute shard stays within the format's bound plus one bf16 rounding of the sum."""
    engine = _engine(config(deltas(4), dtype="bf16"))
    tier = engine.weight_deltas
    errors = []
    for batch in text_batches(steps, world, seed=5):
        before = [tier.reconstruction(u).float() for u in tier.units]
        _forward_backward(engine, batch, rank)
        engine.step()
        _check_consistent(engine)
        for unit, old in zip(tier.units, before):
            w = unit.shard.float()
            scale = zeropp.quant.quantize(w - old, bits=4, block_size=128).scales.repeat_interleave(128)[: w.numel()]
            r = tier.reconstruction(unit).float()
            bound = 0.5 * scale * (1 + 2.0**-20) + 2.0**-8 * (w.abs() + 7 * scale)
            assert bool(((w - r).abs() <= bound).all()), unit.name
            errors.append(float((w - r).abs().max()))
    return {"max_error": max(errors)}


def full_zeropp(rank: int, world: int, steps: int) -> dict:
    """With qwZ and int4 qgZ (error feedback) and 2 accumulation steps: every gather stays inside the node and the
    secondaries stay consistent."""
    cfg = config(deltas(4, error_feedback=True))
    cfg["gradient_accumulation_steps"] = 2
    cfg["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True)
    engine = _engine(cfg)
    gather_inter, losses = [], []
    for batch in text_batches(steps, 2 * world, seed=13):
        x, y = batch
        zeropp.comm.reset_stats()
        for k in range(2):
            sample = (x[k * world :], y[k * world :])
            losses.append(_forward_backward(engine, sample, rank))
            engine.step()
            gather_inter.append(zeropp.comm.stats()["all_gather"]["sent_inter"])
        _check_consistent(engine)
    return {"gather_inter": gather_inter, "losses": losses}


def int8_refresh(rank: int, world: int, steps: int) -> dict:
    """``delta_refresh_bits: 8``: the refresh at construction is one exchange of int8 packs (its bytes returned);
    after it and after every step the secondaries equal the reconstructions bit for bit, and right after it each
    reconstruction is within half an int8 step of its weights' block (plus fp32 rounding)."""
    zeropp.comm.reset_stats()
    engine = _engine(config(deltas(4, delta_refresh_bits=8)))
    exchange = dict(zeropp.comm.stats()["exchange"])
    tier = engine.weight_deltas
    _check_consistent(engine)
    within = True
    for unit in tier.units:
        w, r = unit.shard, tier.reconstruction(unit)
        scale = (w.view(-1, 128).abs().amax(dim=1) / 127).repeat_interleave(128)
        within &= bool(((w - r).abs() <= 0.5 * scale * (1 + 2.0**-20) + 2.0**-23 * (w.abs() + 127 * scale)).all())
        within &= not torch.equal(w, r)  # quantized, not exact
    losses = _train(engine, text_batches(steps, world, seed=21), rank)
    _check_consistent(engine)
    return {"exchange": exchange, "within": within, "losses": losses}


def scheduled_against_synchronous(rank: int, world: int, steps: int, path: str) -> dict:
    """The exchange left in flight after each step and landed at each unit's first gather (prefetched or not) against
    the same run landing every part right after the exchange (``WeightDeltas.after_step`` then ``settle``: the
    synchronous path), both int4 deltas with int8 qwZ, every unit gathered at each use, 2 micro-batches per step, a
    NaN gradient on rank 1 at step 2 (skipped), a no-grad forward and a ``save_checkpoint`` right after step 3 (both
    before any gather of the next step) and a ``state_dict`` after step 4. Returned: per micro-batch the loss and
    the logits, the eval logits, the state dict, the final masters, secondaries and reconstructions, and per step
    how many units still had their part in flight right after ``step()`` and how many gathers the first forward
    of each step started ahead (``Prefetcher.started``; only for the scheduled run)."""
    data = text_batches(steps, 2 * world, seed=17)
    runs = {}
    for name in ("scheduled", "synchronous"):
        cfg = config(deltas(4), qwz=True)
        cfg["gradient_accumulation_steps"] = 2
        engine = _engine(cfg)
        tier = engine.weight_deltas
        after_step = tier.after_step
        if name == "synchronous":
            tier.after_step = lambda order, f=after_step, t=tier: (f(order), t.settle())
        outputs, in_flight, prefetched, extra = [], [], [], {}
        for step, (x, y) in enumerate(data):
            for k in range(2):
                sample = x[k * world + rank : k * world + rank + 1], y[k * world + rank : k * world + rank + 1]
                started = engine.prefetcher.started
                logits, loss = engine(*sample)
                if k == 0:
                    prefetched.append(engine.prefetcher.started - started)
                _backward(engine, loss, spoil=step == 2 and k == 1 and rank == 1)
                engine.step()
                outputs.append((float(loss), logits.detach().clone()))
            in_flight.append(sum(u.landing is not None for u in tier.units))
            if step == 3:
                with torch.no_grad():
                    extra["eval"] = engine(*data[0])[0].clone()
                engine.save_checkpoint(f"{path}_{name}", tag="mid")
            if step == 4:
                extra["state_dict"] = engine.state_dict()
        runs[name] = {"outputs": outputs, "in_flight": in_flight, "prefetched": prefetched,
                      "masters": gather_masters(engine)[0],
                      "state": _state(engine), "skipped": engine.skipped_steps, **extra}
    a, b = runs["scheduled"], runs["synchronous"]
    identical = {
        "outputs": all(la == lb and torch.equal(xa, xb) for (la, xa), (lb, xb) in zip(a["outputs"], b["outputs"])),
        "eval": torch.equal(a["eval"], b["eval"]),
        "state_dict": all(torch.equal(v, b["state_dict"][k]) for k, v in a["state_dict"].items()),
        "masters": all(torch.equal(v, b["masters"][k]) for k, v in a["masters"].items()),
        "state": all(torch.equal(v, b["state"][k]) for k, v in a["state"].items()),
    }
    return {"identical": identical, "in_flight": a["in_flight"], "sync_in_flight": b["in_flight"],
            "prefetched": a["prefetched"],
            "units": len(engine.weight_deltas.units), "skipped": (a["skipped"], b["skipped"]),
            "losses": [loss for loss, _ in a["outputs"]]}


def all_cases(rank: int, world: int, steps: int, path: str) -> dict:
    return {
        "tracked": tracked_run(rank, world, steps),
        "exact": exact_run(rank, world, steps, config(hpz=1)),
        "refresh": refresh_every_step(rank, world, 4),
        "refresh_qwz": refresh_every_step(rank, world, 3, qwz=True),
        "resume": resume(rank, world, 8, 4, path),
        "resume_qwz": resume(rank, world, 4, 2, path + "_qwz", qwz=True),
        "skip": skip_nonfinite(rank, world),
        "skip_qwz": skip_nonfinite(rank, world, qwz=True),
        "bf16": bf16_run(rank, world, 4),
        "full": full_zeropp(rank, world, 3),
        "int8_refresh": int8_refresh(rank, world, 2),
        "scheduled": scheduled_against_synchronous(rank, world, 6, path + "_scheduled"),
    }
