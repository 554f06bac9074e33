"""Worker functions run on every rank by ``engine_launch.launch``. Each runs many checks in one process group
(start-up costs seconds) and returns a small summary; a failed check raises on the rank that saw it.

The reference is plain single-process training, computed on every rank independently of zeropp: the same tiny
GPT and seed, the whole global batch in one forward, ``torch.nn.utils.clip_grad_norm_`` and
``torch.optim.AdamW/Adam(fused=True)`` and ``SGD(foreach=True)``. The engine sees the same global batch cut into micro-batches:
micro-step ``k`` of rank ``r`` takes samples ``[(k * P + r) * m, (k * P + r + 1) * m)``.
"""

from __future__ import annotations

import functools

import torch

import zeropp
from zeropp.config import ConfigError
from zeropp.engine import EngineUsageError, units_of_type
from zeropp.models import GPT, GPTConfig
from zeropp.models.gpt import Block

SEQ = 16
# Without biases: the attention's key bias has an identically zero gradient (softmax ignores a shift shared by all
# keys), so its computed gradient is rounding noise, which Adam normalizes into O(lr) steps in a random direction:
# any change of summation order (here the batch split) then moves it by ~lr, engine bug or not.
MODEL = GPTConfig.preset("tiny", bias=False)


def batches(steps: int, batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of random byte tokens (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, MODEL.vocab_size, (batch, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def param_groups(model: torch.nn.Module, spec: str | None) -> list:
    """``None``: all trainable parameters; ``"decay"``: GPT-style groups, no weight decay on biases and norms."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if spec is None:
        return [p for _, p in trainable]
    decay = [p for _, p in trainable if p.dim() >= 2]
    rest = [p for _, p in trainable if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}]


def torch_optimizer(opt: dict, groups: list) -> torch.optim.Optimizer:
    kind, params = opt["type"], dict(opt.get("params", {}))
    if kind == "SGD":
        return torch.optim.SGD(groups, foreach=True, **params)
    if kind == "Adam" and not params.pop("adam_w_mode", True):
        return torch.optim.Adam(groups, fused=True, **params)
    return torch.optim.AdamW(groups, fused=True, **params)


def relative_errors(got: dict[str, torch.Tensor], ref: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """Per parameter: (||engine - reference|| / ||reference||, max |engine - reference| / max |reference|)."""
    out = {}
    for n, p in ref.named_parameters():
        diff, want = got[n] - p.detach(), p.detach()
        out[n] = ((diff.norm() / want.norm().clamp_min(1e-30)).item(),
                  (diff.abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return out


def train_matches_reference(
    rank: int, world: int, runs: list[dict], steps: int = 10
) -> dict[str, dict[str, float]]:
    """For each run (stage, micro batch, accumulation, clipping, optimizer, frozen, groups): train ``steps`` steps
    with the engine and with the reference; return, per run, the worst relative parameter errors (norm-wise and
    element-wise, see ``relative_errors``) and the relative error of the eval logits."""
    worst = {}
    for run in runs:
        micro, accum = run["micro"], run.get("accum", 1)
        optimizer = run.get("optimizer", {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}})
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
            "gradient_clipping": run.get("clip", 0.0),
            "optimizer": optimizer,
            "zero_optimization": {"stage": run["stage"]},
        }
        batch = micro * accum * world
        model, ref = GPT(MODEL, seed=0), GPT(MODEL, seed=0)
        for m in (model, ref):
            for name in run.get("frozen", []):
                m.get_parameter(name).requires_grad_(False)
        frozen_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
        policy = units_of_type(Block, torch.nn.LayerNorm) if run.get("policy") == "nested" else None
        engine, _, _, _ = zeropp.initialize(
            model=model, model_parameters=param_groups(model, run.get("groups")), config=config, unit_policy=policy
        )
        if policy is not None:  # block units with LayerNorm units inside them, and ln_f
            assert len(engine.units) == 1 + 3 * MODEL.n_layer + 1
        assert engine.config.train_batch_size == batch
        ref_opt = torch_optimizer(optimizer, param_groups(ref, run.get("groups")))
        norms = []
        for inputs, targets in batches(steps, batch):
            for k in range(accum):
                lo = (k * world + rank) * micro
                _, loss = engine(inputs[lo : lo + micro], targets[lo : lo + micro])
                engine.backward(loss)
                engine.step()
            _, ref_loss = ref(inputs, targets)
            ref_loss.backward()
            if run.get("clip"):
                norms.append((engine.get_global_grad_norm(),
                              torch.nn.utils.clip_grad_norm_(ref.parameters(), run["clip"]).item()))
            ref_opt.step()
            ref_opt.zero_grad()
        assert engine.global_steps == steps and engine.micro_steps == steps * accum
        for got, want in norms:
            assert abs(got - want) <= 1e-5 * want, (run, got, want)
        if run.get("clip"):
            assert any(want > run["clip"] for _, want in norms), "the clipping threshold never bit"
        if run["stage"] == 3 and world > 1:  # outside forward/backward a stage-3 unit holds only its shard
            assert all(not u.gathered and all(p.numel() == 0 for p in u.params) for u in engine.units)
        if world == 1:  # one rank: the shard is the whole buffer, never freed
            assert all(u.gathered and u.shard.data_ptr() == u.full.data_ptr() for u in engine.units)
            assert all(u.shard.numel() == -(-u.numel // world) for u in engine.units)
        errors = relative_errors(engine.full_parameters(), ref)
        for name, before in frozen_before.items():
            assert torch.equal(engine.full_parameters()[name], before), name
        # eval under no_grad: same logits as the reference, and stage 3 frees every unit again ...
        engine.eval()
        ref.eval()
        inputs = batches(1, 2, seed=99)[0][0]
        with torch.no_grad():
            logits, _ = engine(inputs)
            ref_logits, _ = ref(inputs)
        engine.train()
        # ... all but the persistent units (whole all the time, zeropp.engine.reuse)
        assert all(u.gathered == u.persistent for u in engine.units) or run["stage"] != 3 or world == 1
        logit_error = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        key = f"stage{run['stage']}-m{micro}-a{accum}-clip{run.get('clip', 0)}-{optimizer['type']}" + (
            "-frozen" if run.get("frozen") else "") + ("-groups" if run.get("groups") else "") + (
            "-nested" if run.get("policy") else "")
        worst[key] = {
            "norm": max(e[0] for e in errors.values()),
            "max": max(e[1] for e in errors.values()),
            "logits": logit_error,
        }
    return worst


def expect_error(messages: dict[str, str], kind: type[BaseException], key: str, fn) -> None:
    """Call ``fn``, which must raise ``kind``; keep the message under ``key`` (compared across ranks by the test)."""
    try:
        fn()
    except kind as e:
        messages[key] = str(e)
    else:
        raise AssertionError(f"{key}: no {kind.__name__}")


def usage_errors(rank: int, world: int) -> dict[str, str]:
    """Bad usage and bad configs raise clear errors, the same on every rank, and leave the engine usable."""
    messages: dict[str, str] = {}
    good = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3}}

    expect = functools.partial(expect_error, messages)

    # at initialize
    bf16, fp16 = {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}
    expect(ConfigError, "bf16_and_fp16", lambda: zeropp.initialize(model=GPT(MODEL), config={**good, **bf16, **fp16}))
    expect(ConfigError, "fp16_model_bf16_config", lambda: zeropp.initialize(model=GPT(MODEL).half(),
                                                                           config={**good, **bf16}))
    expect(ConfigError, "bf16_model_fp16_config", lambda: zeropp.initialize(model=GPT(MODEL).bfloat16(),
                                                                           config={**good, **fp16}))
    expect(ConfigError, "fp64_model_bf16_config", lambda: zeropp.initialize(model=GPT(MODEL).double(),
                                                                           config={**good, **bf16}))
    expect(ConfigError, "hpz_divides", lambda: zeropp.initialize(
        model=GPT(MODEL), config={**good, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2 * world}}))
    expect(ConfigError, "hpz_stage", lambda: zeropp.initialize(
        model=GPT(MODEL), config={**good, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}))
    expect(ConfigError, "unknown", lambda: zeropp.initialize(model=GPT(MODEL), config={**good, "fp61": {}}))
    expect(ConfigError, "no_optimizer", lambda: zeropp.initialize(
        model=GPT(MODEL), config={"train_micro_batch_size_per_gpu": 2}))
    expect(ConfigError, "client_optimizer", lambda: zeropp.initialize(
        model=GPT(MODEL), config=good, optimizer=torch.optim.SGD(GPT(MODEL).parameters(), lr=0.1)))
    expect(ConfigError, "bf16_model", lambda: zeropp.initialize(model=GPT(MODEL).bfloat16(), config=good))
    m = GPT(MODEL)
    expect(ValueError, "missing_param", lambda: zeropp.initialize(
        model=m, model_parameters=[p for n, p in m.named_parameters() if n != "wpe.weight"], config=good))

    # bad call order
    model = GPT(MODEL, seed=0)
    engine, _, _, _ = zeropp.initialize(model=model, config=good)
    x, y = batches(1, 2)[0]
    expect(EngineUsageError, "backward_before_forward", lambda: engine.backward(torch.ones((), requires_grad=True)))
    expect(EngineUsageError, "step_without_backward", engine.step)
    with torch.no_grad():
        _, loss = engine(x, y)
    expect(EngineUsageError, "backward_after_no_grad_forward", lambda: engine.backward(loss))
    _, loss = engine(x, y)
    expect(EngineUsageError, "loss_without_grad", lambda: engine.backward(loss.detach()))
    engine.backward(loss)
    expect(EngineUsageError, "backward_twice", lambda: engine.backward(loss))
    expect(EngineUsageError, "forward_before_step", lambda: engine(x, y))
    engine.step()  # the engine is still usable after all that
    expect(EngineUsageError, "step_twice", engine.step)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 2
    return messages


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.spare = torch.nn.Linear(8, 8)  # never used: its gradient stays None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Twice(torch.nn.Module):
    """Two units; layer 0 runs twice per forward (weights shared along the depth); each has an unused Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(2))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layers[0], self.layers[1], self.layers[0]):
            x = layer(x)
        return x.pow(2).mean()


def module_called_twice(rank: int, world: int, stage: int, zero: dict | None = None) -> float:
    """``Twice`` under the engine matches the reference: a unit's gradient is complete once, after both uses of
    its module; a unit with a parameter that got no gradient is reduced at the end of backward (SGD without
    weight decay leaves that parameter unchanged, as torch.optim does by skipping it)."""
    model, ref = Twice(), Twice()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1,
              "momentum": 0.9}}, "zero_optimization": {"stage": stage, **(zero or {})}}
    engine, _, _, _ = zeropp.initialize(model=model, config=config)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        data = torch.randn(4 * world, 8, generator=g)
        engine.backward(engine(data[rank * 4 : (rank + 1) * 4]))
        engine.step()
        ref(data).backward()
        opt.step()
        opt.zero_grad()
    return max(max(e) for e in relative_errors(engine.full_parameters(), ref).values())


