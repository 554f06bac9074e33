"""Workers for test_combos.py: issue 24's settings combined, stages 1-3 x fp32/bf16, one launch per world size.

``matrix`` trains the tiny GPT of ``engine_workers`` (no biases, AdamW lr 3e-3, one sample per rank per step, every
unit gathered at each use at stage 3) under each setting of ``SETTINGS`` beside the exact run of the same stage and
dtype (the reference), ``CLEAN`` steps, then one more step in which the last rank's gradient holds a NaN. Checked
here, on every rank (a failed check raises there): the spoiled step is skipped on every rank and leaves the masters,
compute shards, optimizer state, 1-bit momenta and worker errors, and weight-delta secondaries and reconstructions
bit for bit as they were, and the error-feedback residuals finite. Returned for the test (rank 0): per case, the
first step's reduced gradient against the reference's, per parameter (``||g - g_ref|| / ||g_ref||``), whether the
losses and masters equal the reference's bit for bit, the largest relative loss difference, and the weight-delta
checks.

``checkpoints`` saves under one setting and loads under another (stage 3); ``onebit`` runs
``onebit_workers.onebit_case`` (1-bit Adam against its float64 reference, in test_combos.py) with hpZ.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from engine_workers import MODEL, text_batches
from onebit_workers import onebit_case
from weight_deltas_workers import _check_consistent

import zeropp
from zeropp.engine.collectives import Collectives
from zeropp.models import GPT

CLEAN = 2
LR = 3e-3
WEIGHT = "blocks.0.mlp.c_fc.weight"
EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}
# embeddings (the head is tied to wte) and norms exact; MLPs int4 weights, int8 gradients; attention int2 gradients
# across nodes; the rest (wpe) the global int8 weights and int4 gradients
MIXED = [{"match": r"^wte\.|ln_", "weight_bits": None, "gradient_bits": None},
         {"match": r"\.mlp\.", "weight_bits": 4, "gradient_bits": 8},
         {"match": r"\.attn\.", "gradient_bits": 2}]
ALL_NULL = [{"match": "", "weight_bits": None, "gradient_bits": None}]


def settings(stage: int, hpz: int) -> dict[str, dict]:
    """Issue 24's settings at ``stage`` (``hpz``: the hpZ partition size the node layout allows, 1 for none), name
    -> ``{"zero": zero_optimization keys, "optimizer": optimizer block or absent}``:

    * ``exact-rules``: qwZ, qgZ (and hpZ) on, one rule making every parameter exact: exact ZeRO bit for bit;
    * ``zeropp24``: every new qgZ/qwZ setting at once: the ``MIXED`` rules, int8 inside the node, the Hadamard
      rotation with error feedback, and at stage 3 hpZ with int4 weight deltas;
    * ``onebit``: OneBitAdam (``freeze_step`` 1: the second step is compressed), at stage 3 with qwZ, hpZ and
      weight deltas.
    """
    s3 = stage == 3
    weights = {**QW, **({"zero_hpz_partition_size": hpz} if s3 and hpz > 1 else {})}
    deltas = {"weight_deltas": True} if s3 and hpz > 1 else {}
    return {
        "exact-rules": {"zero": {**weights, **QG, "zeropp": {"rules": ALL_NULL}}},
        "zeropp24": {"zero": {**weights, **QG, "zeropp": {"rules": MIXED, "gradient_bits_intra": 8,
                                                          "gradient_rotation": "hadamard", "error_feedback": True,
                                                          **deltas}}},
        "onebit": {"zero": {**weights, "zeropp": deltas},
                   "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "weight_decay": 0.1, "freeze_step": 1}}},
    }


def config(stage: int, dtype: str, zero: dict | None = None, optimizer: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": optimizer or {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, **(EVERY_GATHER if stage == 3 else {}), **(zero or {})}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def whole(engine, attr: str) -> dict[str, torch.Tensor]:
    """Each trainable parameter's ``attr`` (``"master"`` or ``"grad_shard"``) as float32, whole (an exact
    all-gather of each unit's shards), by name."""
    out = {}
    for unit in engine.units:
        shard = getattr(unit, attr)
        full = torch.empty(unit.full.numel(), dtype=shard.dtype)
        zeropp.comm.all_gather(shard, topology=engine.topology, out=full)
        for name, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
            out[name] = full[off : off + shape.numel()].float().view(shape).clone()
    return out


