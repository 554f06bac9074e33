"""Workers for tests/deepspeed: DeepSpeed's ZeRO-3 engine on its CPU accelerator over gloo, with and without
``zeropp.deepspeed.install()``, training the GPT of ``zeropp.models.gpt`` on real text (``zeropp.data``).

``run`` is the one launch the tests share (each launch costs ~10 s of imports per rank: torch._dynamo through
DeepSpeed's optimizer check): it runs a list of jobs (``compare``, ``checkpoint``, ``qgz_mean``, ``hpz_groups``)
and returns each job's record by name.

The model: 2 layers, ``n_embd`` 63 with 3 heads (head size 21, MLP 252, QKV 189), context 61, a vocabulary of
251 or 50257: no parameter's size is a multiple of 8. Text: the Python stdlib sources as bytes (``stdlib_corpus``);
UTF-8 never holds the bytes 0xF8..0xFF, so every token is below 251.
"""

from __future__ import annotations

import math
import os
from typing import Any

from wire import WireCounter

INTERLEAVED_NODES = 0
"""0: nodes are runs of ``$LOCAL_SIZE`` consecutive global ranks; ``k``: rank ``g`` is on node ``g % k`` (set by
``hpz_groups`` while it emulates such hosts)."""


def node_of(global_rank: int) -> int:
    """The emulated node holding ``global_rank`` (see ``INTERLEAVED_NODES``)."""
    if INTERLEAVED_NODES:
        return global_rank % INTERLEAVED_NODES
    return global_rank // int(os.environ["LOCAL_SIZE"])


WIRE = WireCounter(node_of)
"""What every rank hands torch.distributed (DeepSpeed's collectives and zeropp's), installed by ``run``."""

CONFIGS: dict[str, dict[str, Any]] = {
    "exact": {},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": "rpn", "zero_quantized_gradients": True},
    "stored": {"zero_quantized_nontrainable_weights": True},
    "stored_zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": "rpn",
                      "zero_quantized_gradients": True, "zero_quantized_nontrainable_weights": True},
}
BLOCK = 128  # zeropp.quant.DEFAULT_BLOCK_SIZE, the block both collectives use
N_EMBD, N_HEAD, CONTEXT, SEQ, MICRO = 63, 3, 61, 32, 2


def _model(vocab: int, seed: int = 0) -> Any:
    from zeropp.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig.preset("tiny", vocab_size=vocab, n_embd=N_EMBD, n_head=N_HEAD, block_size=CONTEXT), seed=seed)


def _engine(name: str, vocab: int, dtype: str, ranks_per_node: int, seed: int = 0,
            freeze: tuple[str, ...] = ()) -> Any:
    import deepspeed
    import torch

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every parameter partitioned and gathered
    zero.update({k: ranks_per_node if v == "rpn" else v for k, v in CONFIGS[name].items()})
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero, "steps_per_print": 10**9,
              "bf16": {"enabled": dtype == "bf16"}}
    model = _model(vocab, seed)
    for pname, p in model.named_parameters():
        p.requires_grad_(not pname.startswith(freeze))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
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


def _stored_bound(full: Any, parts: int, world: int, bf16: bool) -> Any:
    """Per element of ``full``, the largest error of a weight DeepSpeed stores quantized (``ds_format``): its shard
    of ``parts`` (DeepSpeed pads ``numel`` to a multiple of ``world``, then cuts ``parts`` shards) split into the
    stand-in's groups, step ``m / 128`` (``m`` the group's absmax): half a step, a whole one for the values that
    clamp (``x > 127.5 m / 128``); plus the rounding to the weight's dtype."""
    import torch

    from zeropp.deepspeed.quantizer import CUDAQuantizer, group_count

    flat = full.detach().float().reshape(-1)
    n = flat.numel()
    shard = math.ceil(n / world) * world // parts
    per_group = shard // group_count(shard, CUDAQuantizer.target_group_size)
    padded = torch.zeros(shard * parts)
    padded[:n] = flat
    m = padded.view(-1, per_group).abs().amax(dim=1, keepdim=True).expand(-1, per_group).reshape(-1)[:n]
    step = m / 128 * (1 + 2**-20)
    bound = torch.where(flat > m * (127.5 / 128) * (1 - 2**-20), step, step / 2)
    return (bound + (flat.abs() + bound) * (2**-8 if bf16 else 2**-23)).view_as(full)


def _batches(rank: int, world: int, steps: int) -> list[Any]:
    from zeropp.data import TextBatches, stdlib_corpus

    data = TextBatches(stdlib_corpus(1 << 16), seq_len=SEQ, global_batch=MICRO * world, seed=0)
    return [data.micro_batch(s, rank=rank, world_size=world) for s in range(steps)]