class CheckpointedGPT(GPT):
    """The GPT with every block under non-reentrant activation checkpointing (recomputed in backward)."""

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T)))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        loss = torch.nn.functional.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss


def activation_checkpointing(rank: int, world: int, stage: int, steps: int = 3, zero: dict | None = None) -> float:
    """Blocks recomputed in backward (the stage-3 post-forward hook must not free a unit during recomputation)
    match the reference trained without checkpointing."""
    model, ref = CheckpointedGPT(MODEL, seed=0), GPT(MODEL, seed=0)
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3}}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer,
              "zero_optimization": {"stage": stage, **(zero or {})}}
    engine, _, _, _ = zeropp.initialize(model=model, config=config)
    ref_opt = torch_optimizer(optimizer, list(ref.parameters()))
    for inputs, targets in batches(steps, 2 * world):
        _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        ref(inputs, targets)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max(e[0] for e in relative_errors(engine.full_parameters(), ref).values())


def misc(rank: int, world: int) -> dict:
    """The usage errors, a module called twice per forward and activation checkpointing at each stage, and at
    stage 3 with hpZ (exact, so held to the same bar: the second call and the recomputation gather from the
    secondary shards) (one process group for all)."""
    hpz = {"zero_hpz_partition_size": world}
    return {
        "messages": usage_errors(rank, world),
        "twice": {**{stage: module_called_twice(rank, world, stage) for stage in (1, 2, 3)},
                  "3-hpz": module_called_twice(rank, world, 3, hpz)},
        "checkpointing": {**{stage: activation_checkpointing(rank, world, stage) for stage in (1, 2, 3)},
                          "3-hpz": activation_checkpointing(rank, world, 3, zero=hpz)},
    }