def state(engine) -> dict[str, torch.Tensor]:
    """What a skipped step must leave alone, bit for bit: masters, compute shards, whole parameters (stages 1-2),
    optimizer state and step counts, 1-bit momenta and errors, weight-delta secondaries and reconstructions."""
    out = {"steps": torch.tensor(engine.optimizer.steps)}
    for i, unit in enumerate(engine.units):
        out[f"master{i}"], out[f"shard{i}"] = unit.master.clone(), unit.shard.clone()
        if not unit.sharded:
            out[f"full{i}"] = unit.full.clone()
        for kind, ts in engine.optimizer.state.items():
            out[f"{kind}{i}"] = ts[i].clone()
    if engine.onebit is not None:
        for kind in ("momentum", "error"):
            for i, t in enumerate(getattr(engine.onebit, kind)):
                if t is not None:
                    out[f"onebit-{kind}{i}"] = t.clone()
    if engine.weight_deltas is not None:
        tier = engine.weight_deltas
        for i, unit in enumerate(tier.units):
            out[f"secondary{i}"] = unit.secondary.clone()
            out[f"reconstruction{i}"] = tier.reconstruction(unit).clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _residuals_finite(engine) -> bool:
    ts = [t for u in engine.units if u.error_feedback is not None
          for t in (u.error_feedback.residual, u.error_feedback.partial_residual) if t is not None]
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _step(engine, batch, rank: int, spoil: bool = False) -> float:
    """One step on this rank's sample of ``batch``; ``spoil``: a NaN in one element of ``WEIGHT``'s gradient.
    Returns the mean loss over the ranks."""
    x, y = batch
    _, loss = engine(x[rank : rank + 1], y[rank : rank + 1])
    handle = None
    if spoil:
        def hook(g):
            g = g.clone()
            g.view(-1)[3] = float("nan")
            return g
        handle = dict(engine.module.named_parameters())[WEIGHT].register_hook(hook)
    engine.backward(loss)
    if handle is not None:
        handle.remove()
    mean = loss.detach().float().reshape(1)
    dist.all_reduce(mean)
    engine.step()
    return mean.item() / dist.get_world_size()


def delta_error(engine, before: list[torch.Tensor]) -> float:
    """Weight deltas: the largest ``|w - r| / bound`` over this rank's shards after a step, ``w`` the compute shard,
    ``r`` its reconstruction, ``before`` the reconstructions before the step, ``bound`` half an int4 step of the
    scale of ``w - before`` (``zeropp.engine.weight_deltas``: ``|w - r| <= scale / 2`` per block) plus the compute
    dtype's rounding of ``r``. Below 1: within the bound."""
    tier = engine.weight_deltas
    worst = 0.0
    for unit, old in zip(tier.units, before):
        w, r = unit.shard.float(), tier.reconstruction(unit).float()
        scale = zeropp.quant.quantize(w - old.float(), bits=4, block_size=128).scales.repeat_interleave(128)
        eps = torch.finfo(unit.shard.dtype).eps
        bound = 0.5 * scale[: w.numel()] * (1 + 2.0**-20) + eps * (w.abs() + 7 * scale[: w.numel()])
        worst = max(worst, float(((w - r).abs() / bound).max()))
    return worst


def train(rank: int, world: int, cfg: dict, topology=None) -> dict:
    """``CLEAN`` steps and a spoiled one (checked here); returns the losses, the first step's reduced gradient, the
    masters after the clean steps, and for weight deltas the consistency and bound checks of every step."""
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=0), config=cfg, topology=topology)
    data = text_batches(CLEAN + 1, world, seed=17)
    losses, grads, deltas = [], {}, []
    for step, batch in enumerate(data[:CLEAN]):
        tier = engine.weight_deltas
        before = [tier.reconstruction(u).clone() for u in tier.units] if tier is not None else []
        if step == 0:
            x, y = batch
            _, loss = engine(x[rank : rank + 1], y[rank : rank + 1])
            engine.backward(loss)
            grads = whole(engine, "grad_shard")
            mean = loss.detach().float().reshape(1)
            dist.all_reduce(mean)
            engine.step()
            losses.append(mean.item() / world)
        else:
            losses.append(_step(engine, batch, rank))
        if engine.weight_deltas is not None:
            _check_consistent(engine)
            deltas.append(delta_error(engine, before))
    masters = whole(engine, "master")
    before, skipped = state(engine), engine.skipped_steps
    _step(engine, data[CLEAN], rank, spoil=rank == world - 1)
    assert not engine.was_step_applied() and engine.skipped_steps == skipped + 1, cfg
    assert _same(before, state(engine)), cfg
    assert _residuals_finite(engine), cfg
    if engine.weight_deltas is not None:
        _check_consistent(engine)
    return {"losses": losses, "grads": grads, "masters": masters, "deltas": deltas}


