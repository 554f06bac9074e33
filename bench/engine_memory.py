"""Per-rank model-state memory of the engine, measured from its tensors, against the ZeRO formulas.

    python bench/engine_memory.py --preset small --dtype bf16                      # world size 1
    torchrun --nproc-per-node 4 bench/engine_memory.py --preset small --dtype bf16 --hpz 2
    (or python -m torch.distributed.run --nproc-per-node 4 bench/engine_memory.py ...)

Builds the GPT preset under ``zeropp.initialize`` (stage 3 by default, AdamW), runs one training step on random
bytes and reports, per rank, the bytes of each buffer class summed over the units, read from the engine's own
tensors (``untyped_storage().nbytes()``):

* compute shard (``Unit.shard``), fp32 gradient shard (``grad_shard``), fp32 master (``master``), optimizer state
  (AdamW's two moments, ``PartitionedOptimizer.state``): against ``b * Psi / N``, ``4 Psi / N``, ``4 Psi / N`` and
  ``8 Psi / N`` (``Psi`` trainable parameters, ``N`` ranks, ``b`` bytes of the compute dtype);
* hpZ secondary (``Unit.secondary``, read after the backward, before the step drops it): ``b * Psi / hpz``;
* whole parameters when resident (``Unit.full`` at its gathered size): all units in stages 1/2, against
  ``b * Psi``; in stage 3 one unit at a time — reported for the largest unit, transient;
* the fp32 reduce buffer (the flat gradient ``Unit.reduce_gradients`` hands to the reduce-scatter, recorded at
  the call; on CPU kept for reuse by ``ReduceBuffers``): the largest unit's, against ``4 *`` that unit's parameter
  count (none at world size 1, where the gradients are added straight into the gradient shard).

Totals: the persistent model states against DeepSpeed's ``(2 + 2 + 12) Psi / N`` (bf16 + AdamW, bf16 gradient
partition) and this engine's documented ``(2 + 4 + 12) Psi / N`` (fp32 gradient shard). Measured and formula differ
only by layout padding (``zeropp.engine.unit``): each unit's flat buffer is ``N * S`` elements with ``S =
ceil(numel / N)`` (exact collectives) or rounded up to the quantization block with every parameter starting on the
block grid (qwZ/qgZ): the script prints the padding elements and the exact prediction ``bytes/el * sum(S)``.

Rank 0 prints the table (every rank's numbers are gathered: they differ only if the layout does); ``--json`` writes
rank 0's numbers for tests.

``--meta`` (construction without the whole model, ``zeropp.Init``): builds the model on the meta device (the preset
with ``--n-layer``/``--n-embd`` overrides) and lets ``initialize`` materialise it unit by unit, then reports, per
rank, the process's peak resident memory during ``initialize`` above its resident memory just before it (peak RSS
from ``getrusage``, current RSS from ``/proc/self/statm``) against

* the ZeRO formula for what exists after ``initialize`` at stage 3 with AdamW: ``(b + 4 + 4 + 8) * Psi / N`` (compute
  shard, fp32 gradient shard, fp32 master, two moments; allocated at ``initialize``) plus the construction transient
  of the largest unit: its parameters in fp32 (built) and its flat buffer in the compute dtype;
* the whole model in fp32 (``4 * Psi``), which the construction transient (peak minus the model-state tensors) must
  stay far below (with AdamW the sharded states alone, ``20 * Psi / N`` in fp32, exceed ``4 * Psi`` below 5 ranks);

and the most parameter elements that had storage at once during materialisation (``Materializer
.largest_live_numel``, read from the model's parameters). No training step is run in this mode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeropp  # noqa: E402
from zeropp.models import GPT, GPTConfig  # noqa: E402

MiB = float(1 << 20)
DTYPES = {"bf16": (torch.bfloat16, 2), "fp16": (torch.float16, 2), "fp32": (torch.float32, 4)}


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def init_distributed() -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:  # plain python: a process group of one
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def measure(preset: str, dtype: str, stage: int, hpz: int, quantized: bool, seq: int, micro: int) -> dict:
    """Build, step once, and return this rank's measured bytes and the formulas' (see the module docstring)."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset(preset)
    model = GPT(cfg, seed=0)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    zero: dict = {"stage": stage}
    if hpz > 1:
        zero["zero_hpz_partition_size"] = hpz
    if quantized:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    config = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine, _, _, _ = zeropp.initialize(model=model, config=config)
    n = engine.comm.world_size
    b = DTYPES[dtype][1]

    reduce_buffers: list[int] = []  # flat gradient bytes, per reduce-scatter
    original = engine.comm.reduce_scatter_grads

    def recording(full, out, *args, **kwargs):
        reduce_buffers.append(nbytes(full))
        return original(full, out, *args, **kwargs)

    engine.comm.reduce_scatter_grads = recording
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g)
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    secondary = sum(nbytes(u.secondary) for u in engine.units)  # hpZ: left by the forward, dropped by step()
    engine.step()
    engine.comm.reduce_scatter_grads = original

    units = engine.units
    shard_elems = sum(u.shard_numel for u in units)
    params_of = [sum(s.numel() for s in u.shapes) for u in units]
    largest = max(range(len(units)), key=lambda i: units[i].full.numel())
    full_resident = [u._full_nbytes for u in units]  # the gathered size of each unit's flat buffer
    opt_state = sum(nbytes(t) for ts in engine.optimizer.state.values() for t in ts)
    rows = [
        # name, measured bytes, formula bytes, exact prediction from the layout
        ("compute shard", sum(nbytes(u.shard) for u in units), b * psi / n, b * shard_elems),
        ("fp32 grad shard", sum(nbytes(u.grad_shard) for u in units), 4 * psi / n, 4 * shard_elems),
        ("fp32 master", sum(nbytes(u.master) for u in units), 4 * psi / n, 4 * shard_elems),
        ("optimizer states", opt_state, 8 * psi / n, 8 * shard_elems),
    ]
    if hpz > 1 and stage == 3:
        rows.append(("hpZ secondary", secondary, b * psi / hpz, b * n * shard_elems // hpz))
    one = n == 1  # one rank: the shard is the whole buffer (Unit.shard is a view of Unit.full, counted once) and
    # gradients are added straight into grad_shard (no flat reduce buffer)
    if stage == 3:
        rows.append(("full params (largest unit, transient)", 0 if one else full_resident[largest],
                     0 if one else b * params_of[largest], 0 if one else b * units[largest].full.numel()))
    else:
        rows.append(("full params (all units, resident)", 0 if one else sum(full_resident), 0 if one else b * psi,
                     0 if one else b * sum(u.full.numel() for u in units)))
    rows.append(("reduce buffer (largest unit, transient)", max(reduce_buffers, default=0),
                 0 if one else 4 * params_of[largest], 0 if one else 4 * units[largest].full.numel()))
    persistent = {"compute shard", "fp32 grad shard", "fp32 master", "optimizer states", "hpZ secondary"}
    measured_state = sum(m for name, m, _, _ in rows if name in persistent)
    if stage != 3 and not one:
        measured_state += sum(full_resident)
    return {
        "preset": preset, "dtype": dtype, "stage": stage, "world": n, "hpz": hpz, "quantized": quantized,
        "align": units[0].align, "psi": psi, "units": len(units), "shard_elements": shard_elems,
        "padding_elements": n * shard_elems - psi,
        "rows": [{"buffer": name, "measured": m, "formula": f, "layout": lay} for name, m, f, lay in rows],
        "measured_state": measured_state,
        "ours_formula": (b + 4 + 12) * psi / n + (b * psi / hpz if hpz > 1 and stage == 3 else 0)
        + (b * psi if stage != 3 else 0),
        # DeepSpeed stages 1/2 keep no compute shard besides the whole parameters: (2 + 12) Psi / N + 2 Psi
        "deepspeed_formula": (b + b + 12) * psi / n + (b * psi / hpz if hpz > 1 and stage == 3 else 0)
        if stage == 3 else (b + 12) * psi / n + b * psi,
        "rss_before_init_mib": rss_before / MiB,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB,
    }


def report(r: dict, all_ranks: list[dict]) -> str:
    lines = [
        f"GPT preset {r['preset']!r}: Psi = {r['psi']:,} trainable parameters, {r['units']} units; {r['dtype']}, "
        f"stage {r['stage']}, world {r['world']}, hpZ {r['hpz']}, qwZ/qgZ {'on' if r['quantized'] else 'off'} "
        f"(alignment {r['align']}); AdamW",
        f"layout: sum of shard sizes S = {r['shard_elements']:,} elements per rank, N * sum(S) - Psi = "
        f"{r['padding_elements']:,} padding elements",
        "",
        f"| {'buffer (per rank)':41s} | {'measured MiB':>12s} | {'formula MiB':>11s} | {'ratio':>7s} | "
        f"{'layout MiB':>10s} |",
        f"|{'-' * 43}|{'-' * 14}|{'-' * 13}|{'-' * 9}|{'-' * 12}|",
    ]
    for row in r["rows"]:
        ratio = row["measured"] / row["formula"] if row["formula"] else (1.0 if not row["measured"] else float("inf"))
        lines.append(f"| {row['buffer']:41s} | {row['measured'] / MiB:12.4f} | {row['formula'] / MiB:11.4f} | "
                     f"{ratio:7.4f} | {row['layout'] / MiB:10.4f} |")
    b = DTYPES[r["dtype"]][1]
    extra = f" + {b}*Psi/hpz" if r["hpz"] > 1 and r["stage"] == 3 else f" + {b}*Psi (whole)" if r["stage"] != 3 else ""
    lines += [
        "",
        f"model states per rank (persistent; stage 1/2 with the whole params): measured "
        f"{r['measured_state'] / MiB:.4f} MiB; ours ({b}+4+12)*Psi/N"
        f"{extra} = {r['ours_formula'] / MiB:.4f} MiB "
        f"(ratio {r['measured_state'] / r['ours_formula']:.4f}); DeepSpeed ({b}+{b if r['stage'] == 3 else ''}{'+' if r['stage'] == 3 else ''}12)*Psi/N"
        f"{extra} = "
        f"{r['deepspeed_formula'] / MiB:.4f} MiB (ours / DeepSpeed {r['ours_formula'] / r['deepspeed_formula']:.3f})",
        "peak RSS per rank (process, includes torch itself): "
        + ", ".join(f"rank {i}: {x['peak_rss_mib']:.0f} MiB (before initialize {x['rss_before_init_mib']:.0f})"
                    for i, x in enumerate(all_ranks)),
    ]
    if any(x["rows"] != r["rows"] for x in all_ranks):
        lines.append("note: the ranks' measured bytes differ (the last rank's shard may hold less padding)")
    return "\n".join(lines)


def current_rss() -> int:
    """This process's resident memory now, in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_meta(preset: str, dtype: str, n_layer: int | None, n_embd: int | None) -> dict:
    """Build on the meta device, initialize at stage 3 (AdamW), and return the peak memory numbers (module
    docstring, ``--meta``)."""
    overrides = {k: v for k, v in (("n_layer", n_layer), ("n_embd", n_embd)) if v is not None}
    cfg = GPTConfig.preset(preset, **overrides)
    with zeropp.Init():
        model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    rss_before = current_rss()
    engine, _, _, _ = zeropp.initialize(model=model, config=config, init_seed=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    n, b = engine.comm.world_size, DTYPES[dtype][1]
    largest = max(sum(s.numel() for s in u.shapes) for u in engine.units)
    states = (b + 4 + 4 + 8) * psi / n
    transient = (4 + b) * largest
    measured_states = sum(nbytes(u.shard) + nbytes(u.grad_shard) + nbytes(u.master) for u in engine.units) + sum(
        nbytes(t) for ts in engine.optimizer.state.values() for t in ts)
    return {"preset": preset, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "dtype": dtype, "world": n, "psi": psi,
            "units": len(engine.units), "largest_unit": largest, "peak_above_before": peak,
            "rss_before": rss_before, "formula_states": states, "formula_transient": transient,
            "measured_states": measured_states, "whole_fp32": 4 * psi,
            "largest_live_numel": engine.materializer.largest_live_numel}


def report_meta(all_ranks: list[dict]) -> str:
    r = all_ranks[0]
    lines = [
        f"GPT preset {r['preset']!r} (n_layer {r['n_layer']}, n_embd {r['n_embd']}) built on the meta device: "
        f"Psi = {r['psi']:,} parameters ({r['whole_fp32'] / MiB:.0f} MiB in fp32), {r['units']} units, the largest "
        f"{r['largest_unit']:,}; {r['dtype']}, stage 3, world {r['world']}, AdamW",
        f"formula per rank: model states ({DTYPES[r['dtype']][1]}+4+4+8)*Psi/N = {r['formula_states'] / MiB:.1f} MiB "
        f"+ construction transient (4+{DTYPES[r['dtype']][1]})*largest unit = {r['formula_transient'] / MiB:.1f} MiB "
        f"= {(r['formula_states'] + r['formula_transient']) / MiB:.1f} MiB",
        "",
        "| rank | peak RSS above before initialize (MiB) | / formula | model-state tensors (MiB) | peak - model "
        "states (MiB) | / whole model fp32 | most parameter elements live at once | / Psi |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(all_ranks):
        formula = x["formula_states"] + x["formula_transient"]
        above = x["peak_above_before"] - x["measured_states"]  # the construction transient, measured
        lines.append(f"| {i} | {x['peak_above_before'] / MiB:.1f} | {x['peak_above_before'] / formula:.3f} | "
                     f"{x['measured_states'] / MiB:.1f} | {above / MiB:.1f} | {above / x['whole_fp32']:.3f} | "
                     f"{x['largest_live_numel']:,} | {x['largest_live_numel'] / x['psi']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    parser.add_argument("--hpz", type=int, default=1, help="zero_hpz_partition_size (stage 3)")
    parser.add_argument("--quantized", action="store_true", help="qwZ and qgZ on (block-aligned layout)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--json", help="write rank 0's numbers here")
    parser.add_argument("--meta", action="store_true", help="build on the meta device; report construction peaks")
    parser.add_argument("--n-layer", type=int, help="--meta: override the preset's n_layer")
    parser.add_argument("--n-embd", type=int, help="--meta: override the preset's n_embd")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    init_distributed()
    if args.meta:
        r = measure_meta(args.preset, args.dtype, args.n_layer, args.n_embd)
        all_ranks: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(all_ranks, r)
        if dist.get_rank() == 0:
            print(report_meta(all_ranks), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"ranks": all_ranks}, indent=1))
        dist.barrier()
        dist.destroy_process_group()
        return
    r = measure(args.preset, args.dtype, args.stage, args.hpz, args.quantized, args.seq, args.micro)
    all_ranks: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    if dist.get_world_size() > 1:
        dist.all_gather_object(all_ranks, r)
    else:
        all_ranks = [r]
    if dist.get_rank() == 0:
        print(report(r, all_ranks), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({**r, "ranks": all_ranks}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
