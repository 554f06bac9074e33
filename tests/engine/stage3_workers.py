"""Workers for test_stage3.py (issue 11, part 2): stage 3 for models that do not fit one rank and for fine-tuning,
run on every rank by ``engine_launch.launch``.

References are independent of the engine's sharding: the same model built eagerly on one process
(``reset_parameters_by_unit`` gives meta-built models' weights), trained with ``torch.optim.AdamW(fused=True)`` on
the whole global batch — or, with BatchNorm, on each rank's micro-batch in turn with that rank's own running
statistics, gradients averaged (what data parallelism computes: buffers are rank-local, as in DeepSpeed and DDP
without SyncBatchNorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_workers import MODEL, batches, expect_error
from torch import nn

import zeropp
from zeropp.engine import reset_parameters_by_unit
from zeropp.models import GPT
from zeropp.quant import dequantize, quantize

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}


# Every unit sharded and freed after use (no persistent or reuse-kept units, zeropp.engine.reuse): what most of these
# tests look at. ``lora_kept`` runs with DeepSpeed's defaults, where the tiny models' units all stay whole.
FREE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def config(zero: dict | None = None, micro: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "optimizer": ADAMW,
            "zero_optimization": {"stage": 3, **FREE_ALL, **(zero or {})}}


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest ||got - want|| / ||want|| over the entries of ``want``."""
    assert set(got) >= set(want), sorted(set(want) - set(got))
    return max(((got[k].double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
               for k, w in want.items())


def train_reference(model: nn.Module, data: list, steps: int) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True, **ADAMW["params"])
    for inputs, targets in data[:steps]:
        _, loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()


def train_engine(engine, rank: int, world: int, data: list, steps: int, micro: int = 2) -> None:
    for inputs, targets in data[:steps]:
        lo = rank * micro
        _, loss = engine(inputs[lo : lo + micro], targets[lo : lo + micro])
        engine.backward(loss)
        engine.step()


# ---- 1. meta construction ------------------------------------------------------------------------------------


class NoReset(nn.Module):
    """A module with a parameter of its own and no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def meta_init(rank: int, world: int, seed: int, steps: int) -> dict:
    """Build the tiny GPT on the meta device, materialise it at stage 3, return its whole weights (after
    ``initialize`` and after ``steps`` steps), the most parameter elements that had storage at once during
    materialisation, the largest unit's parameter count, and the error of training against the reference."""
    with zeropp.Init():
        model = GPT(MODEL)
    assert all(p.is_meta for p in model.parameters())
    params_before = list(model.parameters())
    engine, _, _, _ = zeropp.initialize(model=model, config=config(), init_seed=seed)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]  # the same Parameter objects
    assert not any(p.is_meta for p in model.parameters())
    initial = engine.full_parameters()
    largest_unit = max(sum(s.numel() for s in u.shapes) for u in engine.units)  # (the parameters are freed)
    live = engine.materializer.largest_live_numel

    ref = reset_parameters_by_unit(GPT(MODEL), seed)
    for n, p in ref.named_parameters():  # the eager model re-initialised unit by unit: bit for bit
        assert torch.equal(initial[n], p.detach()), n
    data = batches(steps, 2 * world)
    train_engine(engine, rank, world, data, steps)
    train_reference(ref, data, steps)
    got = engine.consolidated_state_dict()
    error = max_rel(got, {n: p.detach() for n, p in ref.named_parameters()})

    messages: dict[str, str] = {}
    if world == 2:  # construction errors: a module without reset_parameters, a model partly on meta
        with zeropp.Init():
            bad = nn.Sequential(nn.Linear(4, 4), NoReset())
        expect_error(messages, ValueError, "no_reset", lambda: zeropp.initialize(model=bad, config=config()))
        mixed = nn.Sequential(nn.Linear(4, 4))
        with torch.device("meta"):
            mixed.append(nn.Linear(4, 4))
        expect_error(messages, ValueError, "mixed", lambda: zeropp.initialize(model=mixed, config=config()))
        expect_error(messages, Exception, "eager_init_fn", lambda: zeropp.initialize(
            model=nn.Linear(2, 2), config=config(), param_init_fn=lambda m: None))
        # a param_init_fn replaces reset_parameters; a BatchNorm's meta buffers are materialised too
        with zeropp.Init():
            bn = BNNet()
        engine_bn, _, _, _ = zeropp.initialize(model=bn, config=config(),
                                               param_init_fn=lambda m: nn.init.constant_(m.weight, 0.5)
                                               if isinstance(m, nn.Linear) else m.reset_parameters())
        weights = engine_bn.full_parameters()
        assert all(bool((weights[n] == 0.5).all()) for n in ("blocks.0.fc.weight", "head.weight"))
        bn0 = bn.blocks[0].bn
        assert not bn0.running_mean.is_meta and torch.equal(bn0.running_mean, torch.zeros(8))
        assert torch.equal(bn0.running_var, torch.ones(8)) and int(bn0.num_batches_tracked) == 0
    return {"initial": initial, "trained": got, "error": error, "live": live, "largest_unit": largest_unit,
            "total": sum(p.numel() for p in ref.parameters()), "messages": messages}