def _use(name: str) -> None:
    import zeropp.deepspeed

    if name == "exact":
        zeropp.deepspeed.uninstall()
    else:
        zeropp.deepspeed.install()
        zeropp.deepspeed.install()  # a second call is a no-op


def _train(engine: Any, batches: list[Any]) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for x, y in batches:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def compare(rank: int, world: int, *, configs: dict[str, int], vocab: int, dtype: str,
            ranks_per_node: int, freeze: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train each config (a key of ``CONFIGS``; ``exact`` runs DeepSpeed alone) its number of steps from the same
    model on the same text, the parameters whose names start with ``freeze`` frozen. Per config: the losses, the
    global gradient norms (after the reduce-scatter, before clipping), zeropp's byte counters over the steps, and
    how the weights forward used at step 0 compare with the model's (the worst error / qwZ-bound ratio, how many
    elements differ, how many parameters are equal); with ``freeze``, the frozen weights forward used at the first
    and the last step against the bound of weights stored quantized (``stored_ratio``, the worst over both), and
    after the steps as ``zero.GatheredParameters`` gathers them (``gathered_ratio``)."""
    import deepspeed
    import torch

    from zeropp import comm

    freeze = tuple(freeze)
    reference = _model(vocab)
    initial = {n: p.detach().to(torch.bfloat16 if dtype == "bf16" else torch.float32)
               for n, p in reference.named_parameters(remove_duplicate=False)}
    shard_sizes = [math.ceil(p.numel() / world) for p in reference.parameters()]  # the tied weight once
    batches = _batches(rank, world, max(configs.values()))
    out: dict[str, Any] = {}
    for name, steps in configs.items():
        _use(name)
        engine = _engine(name, vocab, dtype, ranks_per_node, freeze=freeze)
        seen: dict[str, Any] = {}
        last: dict[str, Any] = {}
        names = {m: n for n, m in engine.module.named_modules()}

        def capture(into: dict[str, Any]) -> Any:
            def hook(module: Any, _inputs: Any) -> None:
                for pname, p in module.named_parameters(recurse=False):
                    full = f"{names[module]}.{pname}" if names[module] else pname
                    into.setdefault(full, p.data.detach().clone())
            return hook

        hooks = [m.register_forward_pre_hook(capture(seen)) for m in engine.module.modules()]
        comm.reset_stats()
        WIRE.reset()
        losses, norms = _train(engine, batches[:1])
        for h in hooks:
            h.remove()
        more_losses, more_norms = _train(engine, batches[1:steps - 1] if freeze else batches[1:steps])
        if freeze and steps > 1:
            hooks = [m.register_forward_pre_hook(capture(last)) for m in engine.module.modules()]
            end_losses, end_norms = _train(engine, batches[steps - 1:steps])
            for h in hooks:
                h.remove()
            more_losses, more_norms = more_losses + end_losses, more_norms + end_norms
        record: dict[str, Any] = {"losses": losses + more_losses, "norms": norms + more_norms,
                                  "stats": comm.stats(), "wire": WIRE.snapshot()}
        if freeze:
            parts = ranks_per_node if CONFIGS[name].get("zero_hpz_partition_size") else world
            stored = [(pname, used) for captured in (seen, last) for pname, used in captured.items()
                      if pname.startswith(freeze)]
            record["stored_ratio"] = max(
                float(((used.float() - initial[pname].float()).abs()
                       / _stored_bound(initial[pname], parts, world, dtype == "bf16").clamp_min(1e-30)).max())
                for pname, used in stored)
            record["stored_seen"] = len(stored)
            record["stored_dtypes"] = sorted({str(used.dtype) for _, used in stored})
            # DeepSpeed's synchronous gather (zero.GatheredParameters: its _allgather_params* on the primary shards)
            frozen = [(pname, p) for pname, p in engine.module.named_parameters() if pname.startswith(freeze)]
            with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
                record["gathered_ratio"] = max(
                    float(((p.data.float() - initial[pname].float()).abs()
                           / _stored_bound(initial[pname], world, world, dtype == "bf16").clamp_min(1e-30)).max())
                    for pname, p in frozen)
        ratios, differ, equal = [], 0, 0
        for pname, used in seen.items():
            ref = initial[pname]
            err = (used.float() - ref.float()).abs()
            ratios.append(float((err / _shard_bound(ref, world, dtype == "bf16").clamp_min(1e-30)).max()))
            differ += int((err > 0).sum())
            equal += int(torch.equal(used, ref))
        record.update(worst_ratio=max(ratios), differ=differ, params_equal=equal, params_seen=len(seen),
                      dtypes=sorted({str(t.dtype) for t in seen.values()}),
                      shard_elems=sum(shard_sizes),
                      padded_shard_elems=sum(math.ceil(s / BLOCK) * BLOCK for s in shard_sizes))
        out[name] = record
        engine.destroy()
    return out


def _masters(engine: Any, rank: int) -> list[Any]:
    """This rank's fp32 master values of each parameter (its part of ``fp32_partitioned_groups_flat``), without
    the padding that ends the last ranks' partitions (no parameter's value: one run's 0 may be another's garbage)."""
    out = []
    for flat, params in zip(engine.optimizer.fp32_partitioned_groups_flat, engine.optimizer.fp16_groups):
        offset = 0
        for p in params:
            size = p.ds_tensor.ds_numel
            out.append(flat.narrow(0, offset, max(0, min(size, p.ds_numel - rank * size))).detach().clone())
            offset += size
        assert offset == flat.numel(), (offset, flat.numel())
    return out


def checkpoint(rank: int, world: int, *, save_dir: str, steps: int, save_at: int, vocab: int, dtype: str,
               ranks_per_node: int) -> dict[str, Any]:
    """qwZ + hpZ + qgZ through DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint``: one engine trains
    ``steps`` steps, saving after ``save_at``; a fresh engine (same config, the model re-initialised with another
    seed so nothing is inherited) loads that checkpoint and trains the remaining steps. Returns both runs' losses
    after the save and whether every rank's fp32 master partitions end equal."""
    import torch

    _use("zeropp")
    batches = _batches(rank, world, steps)
    engine = _engine("zeropp", vocab, dtype, ranks_per_node)
    _train(engine, batches[:save_at])
    engine.save_checkpoint(save_dir, tag="mid")
    straight, _ = _train(engine, batches[save_at:])
    final = _masters(engine, rank)
    engine.destroy()

    resumed_engine = _engine("zeropp", vocab, dtype, ranks_per_node, seed=7)
    path, _ = resumed_engine.load_checkpoint(save_dir, tag="mid")
    resumed, _ = _train(resumed_engine, batches[save_at:])
    resumed_final = _masters(resumed_engine, rank)
    record = {"straight": straight, "resumed": resumed, "loaded": path is not None,
              "hpz": resumed_engine.zero_hpz_partition_size(),
              "master_equal": len(final) == len(resumed_final) and all(
                  torch.equal(a, b) for a, b in zip(final, resumed_final))}
    resumed_engine.destroy()
    return record