def compare(got: dict, ref: dict) -> dict:
    """What the test asserts about a case against its reference."""
    grad_error = {n: float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref["grads"].items()}
    return {"grad_error": grad_error,
            "identical": got["losses"] == ref["losses"] and _same(got["masters"], ref["masters"])
            and _same(got["grads"], ref["grads"]),
            "loss_error": max(abs(a - b) / b for a, b in zip(got["losses"], ref["losses"])),
            "deltas": got["deltas"]}


def matrix(rank: int, world: int, hpz: int, cells: list[tuple[int, str]]) -> dict:
    """Every setting of ``settings`` in each ``(stage, dtype)`` of ``cells`` against the exact run of that stage and
    dtype. ``hpz``: the hpZ partition size for stage 3 (1: none; weight deltas then run on a topology of one node,
    made here, in ``deltas-one-node``)."""
    out = {}
    for stage, dtype in cells:
        ref = train(rank, world, config(stage, dtype))
        for name, setting in settings(stage, hpz).items():
            got = train(rank, world, config(stage, dtype, setting["zero"], setting.get("optimizer")))
            out[f"{name}/s{stage}/{dtype}"] = compare(got, ref)
        if stage == 3 and hpz == 1:  # weight deltas need hpZ inside a node: all ranks as one node
            single = zeropp.comm.Topology(ranks_per_node=world)
            zero = {**QW, **QG, "zero_hpz_partition_size": world, "zeropp": {"weight_deltas": True}}
            got = train(rank, world, config(3, dtype, zero), topology=single)
            out[f"deltas-one-node/s3/{dtype}"] = compare(got, ref)
    return out


def _load(cfg: dict, path: str, tag: str, topology=None):
    engine, _, _, _ = zeropp.initialize(model=GPT(MODEL, seed=1), config=cfg, topology=topology)
    engine.load_checkpoint(path, tag=tag)
    return engine