# ---- ZeRO++ (issue 4, phase 2) ------------------------------------------------------------------------------


TEXT = (
    "ZeRO++ cuts the bytes that cross the slow links between nodes: the weights travel as int8 codes with one "
    "scale per block, the backward gathers them inside the node from secondary shards, and the gradients are "
    "averaged by two all-to-alls of int4 codes, first inside the node and then across the nodes. "
)


def gather_masters(engine) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The fp32 master weights, whole (an exact all-gather of each unit's master shards): by parameter name, and
    each unit's whole flat buffer (padding included)."""
    masters, buffers = {}, []
    for unit in engine.units:
        full = torch.empty(unit.full.numel())
        zeropp.comm.all_gather(unit.master, topology=engine.topology, out=full)
        for pname, off, shape in zip(unit.param_names, unit.offsets, unit.shapes):
            masters[pname] = full[off : off + shape.numel()].view(shape).clone()
        buffers.append(full)
    return masters, buffers


def text_batches(steps: int, batch: int, seed: int = 4321) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of random crops of a repeated English text (learnable: the loss falls fast, so a
    comparison of losses says something, unlike on random bytes where every run sits at ln(256))."""
    data = torch.tensor(list((TEXT * 4).encode("utf-8")), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - SEQ - 1, (batch,), generator=g)
        tokens = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def state_bytes(engine) -> dict[str, int]:
    """Bytes of the engine's resident states on this rank after a step, by what ``zeropp.plan.memory`` calls them:
    ``params`` (the units' compute buffers and shards), ``grads`` (the fp32 gradient shards and, at ``(1, g, o)``,
    the accumulated rows), ``optimizer`` (fp32
    masters and the optimizer's states); each storage counted once, freed (resized to 0) ones not at all."""
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(key: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[key] += storage.nbytes()

    for u in engine.units:
        add("params", u.full)
        add("params", u.shard)
        add("grads", u.grad_shard)
        if u.grad_accumulator is not None:
            add("grads", u.grad_accumulator)
        add("optimizer", u.master)
    for tensors in engine.optimizer.state.values():
        for t in tensors:
            add("optimizer", t)
    return out


def zeropp_runs(rank: int, world: int, runs: dict[str, dict], steps: int = 10) -> dict[str, dict]:
    """Train each run (ZeRO++ flags on top of a stage, micro batch, accumulation, clipping) ``steps`` steps from the
    same weights and data; the first run is the exact reference. Per run return the losses, the bytes of the last
    step (``comm.stats()`` reset before its first forward, read after its ``step()``), the units' layout and, for the
    others, the distance of the final parameters (exact fp32 master shards, gathered exactly) to the reference's."""
    out: dict[str, dict] = {}
    init = {n: p.detach().clone() for n, p in GPT(MODEL, seed=0).named_parameters()}
    reference: dict[str, torch.Tensor] | None = None
    for name, run in runs.items():
        micro, accum = run.get("micro", 2), run.get("accum", 1)
        zero = {"stage": run.get("stage", 3), **run.get("zero", {})}
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                  "gradient_clipping": run.get("clip", 0.0), "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}}
        model = GPT(MODEL, seed=0)
        topology = None
        if run.get("interleaved"):  # nodes {0, 2} and {1, 3}: not node-contiguous, made-up host names
            topology = zeropp.comm.Topology(host=f"host{rank % 2}")
            assert not topology.is_node_contiguous
        engine, _, _, _ = zeropp.initialize(model=model, config=config, topology=topology)
        hpz = engine.comm.hpz
        losses, traffic, secondaries = [], {}, []
        for step, (inputs, targets) in enumerate(text_batches(steps, micro * accum * world)):
            last = step == steps - 1
            if last:
                zeropp.comm.reset_stats()
            step_loss = 0.0
            for k in range(accum):
                lo = (k * world + rank) * micro
                _, loss = engine(inputs[lo : lo + micro], targets[lo : lo + micro])
                if hpz > 1:  # the forward left a secondary shard of 1/hpz of the unit on every unit
                    secondaries.append(all(u.secondary is not None and u.secondary.numel() * hpz == u.full.numel()
                                           for u in engine.units))
                engine.backward(loss)
                engine.step()
                step_loss += loss.item() / accum
            if hpz > 1:  # dropped by the optimizer step
                assert all(u.secondary is None for u in engine.units)
            if last:
                traffic = zeropp.comm.stats()
            mean = torch.tensor([step_loss])
            engine.comm.all_reduce_sum(mean)
            losses.append(mean.item() / world)
        assert not secondaries or all(secondaries)
        # the exact fp32 values the optimizer holds (the compute weights are their dequantized copy under qwZ)
        masters, buffers = gather_masters(engine)
        for unit, full in zip(engine.units, buffers):
            if unit.align > 1:  # padding stays zero in every buffer
                keep = torch.zeros_like(full, dtype=torch.bool)
                for off, shape in zip(unit.offsets, unit.shapes):
                    keep[off : off + shape.numel()] = True
                assert torch.all(full[~keep] == 0), (name, unit.name)
        result = {
            "losses": losses,
            "traffic": traffic,
            "units": [{"name": u.name, "numel": u.numel, "shard": u.shard_numel, "align": u.align,
                       "offsets": list(u.offsets), "sizes": [s.numel() for s in u.shapes]} for u in engine.units],
            "hpz": hpz,
            "rotation": engine.comm.gradient_rotation,
            "ef_keys": [u.error_feedback.key for u in engine.units if u.error_feedback is not None],
            "memory": state_bytes(engine),
        }
        if reference is None:
            reference = masters
        else:
            got, want, start = (torch.cat([d[n].reshape(-1) for n in sorted(d)]) for d in (masters, reference, init))
            # distance to the exact run, against how far the exact run moved the parameters
            result["rel_to_update"] = ((got - want).norm() / (want - start).norm()).item()
            result["rel_to_params"] = ((got - want).norm() / want.norm()).item()
        out[name] = result
    return out