def qgz_mean(rank: int, world: int, *, sizes: list[int]) -> dict[str, Any]:
    """zeropp's ``all_to_all_quant_reduce`` (the qgZ entry DeepSpeed's stage 3 calls) on gradients of ``sizes``
    elements, fp32 and bf16, each rank's a shared component plus its own noise; against the exact mean
    (``all_reduce(SUM) / world``, float64). Per dtype: the worst error over its int4 bound, and the least-squares
    slope of the result on the exact mean (1 for a mean, ``ranks per node`` for DeepSpeed's sum / nodes)."""
    import torch
    import torch.distributed as dist

    from zeropp.deepspeed.reduce_scatter import all_to_all_quant_reduce

    _use("zeropp")
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        shared = torch.Generator().manual_seed(99)
        own = torch.Generator().manual_seed(100 + rank)
        grads = [(torch.randn(n, generator=shared) + 0.5 * torch.randn(n, generator=own)).to(dtype) for n in sizes]
        got = all_to_all_quant_reduce(grads, None)
        worst, num, den = 0.0, 0.0, 0.0
        for g, mine in zip(grads, got):
            every = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(every, g)
            stacked = torch.stack(every).double()
            s = math.ceil(g.numel() / world)
            lo, hi = min(rank * s, g.numel()), min((rank + 1) * s, g.numel())
            mean = stacked.sum(0)[lo:hi] / world
            # int4 bound, per element: each rank's hop-1 error (half its block's scale: absmax / 14), and the
            # requantized node partial sums' (each at most the sum of its ranks' absmaxes, plus their hop-1 errors,
            # over 14): sum_r absmax_r / 14 * (1 + 15 / 14), over the world; then bf16's output rounding. Every
            # block lies in this rank's slice of one tensor, so the slice's absmax bounds its blocks'.
            absmax = stacked[:, lo:hi].abs().amax(dim=1) if hi > lo else torch.zeros(world, dtype=torch.float64)
            bound = absmax.sum() / 14 * (29 / 14) / world * (1 + 1e-6)
            if dtype == torch.bfloat16:
                bound = bound + (mean.abs() + bound) * 2**-8
            err = (mine.double() - mean).abs()
            if hi > lo:
                worst = max(worst, float((err / bound).max()))
            num += float((mine.double() * mean).sum())
            den += float((mean * mean).sum())
        out[str(dtype)] = {"worst_ratio": worst, "slope": num / den,
                           "shapes_ok": [m.numel() for m in got] == [
                               max(0, min(math.ceil(n / world) * (rank + 1), n) - min(math.ceil(n / world) * rank, n))
                               for n in sizes]}
    return out