def checkpoints(rank: int, world: int, hpz: int, path: str) -> dict:
    """Stage 3, fp32: a checkpoint saved under one setting loaded under another. Returns per pair whether the
    loaded masters equal the saved ones bit for bit, and the pair's own check:

    * ``deltas->off`` / ``off->deltas``: weight deltas saved, loaded without them (hpZ alone) and with them; a load
      refreshes exactly, so the next step of both is bit for bit the same (same flat layout: both aligned to the
      block, see ``weight_deltas_workers.refresh_every_step``);
    * ``rotation->off``: qgZ with the Hadamard rotation and error feedback saved, loaded unrotated: the rotated
      residuals are not carried into it (none held after the load);
    * ``rules->none``: mixed rules saved, loaded into exact ZeRO-3;
    * ``onebit-warmup``: OneBitAdam (``freeze_step`` 2) saved after step 1 and loaded, then 2 steps (into the
      compressed phase), against the uninterrupted run, bit for bit; ``onebit-compressed``: saved after step 3 (with
      hpZ when the nodes allow it) and loaded without hpZ, one step, against the uninterrupted run, bit for bit.
    """
    out = {}
    data = text_batches(5, world, seed=23)

    def masters_equal(engine, saved) -> bool:
        return _same(whole(engine, "master"), saved)

    if hpz > 1:
        aligned = mock.patch.object(Collectives, "alignment", property(lambda self: self.block_size))
        with aligned:
            zero = {"zero_hpz_partition_size": hpz}
            first = zeropp.initialize(model=GPT(MODEL, seed=0),
                                      config=config(3, "fp32", {**zero, "zeropp": {"weight_deltas": True}}))[0]
            for batch in data[:2]:
                _step(first, batch, rank)
            first.save_checkpoint(path, tag="deltas")
            saved = whole(first, "master")
            off = _load(config(3, "fp32", zero), path, "deltas")
            on = _load(config(3, "fp32", {**zero, "zeropp": {"weight_deltas": True}}), path, "deltas")
            loaded = masters_equal(off, saved) and masters_equal(on, saved)
            _step(off, data[2], rank)
            _step(on, data[2], rank)
            out["deltas<->off"] = loaded and _same(whole(off, "master"), whole(on, "master"))

    rot = {**QG, "zeropp": {"gradient_rotation": "hadamard", "error_feedback": True}}
    first = zeropp.initialize(model=GPT(MODEL, seed=0), config=config(3, "fp32", rot))[0]
    for batch in data[:2]:
        _step(first, batch, rank)
    assert all(u.error_feedback.residual is not None for u in first.units)
    first.save_checkpoint(path, tag="rot")
    plain = _load(config(3, "fp32", {**QG, "zeropp": {"error_feedback": True}}), path, "rot")
    out["rotation->off"] = (masters_equal(plain, whole(first, "master"))
                            and all(u.error_feedback.residual is None for u in plain.units))

    first = zeropp.initialize(model=GPT(MODEL, seed=0), config=config(3, "fp32", {**QW, **QG, "zeropp":
                                                                                   {"rules": MIXED}}))[0]
    for batch in data[:2]:
        _step(first, batch, rank)
    first.save_checkpoint(path, tag="rules")
    out["rules->none"] = masters_equal(_load(config(3, "fp32"), path, "rules"), whole(first, "master"))

    hp = {"zero_hpz_partition_size": hpz} if hpz > 1 else {}
    onebit = {"type": "OneBitAdam", "params": {"lr": LR, "weight_decay": 0.1, "freeze_step": 2}}
    first = zeropp.initialize(model=GPT(MODEL, seed=0), config=config(3, "fp32", hp, onebit))[0]
    for s, batch in enumerate(data[:4]):
        _step(first, batch, rank)
        if s == 0:
            first.save_checkpoint(path, tag="warmup")
        if s == 2:
            first.save_checkpoint(path, tag="compressed")
            mid = whole(first, "master")
    end = whole(first, "master")
    resumed = _load(config(3, "fp32", hp, onebit), path, "warmup")
    for batch in data[1:3]:
        _step(resumed, batch, rank)
    out["onebit-warmup"] = _same(whole(resumed, "master"), mid)
    resumed = _load(config(3, "fp32", {}, onebit), path, "compressed")
    _step(resumed, data[3], rank)
    out["onebit-compressed"] = _same(whole(resumed, "master"), end)
    return out


def onebit(rank: int, world: int, hpz: int, qwz: bool) -> dict:
    """``onebit_workers.onebit_case`` at stage 3 with hpZ (and qwZ when ``qwz``): 2 warmup steps, then 2 compressed
    steps recorded for the float64 reference. Its AdamW engine is laid out as OneBitAdam's (block-aligned): beyond
    2 ranks gloo's reduce-scatter sums in an order that depends on the layout, so the warmup is AdamW's bit for bit
    only on the same layout."""
    zero = {**(QW if qwz else {}), **({"zero_hpz_partition_size": hpz} if hpz > 1 else {})}
    with mock.patch.object(Collectives, "alignment", property(lambda self: self.block_size)):
        return onebit_case(rank, world, 3, 2, 2, 4, zero=zero)


def all_cases(rank: int, world: int, hpz: int, cells: list[tuple[int, str]], path: str | None = None,
              onebit_qwz: bool | None = None) -> dict:
    """``matrix``; ``checkpoints`` with ``path``; ``onebit`` unless ``onebit_qwz`` is None; in one launch."""
    out = {"matrix": matrix(rank, world, hpz, cells)}
    out["checkpoints"] = checkpoints(rank, world, hpz, path) if path else {}
    if onebit_qwz is not None:
        out["onebit"] = onebit(rank, world, hpz, onebit_qwz)
    return out if rank == 0 else {"checkpoints": out["checkpoints"]}