# ---- 2-4. frozen parameters (LoRA), gathered_parameters, state_dict --------------------------------------------


class LoRALinear(nn.Module):
    """A frozen base ``Linear`` plus a trainable low-rank update ``B A``."""

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRABlock(nn.Module):
    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d).requires_grad_(False)
        self.fc1 = LoRALinear(d, 4 * d, rank)
        self.fc2 = LoRALinear(4 * d, d, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TokenNet(nn.Module):
    """``emb``, then ``blocks`` in turn, then ``head``: logits and (with targets) the cross-entropy; subclasses build
    the three."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class LoRANet(TokenNet):
    """A frozen embedding, head and two blocks whose Linear layers carry LoRA adapters."""

    def __init__(self, vocab: int = 64, d: int = 32, rank: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d).requires_grad_(False)
        self.blocks = nn.ModuleList(LoRABlock(d, rank) for _ in range(2))
        self.head = nn.Linear(d, vocab).requires_grad_(False)


def lora_batches(steps: int, batch: int, vocab: int = 64, seq: int = 8) -> list:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def lora(rank: int, world: int, steps: int, hpz: int, save_dir: str | None, load_dir: str | None) -> dict:
    """LoRA at stage 3: training against the reference, frozen-parameter memory, qwZ's dequantized frozen weights,
    ``gathered_parameters`` (read and modify), ``model.state_dict()``, checkpoints with frozen parameters."""
    out: dict = {}
    data = lora_batches(steps, 2 * world)
    model, ref = LoRANet(), LoRANet()
    zero = {"zero_hpz_partition_size": hpz} if hpz > 1 else {}
    engine, _, _, _ = zeropp.initialize(model=model, config=config(zero))
    frozen_numel = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
    trainable_numel = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    # memory: frozen parameters are 1/P per rank (plus < P elements of padding per unit), no master/gradient/state
    frozen_bytes = sum(u.frozen.shard.untyped_storage().nbytes() for u in engine.units if u.frozen is not None)
    units_with_frozen = sum(u.frozen is not None for u in engine.units)
    assert frozen_numel / world * 4 <= frozen_bytes <= (frozen_numel / world + units_with_frozen) * 4, frozen_bytes
    master_numel = sum(u.master.numel() for u in engine.units)
    assert master_numel <= trainable_numel / world + len(engine.units), (master_numel, trainable_numel)
    assert all(u.grad_shard.numel() == u.master.numel() for u in engine.units)
    for kind in engine.optimizer.state.values():
        assert sum(t.numel() for t in kind) == master_numel
    out["frozen_fraction"] = frozen_bytes / (4 * frozen_numel)

    train_engine(engine, rank, world, data, steps)
    train_reference(ref, data, steps)
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    assert all(p.numel() == 0 for p in model.parameters())  # frozen ones too: sharded, freed
    if hpz > 1:  # the frozen hpZ secondary is kept across steps (values never change)
        assert all(u.frozen.secondary is not None for u in engine.units if u.frozen is not None)
    consolidated = engine.consolidated_state_dict()
    out["train_error"] = max_rel(consolidated, want)

    # 4. model.state_dict() on the wrapped module: whole weights, gathered on demand (a collective)
    sd = model.state_dict()
    assert all(v.numel() > 0 for v in sd.values()), [k for k, v in sd.items() if v.numel() == 0]
    assert sd.keys() == consolidated.keys()
    out["state_dict_equal"] = all(torch.equal(sd[k], consolidated[k]) for k in sd)
    adapters = {k: v for k, v in sd.items() if "lora_" in k}  # what PEFT's get_peft_model_state_dict keeps
    assert len(adapters) == 8 and all(v.numel() > 0 for v in adapters.values())
    sub = model.blocks[1].fc2.state_dict()  # a submodule of a unit: its own keys, whole
    assert all(torch.equal(sub[k], consolidated[f"blocks.1.fc2.{k}"]) for k in sub) and len(sub) == 4
    assert all(p.numel() == 0 for p in model.parameters())  # freed again

    # 3. gathered_parameters: read-only, then modified by one rank
    with engine.gathered_parameters():
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(p.numel() > 0 for p in model.parameters())
    out["gathered_equal"] = all(torch.equal(inside[n], consolidated[n]) for n in inside)
    assert all(p.numel() == 0 for p in model.parameters())
    modifier = engine.topology.ranks[-1]
    block = model.blocks[0]
    with engine.gathered_parameters(block.fc1, modifier_rank=modifier):
        assert model.blocks[1].fc1.lora_a.weight.numel() == 0  # another unit: not gathered
        with torch.no_grad():
            if engine.topology.global_rank == modifier:
                block.fc1.lora_a.weight.add_(1.0)  # trainable
                block.fc1.base.weight.mul_(2.0)  # frozen
            else:
                block.fc1.lora_a.weight.fill_(123.0)  # overwritten by the modifier's values on exit
    after = engine.consolidated_state_dict()  # masters (trainable) and frozen shards
    expected = dict(consolidated)
    expected["blocks.0.fc1.lora_a.weight"] = consolidated["blocks.0.fc1.lora_a.weight"] + 1.0
    expected["blocks.0.fc1.base.weight"] = consolidated["blocks.0.fc1.base.weight"] * 2.0
    out["modified_equal"] = all(torch.equal(after[k], expected[k]) for k in expected)
    compute = engine.full_parameters()  # the compute shards took the new values too
    out["modified_compute_equal"] = all(torch.equal(compute[n], expected[n]) for n in compute)

    # engine.load_state_dict: a whole state dict (fresh random values) lands in the masters and the frozen shards
    gen = torch.Generator().manual_seed(7)
    fresh = {k: torch.randn(v.shape, generator=gen) for k, v in expected.items()}
    engine.load_state_dict(fresh)
    reloaded = engine.consolidated_state_dict()
    out["load_state_dict_equal"] = all(torch.equal(reloaded[k], fresh[k]) for k in fresh)
    engine.load_state_dict(after)
    assert all(torch.equal(engine.consolidated_state_dict()[k], after[k]) for k in after)

    # checkpoints with frozen parameters: save here, load at another world size (the test runs both)
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="lora")
        out["saved"] = after
    if load_dir is not None:
        engine.load_checkpoint(load_dir, tag="lora")
        out["loaded"] = engine.consolidated_state_dict()
        assert all(p.numel() == 0 for p in model.parameters())
        out["offline"] = zeropp.engine.consolidate(load_dir, tag="lora")
    return out


def lora_qwz(rank: int, world: int) -> dict:
    """qwZ: the frozen weights a forward computes with are the dequantized shards (reference quantize/dequantize of
    zeropp.quant applied to each rank's shard of the frozen flat buffer), and the frozen shards stay exact."""
    model = LoRANet()
    exact = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, _, _, _ = zeropp.initialize(model=model, config=config({"zero_quantized_weights": True}))
    seen = {}
    base = model.blocks[1].fc2.base

    def record(module: nn.Module, _args: tuple) -> None:
        seen.setdefault("w", module.weight.detach().clone())

    handle = base.register_forward_pre_hook(record)
    inputs, targets = lora_batches(1, 2 * world)[0]
    _, loss = engine(inputs[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
    engine.backward(loss)
    engine.step()
    handle.remove()
    unit = next(u for u in engine.units if u.name == "blocks.1")
    flat = unit.frozen
    whole = torch.zeros(world * flat.shard_numel)  # the exact frozen flat buffer, built from the model's values
    for name, off in zip(flat.param_names, flat.offsets):
        whole[off : off + exact[name].numel()] = exact[name].reshape(-1)
    block = engine.comm.block_size
    deq = torch.cat([dequantize(quantize(s, 8, block)) for s in whole.split(flat.shard_numel)])
    i = flat.param_names.index("blocks.1.fc2.base.weight")
    off, shape = flat.offsets[i], flat.shapes[i]
    want = deq[off : off + shape.numel()].view(shape)
    error = (seen["w"] - exact["blocks.1.fc2.base.weight"]).abs().max().item()
    return {"dequantized_equal": torch.equal(seen["w"], want), "quantization_error": error,
            "shard_exact": torch.equal(flat.shard, whole.split(flat.shard_numel)[rank])}


# ---- 5. buffers (BatchNorm) and another entry point (generate) ---------------------------------------------------


class BNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2))


class BNNet(TokenNet):
    """Embedding, two blocks with BatchNorm, head; ``generate`` calls the submodules directly."""

    def __init__(self, vocab: int = 32, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(BNBlock(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding without going through ``forward``; returns the tokens and the last logits."""
        for _ in range(steps):
            x = self.emb(idx)
            for i in range(len(self.blocks)):
                x = self.blocks[i](x)
            logits = self.head(x)[:, -1]
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
        return idx, logits


def buffers_and_generate(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(5)
    model = BNNet()
    ref = BNNet()
    ref.load_state_dict(model.state_dict())
    engine, _, _, _ = zeropp.initialize(model=model, config=config({"stage3_prefetch_bucket_size": 10**6}))
    data = lora_batches(steps, 2 * world, vocab=32)
    train_engine(engine, rank, world, data, steps)
    # the reference: data parallelism on one process, rank r's running statistics its own
    opt = torch.optim.AdamW(ref.parameters(), fused=True, **ADAMW["params"])
    names = [n for n, _ in ref.named_buffers()]
    local = [{n: b.clone() for n, b in ref.named_buffers()} for _ in range(world)]
    for inputs, targets in data:
        for r in range(world):
            for n, b in ref.named_buffers():
                b.copy_(local[r][n])
            _, loss = ref(inputs[2 * r : 2 * r + 2], targets[2 * r : 2 * r + 2])
            (loss / world).backward()
            local[r] = {n: b.clone() for n, b in ref.named_buffers()}
        opt.step()
        opt.zero_grad()
    for n, b in ref.named_buffers():
        b.copy_(local[rank][n])
    mine = dict(model.named_buffers())
    buffer_error = max_rel({n: mine[n].float() for n in names}, {n: local[rank][n].float() for n in names})
    weights = engine.consolidated_state_dict()
    weight_error = max_rel(weights, {n: p.detach() for n, p in ref.named_parameters()})
    other_ranks_differ = any(not torch.equal(mine[n], local[(rank + 1) % world][n]) for n in names) if world > 1 \
        else True

    # generate(): not through forward, under no_grad, in eval mode (this rank's running statistics)
    engine.eval()
    ref.eval()
    prompt = data[0][0][:2, :3]
    tokens, logits = model.generate(prompt, 4)
    assert all(p.numel() == 0 for p in model.parameters()) or world == 1  # freed again
    plain = BNNet()
    plain.load_state_dict(weights)  # this rank's consolidated weights and buffers
    plain.eval()
    plain_tokens, plain_logits = plain.generate(prompt, 4)
    ref_tokens, ref_logits = ref.generate(prompt, 4)
    return {"buffer_error": buffer_error, "weight_error": weight_error, "other_ranks_differ": other_ranks_differ,
            "tokens_equal_plain": torch.equal(tokens, plain_tokens), "logits_equal_plain": torch.equal(logits,
                                                                                                      plain_logits),
            "tokens_equal_ref": torch.equal(tokens, ref_tokens),
            "logits_error_ref": ((logits - ref_logits).norm() / ref_logits.norm()).item()}


def lora_kept(rank: int, world: int, steps: int) -> dict:
    """LoRA with DeepSpeed's defaults (every unit persistent, with frozen parameters): training, ``state_dict`` and a
    modifying ``gathered_parameters`` as in ``lora``."""
    data = lora_batches(steps, 2 * world)
    model, ref = LoRANet(), LoRANet()
    cfg = config()
    cfg["zero_optimization"] = {"stage": 3}
    engine, _, _, _ = zeropp.initialize(model=model, config=cfg)
    persistent = all(u.persistent for u in engine.units)
    train_engine(engine, rank, world, data, steps)
    train_reference(ref, data, steps)
    consolidated = engine.consolidated_state_dict()
    sd = model.state_dict()
    modifier = engine.topology.ranks[0]
    with engine.gathered_parameters(model.blocks[0].fc1, modifier_rank=modifier):
        with torch.no_grad():
            model.blocks[0].fc1.base.weight.mul_(2.0 if engine.topology.global_rank == modifier else 0.0)
    after = engine.consolidated_state_dict()
    expected = dict(consolidated)
    expected["blocks.0.fc1.base.weight"] = consolidated["blocks.0.fc1.base.weight"] * 2.0
    compute = engine.full_parameters()
    return {"persistent": persistent, "train_error": max_rel(consolidated, {k: v.detach() for k, v in
                                                                            ref.state_dict().items()}),
            "state_dict_equal": all(torch.equal(sd[k], consolidated[k]) for k in consolidated),
            "modified_equal": all(torch.equal(after[k], expected[k]) for k in expected),
            "modified_compute_equal": all(torch.equal(compute[n], expected[n]) for n in compute)}


def suite(rank: int, world: int, save_dir: str | None, load_dir: str | None) -> dict:
    """Everything above in one process group (start-up costs seconds): meta construction, LoRA (hpZ 2 at world
    4), and at world 2 qwZ's frozen weights and BatchNorm/generate."""
    out = {"meta": meta_init(rank, world, seed=7, steps=3),
           "lora": lora(rank, world, steps=4, hpz=2 if world == 4 else 1, save_dir=save_dir, load_dir=load_dir)}
    if world == 2:
        out["qwz"] = lora_qwz(rank, world)
        out["bn"] = buffers_and_generate(rank, world, steps=4)
        out["lora_kept"] = lora_kept(rank, world, steps=3)
    return out