def _hpz_ranks(engine: Any) -> list[list[int]]:
    """The distinct hpZ groups (global ranks) of ``engine``'s parameters; ``[[]]`` when none has one."""
    import torch.distributed as dist

    groups = {tuple(dist.get_process_group_ranks(p.ds_zero_param_process_group))
              if p.ds_zero_param_process_group is not None else () for p in engine.module.parameters()}
    return sorted(map(list, groups))


def hpz_groups(rank: int, world: int, *, steps: int, vocab: int, dtype: str, ranks_per_node: int) -> dict[str, Any]:
    """hpZ's groups with ``install()``: which ranks DeepSpeed's engines get, and what they do.

    * Leak: an engine with hpZ, destroyed (``engine.destroy()`` only), then one without hpZ in its config: the
      second's parameters must have no hpZ group, and the global must be clear after the destroy.
    * Layout: nodes that do not hold consecutive ranks (hosts ``host{rank % nodes}`` on every rank, as a launcher
      that deals ranks round-robin over machines makes them): the hpZ partition is this rank's node, and ``steps``
      qwZ + hpZ + qgZ steps (losses, zeropp's counters and the bytes on the wire with those nodes).
    * Refused: a partition size that does not divide the ranks per node (its error message).
    """
    import socket

    from deepspeed.utils import groups

    import zeropp.deepspeed
    from zeropp import comm

    global INTERLEAVED_NODES
    out: dict[str, Any] = {}
    _use("zeropp")
    first = _engine("zeropp", vocab, dtype, ranks_per_node)
    out["first"] = _hpz_ranks(first)
    first.destroy()
    out["cleared"] = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is None
    second = _engine("qwz", vocab, dtype, ranks_per_node)
    out["second"] = _hpz_ranks(second)
    second.destroy()

    nodes = world // ranks_per_node
    hostname = socket.gethostname
    socket.gethostname = lambda: f"host{rank % nodes}"
    INTERLEAVED_NODES = nodes
    zeropp.deepspeed.uninstall()  # forget the topology of the consecutive layout
    try:
        _use("zeropp")
        engine = _engine("zeropp", vocab, dtype, ranks_per_node)
        out["interleaved"] = _hpz_ranks(engine)
        comm.reset_stats()
        WIRE.reset()
        out["losses"], _ = _train(engine, _batches(rank, world, steps))
        out["stats"], out["wire"] = comm.stats(), WIRE.snapshot()
        engine.destroy()
        try:
            groups._create_zero_param_parallel_group(world)
            out["refused"] = "no error"
        except Exception as e:  # noqa: BLE001 - what it raises is the record (DeepSpeed alone: an assertion)
            out["refused"] = f"{type(e).__name__}: {e}"
    finally:
        socket.gethostname = hostname
        INTERLEAVED_NODES = 0
    return out


def run(rank: int, world: int, *, jobs: list[tuple[str, str, dict[str, Any]]], ranks_per_node: int) -> dict[str, Any]:
    """Run each ``(label, function, kwargs)`` job of this module in order on one gloo world, with
    ``ranks_per_node`` ranks per emulated node unless the job's kwargs name its own (DeepSpeed reads
    ``LOCAL_SIZE``, zeropp ``ZEROPP_RANKS_PER_NODE``, both at each engine's creation). Returns each job's record
    by label, and whether ``uninstall()`` restored DeepSpeed's attributes at the end. ``WIRE`` counts every
    collective's bytes from the start."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    WIRE.install()  # before DeepSpeed's communication backend binds torch.distributed's functions
    import deepspeed.ops
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partition_parameters, stage3
    from deepspeed.utils import groups

    import zeropp.deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    mangled = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"

    def attributes() -> tuple[Any, ...]:
        init = partition_parameters.Init
        return (partition_parameters.CUDAQuantizer, stage3.CUDAQuantizer, init._convert_to_deepspeed_param,
                init._partition_param, init._partition_param_sec, "quantizer_module" in init.__dict__,
                coalesced_collectives.quantizer_module, stage3.all_to_all_quant_reduce,
                stage3.DeepSpeedZeroOptimizer_Stage3.__dict__[mangled], groups._create_zero_param_parallel_group,
                DeepSpeedEngine.__dict__["destroy"])

    originals = attributes()
    out: dict[str, Any] = {}
    for label, function, kwargs in jobs:
        rpn = kwargs.get("ranks_per_node", ranks_per_node)
        os.environ.update(LOCAL_SIZE=str(rpn), ZEROPP_RANKS_PER_NODE=str(rpn))
        zeropp.deepspeed.uninstall()  # forget the topologies: a job may change the node layout
        out[label] = globals()[function](rank, world, **kwargs)
    zeropp.deepspeed.uninstall()
    out["restored"] = originals == attributes()
    return out
