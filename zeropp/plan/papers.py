"""``python -m zeropp.plan.papers``: the planner's predictions side by side with what the ZeRO++, MiCS and AMSP papers
report, each paper's hardware as the cluster inputs (docs/planner.md, "Against the papers").

Every row compares two setups (a plan on a cluster with a model and a per-rank batch) by throughput per GPU: the
predicted ratio is ``b``'s tokens per GPU per second over ``a``'s from ``zeropp.plan.predict`` (``step time of a /
step time of b`` where both process the same tokens per GPU per step), at the cluster's ``overlap`` of 1 (every overlappable collective hidden under compute) and 0
(nothing hidden), which bracket what a real run overlaps. The reported column is the number the source prints,
with the figure or table it is in; ``None`` (printed "not found") where the number could not be found, never a
guess. Where a source does not give an input (a model's shape, a batch, the network), the input is ours and the
setting says so.

Sources (as read; the papers' own PDFs were not available offline):

* ZeRO++ (arXiv 2306.10209): the abstract (ICLR 2024 proceedings): "up to 2.16x better throughput at 384 GPU
  scale"; the DeepSpeed ZeRO++ blog (github.com/microsoft/DeepSpeed, blogs/zeropp, 2023-06-22), Figures 6 (384
  V100s, 4 x 100 Gbit/s InfiniBand per node), 7 (1 x 100 Gbit/s) and 8 (200 against 800 Gbit/s): TFLOPs per GPU
  of ZeRO-3 ("Baseline") and ZeRO++ (qwZ int8, hpZ over the node, qgZ int4) for 18B, 49B, 91B and 138B models at
  1K and 2K tokens per GPU; the DeepSpeed ZeRO++ tutorial: 16 V100-SXM3 32 GB per node, the 18B model is 40
  layers of hidden 6144 at sequence length 512.
* MiCS (arXiv 2205.00119), abstract: up to 2.89x the throughput of the state of the art, scaling efficiency up to
  1.27x DeepSpeed's, a 100B model on 512 GPUs at 99.4% weak-scaling efficiency, over 54.5% of each GPU's peak, on
  AWS. Its figures (instances, model shapes, per-figure ratios) were not found.
  The Amazon SageMaker sharded-data-parallel blog (aws.amazon.com/blogs/machine-learning, "Train gigantic models
  with near-linear scaling using sharded data parallelism on Amazon SageMaker", 2022-10-31; SageMaker's sharded
  data parallelism is MiCS): a 30B GPT-2 at sequence 2048 reaches 141 TFLOP/s per GPU, 39.7% over DeepSpeed ZeRO-3,
  on 256 GPUs; its instances, shape and sharding degree were not in the part read, so it has no row. The MiCS
  authors' ZeRO-3 on the same cloud, DeepSpeed pull request #1453 (github.com/deepspeedai/DeepSpeed, 2021-10-12):
  a 52B RoBERTa at 116.06 TFLOP/s per GPU on 8 p4d nodes (64 A100, 400 Gbit/s per node) and 108 on 32 (256 A100),
  16 sequences of 512 per GPU, layer-wise activation checkpointing not counted in the TFLOP/s.
* AMSP (arXiv 2311.00257), abstract: 52% MFU training a LLaMA-based model on 1024 GPUs, 1.56x the throughput of
  MiCS and ZeRO++, up to 90.3% scaling efficiency across 1024 GPUs. Its figures and hardware were not found. A point
  of the same P/G/OS space in production: InternLM's "Hybrid Zero" (InternEvo's ``zero1`` size is the
  optimizer-state sharding factor; a third-party summary of AMSP, sciencestack.ai, says AMSP trained InternLM),
  measured in InternLM's ``doc/en/train_performance.md`` (github.com/InternLM/InternLM), "Throughput
  Measurement" table: tokens per GPU per second (TGS) of InternLM-7B on 8 to 1024 A100-SXM4-80GB, 8 per node,
  4 x 100 Gbit/s RoCE per node, 2 sequences of 2048 tokens x 4 micro-batches per GPU per step, no activation
  checkpointing, with ``zero1=-1`` (optimizer states over every data-parallel rank: ZeRO-1) and ``zero1=8``
  (over the node: parameters and gradients replicated, P1/G1/OS8); the model's shape from InternLM's
  ``configs/7B_sft.py`` (hidden 4096, 32 layers, 32 heads, MLP ratio 8/3, vocabulary 103168).
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

from ..bench.report import rows_table
from .cluster import Cluster
from .model import ModelSpec, from_hf_dict, from_preset, from_sizes
from .search import Batch, Prediction, predict, rank
from .space import Partition, Plan

GBIT = 1e9 / 8
"""Bytes per second of one Gbit/s."""

GIB = 2**30

RECOMPUTE = 4 / 3
"""The ZeRO++ figures' TFLOPs count activation checkpointing's second forward (Megatron's FLOPs formula: 8 N per
token instead of the 6 N the planner counts): predicted TFLOPs are the planner's FLOPs times this per step time."""


Chooser = Callable[[ModelSpec, Cluster, Batch], Plan]
"""Picks a setup's plan for a cluster (the planner's choice changes with the cluster's overlap)."""


@dataclass(frozen=True)
class Setup:
    """A plan (or a ``Chooser`` of it) of a model on a cluster with a per-rank batch."""

    model: ModelSpec
    cluster: Cluster
    batch: Batch
    plan: Plan | Chooser

    def at(self, overlap: float) -> tuple[Plan, Cluster]:
        """The plan and the cluster at ``overlap``."""
        cluster = replace(self.cluster, overlap=overlap)
        return (self.plan if isinstance(self.plan, Plan) else self.plan(self.model, cluster, self.batch)), cluster

    def predict(self, overlap: float) -> Prediction:
        plan, cluster = self.at(overlap)
        return predict(self.model, plan, cluster, self.batch)

    def tokens(self) -> int:
        """Tokens per rank per step."""
        return self.batch.micro * self.batch.seq * self.batch.accum

    def label(self, overlap: float) -> str:
        return self.at(overlap)[0].label(self.cluster.world, self.cluster.ranks_per_node)


@dataclass(frozen=True)
class Comparison:
    """One claim of a paper against the planner: throughput per GPU of ``b`` over ``a``.

    Args:
        paper: "ZeRO++", "MiCS" or "AMSP".
        source: where the reported number is (figure, table or abstract).
        setting: the inputs in words, ours marked as such.
        compared: what the ratio is.
        a: the reference setup.
        b: the setup whose throughput is over ``a``'s.
        reported: the source's ratio, None where it was not found.
        reported_text: the source's numbers as printed (TFLOPs, percentages), or why there is none.
    """

    paper: str
    source: str
    setting: str
    compared: str
    a: Setup
    b: Setup
    reported: float | None
    reported_text: str

    def predicted(self, overlap: float) -> float:
        """Per-GPU throughput of ``b`` over ``a`` at ``overlap``: tokens per step over step time, ``b``'s over
        ``a``'s (``a``'s step time over ``b``'s when their batches match)."""
        return (self.b.tokens() * self.a.predict(overlap).step_time
                / (self.a.tokens() * self.b.predict(overlap).step_time))


def tflops(setup: Setup, overlap: float) -> float:
    """Predicted TFLOPs per GPU counted as the ZeRO++ figures count them (``RECOMPUTE``)."""
    p = setup.predict(overlap)
    b = setup.batch
    return RECOMPUTE * setup.model.flops_per_token(b.seq) * b.micro * b.seq * b.accum / p.step_time / 1e12


# ZeRO++: 24 DGX-2 nodes of 16 V100 32 GB (384 GPUs). Ours: NVSwitch 150 GB/s per GPU each way, 5/10 us latency,
# HBM 900 GB/s, 60 TFLOP/s on the figures' FLOPs (just above their best bar, 55) = 45 on the planner's.
def v100_cluster(ib_links: int) -> Cluster:
    """The ZeRO++ evaluation cluster with ``ib_links`` 100 Gbit/s InfiniBand links per node."""
    return Cluster(24, 16, 150e9, ib_links * 100 * GBIT, 5e-6, 10e-6, 32 * GIB, 60e12 / RECOMPUTE, 900e9)


def gpt(name: str, layers: int, hidden: int, seq: int) -> ModelSpec:
    """A GPT of ``layers`` blocks of ``hidden`` with GPT-2's vocabulary and learned positions."""
    block = 12 * hidden * hidden + 13 * hidden
    params = layers * block + 50257 * hidden + seq * hidden + 2 * hidden
    return replace(from_sizes(params, layers, hidden, seq), name=name)


ZEROPP_MODELS = {"18B": (40, 6144), "49B": (60, 8192), "91B": (72, 10240), "138B": (76, 12288)}
"""(layers, hidden): the 18B's from the DeepSpeed tutorial; the others' shapes were not found, these are ours (12 L
h^2 within 1% of the name)."""

ZEROPP_REPORTED = {
    # (model, tokens per GPU, IB links): (ZeRO-3 TFLOPs, ZeRO++ TFLOPs), blog Figures 6 (IB 4) and 7 (IB 1)
    ("18B", 1024, 4): (25, 35), ("49B", 1024, 4): (23, 36), ("91B", 1024, 4): (23, 36), ("138B", 1024, 4): (23, 36),
    ("18B", 2048, 4): (40, 53), ("49B", 2048, 4): (36, 51), ("91B", 2048, 4): (36, 51), ("138B", 2048, 4): (36, 50),
    ("18B", 1024, 1): (14, 31), ("49B", 1024, 1): (11, 22), ("91B", 1024, 1): (11, 22), ("138B", 1024, 1): (11, 22),
    ("18B", 2048, 1): (26, 46), ("49B", 2048, 1): (20, 38), ("91B", 2048, 1): (20, 38), ("138B", 2048, 1): (20, 38),
    # blog Figure 8, 2K tokens per GPU, 200 and 800 Gbit/s
    ("18B", 2048, 2): (37, 50), ("18B", 2048, 8): (47, 54), ("138B", 2048, 2): (32, 48), ("138B", 2048, 8): (48, 55),
}
"""TFLOPs per GPU as the blog's bars print them (rounded to integers: ratios carry a few percent of rounding)."""

SEQ = 512
"""The ZeRO++ runs' sequence length (the tutorial's); 1K and 2K tokens per GPU are 2 and 4 sequences (ours)."""


def zeropp_plans(world: int, d: int) -> tuple[Plan, Plan]:
    """ZeRO-3 and ZeRO++ (qwZ int8, qgZ int4 both hops, hpZ over the node) on ``world`` ranks, ``d`` per node."""
    z3 = Partition(world, world, world)
    return Plan(z3), Plan(z3, weight_bits=8, gradient_bits=4, hpz=d)


def zeropp_comparisons() -> list[Comparison]:
    out = []
    for (name, tokens, ib), (base, plus) in ZEROPP_REPORTED.items():
        layers, hidden = ZEROPP_MODELS[name]
        model, cluster = gpt(name, layers, hidden, SEQ), v100_cluster(ib)
        batch = Batch(tokens // SEQ, SEQ, 1, 2)
        z3, zpp = zeropp_plans(cluster.world, cluster.ranks_per_node)
        figure = {4: "Fig. 6", 1: "Fig. 7"}.get(ib, "Fig. 8")
        shape = "shape: tutorial" if name == "18B" else "shape: ours"
        out.append(Comparison(
            "ZeRO++", f"blog {figure}", f"{name} ({shape}), 384 V100, {ib * 100} Gbit/s, {tokens // 1024}K tok/GPU",
            "ZeRO++ / ZeRO-3", Setup(model, cluster, batch, z3), Setup(model, cluster, batch, zpp), plus / base,
            f"{base} -> {plus} TFLOPs"))
    for name in ("18B", "138B"):
        layers, hidden = ZEROPP_MODELS[name]
        model, batch = gpt(name, layers, hidden, SEQ), Batch(4, SEQ, 1, 2)
        slow, fast = v100_cluster(2), v100_cluster(8)
        z3, zpp = zeropp_plans(slow.world, slow.ranks_per_node)
        base, plus = ZEROPP_REPORTED[(name, 2048, 8)][0], ZEROPP_REPORTED[(name, 2048, 2)][1]
        out.append(Comparison(
            "ZeRO++", "blog Fig. 8", f"{name}, 384 V100, 2K tok/GPU", "ZeRO++ at 200 / ZeRO-3 at 800 Gbit/s",
            Setup(model, fast, batch, z3), Setup(model, slow, batch, zpp), plus / base,
            f"{base} (ZeRO-3, 800) vs {plus} (ZeRO++, 200) TFLOPs"))
    return out


# MiCS and AMSP: A100 nodes of 8 GPUs, NVSwitch 300 GB/s per GPU each way, HBM 1.5 (40 GB) / 2 TB/s (80 GB). The
# MiCS cloud: 400 Gbit/s per node (an AWS p4d's 4 x 100 Gbit/s EFA: ours, the paper's instances were not found),
# compute at the abstract's 54.5% of the A100's 312 TFLOP/s. AMSP: 800 Gbit/s per node (ours), 60% of peak (ours).
A100_PEAK = 312e12


def a100_cluster(nodes: int, memory_gib: int, inter_gbit: float, flops: float) -> Cluster:
    return Cluster(nodes, 8, 300e9, inter_gbit * GBIT, 5e-6, 10e-6, memory_gib * GIB, flops,
                   1.5e12 if memory_gib <= 40 else 2.0e12)


def states_fit(model: ModelSpec, plan: Plan, cluster: Cluster, batch: Batch) -> bool:
    """Whether a plan's model states fit in a rank's memory: the planner's memory less its activation estimate,
    which assumes no activation checkpointing (the papers' runs checkpoint)."""
    mem = predict(model, plan, cluster, batch).memory
    return sum(v for k, v in mem.items() if k != "activations") <= cluster.memory


def smallest_mics(model: ModelSpec, cluster: Cluster, batch: Batch) -> Plan:
    """MiCS over the fewest node-aligned ranks whose model states fit (MiCS's choice of partition group)."""
    for k in sorted({cluster.ranks_per_node * m for m in range(1, cluster.nodes + 1) if cluster.nodes % m == 0}):
        plan = Plan(Partition(k, k, k))
        if states_fit(model, plan, cluster, batch):
            return plan
    raise ValueError(f"{model.name}'s model states fit on no MiCS group of {cluster.world} ranks")


def mics_comparisons() -> list[Comparison]:
    model = replace(from_sizes(100_700_000_000, 80, 10240, 2048), name="100B")
    batch = Batch(1, 2048, 8, 2)
    flops = 0.545 * A100_PEAK

    def setups(nodes: int) -> tuple[Setup, Setup]:
        cluster = a100_cluster(nodes, 40, 400, flops)
        world = cluster.world
        return (Setup(model, cluster, batch, Plan(Partition(world, world, world))),
                Setup(model, cluster, batch, smallest_mics(model, cluster, batch)))

    z3_small, mics_small = setups(8)
    z3_large, mics_large = setups(64)
    setting = "100B (shape ours), A100 40 GB x 8, 400 Gbit/s (ours), 2K tok x 8 accum (ours)"
    return [
        deepspeed_pr1453(),
        Comparison("MiCS", "abstract", setting.replace("A100", "512 A100"), "MiCS / ZeRO-3 (up to)",
                   z3_large, mics_large, 2.89, "up to 2.89x (setting not found)"),
        Comparison("MiCS", "abstract", setting.replace("A100", "64 -> 512 A100"),
                   "MiCS weak scaling, 64 -> 512 GPUs", mics_small, mics_large, 0.994, "99.4% on 512 GPUs"),
        Comparison("MiCS", "abstract", setting.replace("A100", "64 -> 512 A100"),
                   "ZeRO-3 weak scaling, 64 -> 512 GPUs", z3_small, z3_large, None, "not found"),
        Comparison("MiCS", "abstract", setting.replace("A100", "512 A100"),
                   "scaling efficiency MiCS / ZeRO-3 (up to)", z3_large, mics_large, 1.27,
                   "up to 1.27x (MiCS = ZeRO-3 at 64 GPUs here, so this is the throughput ratio at 512)"),
    ]


def deepspeed_pr1453() -> Comparison:
    """ZeRO-3's weak scaling on p4d, 64 -> 256 A100 40 GB, 52B RoBERTa (shape ours: 64 x 8192 with a 53K
    vocabulary), compute at the 64-GPU rate (116.06 TFLOP/s on the pull request's count, which like the
    planner's leaves the recompute out; that run taken as compute-bound)."""
    model = replace(from_sizes(52_000_000_000, 64, 8192, 512, 53000), name="52B")
    batch = Batch(16, 512, 1, 2)

    def setup(nodes: int) -> Setup:
        cluster = a100_cluster(nodes, 40, 400, 116.06e12)
        return Setup(model, cluster, batch, Plan(Partition(cluster.world, cluster.world, cluster.world)))

    return Comparison("MiCS", "DeepSpeed PR #1453 (p4d)",
                      "52B RoBERTa (shape ours), 64 -> 256 A100 40 GB x 8, 400 Gbit/s, 16 x 512 tok/GPU",
                      "ZeRO-3 weak scaling, 64 -> 256 GPUs", setup(8), setup(32), 108 / 116.06,
                      "116.06 -> 108 TFLOP/s per GPU")


@functools.lru_cache(maxsize=None)
def best_exact(model: ModelSpec, cluster: Cluster, batch: Batch) -> Plan:
    """The planner's first choice among exact plans whose model states fit, no offload (AMSP's search space)."""
    for p in rank(model, cluster, batch, ("none",), lossy="none"):
        if states_fit(model, p.plan, cluster, batch):
            return p.plan
    raise ValueError(f"no exact plan of {model.name} fits on {cluster.world} ranks")


def amsp_comparisons() -> list[Comparison]:
    model = from_preset("llama-7b")
    batch = Batch(1, 4096, 1, 2)
    flops = 0.6 * A100_PEAK

    def cluster(nodes: int) -> Cluster:
        return a100_cluster(nodes, 80, 800, flops)

    big, one = cluster(128), cluster(1)
    world, d = big.world, big.ranks_per_node
    amsp = Setup(model, big, batch, best_exact)
    mics = Setup(model, big, batch, smallest_mics(model, big, batch))
    zpp = Setup(model, big, batch, zeropp_plans(world, d)[1])
    single = Setup(model, one, batch, best_exact)
    setting = "LLaMA-7B, 1024 A100 80 GB (8 per node, 800 Gbit/s: ours), 4K tok/GPU (ours)"
    picks = f"planner's pick: {amsp.label(1.0)} at overlap 1, {amsp.label(0.0)} at 0"
    return [
        Comparison("AMSP", "abstract", setting, f"best exact plan / MiCS ({mics.label(1.0)}); {picks}", mics, amsp,
                   1.56, "1.56x over MiCS and ZeRO++"),
        Comparison("AMSP", "abstract", setting, f"best exact plan / ZeRO++ ({zpp.label(1.0)})", zpp, amsp, 1.56,
                   "1.56x over MiCS and ZeRO++"),
        Comparison("AMSP", "abstract", setting.replace("1024", "8 -> 1024"),
                   "scaling efficiency of the best exact plan, 8 -> 1024 GPUs", single, amsp, 0.903,
                   "90.3% across 1024 GPUs (base scale not found)"),
    ]


INTERNLM_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "intermediate_size": 11008, "vocab_size": 103168, "max_position_embeddings": 2048}
"""InternLM-7B (``configs/7B_sft.py``) in Hugging Face keys: the MLP's 8/3 h rounded up to a multiple of 256 (11008:
ours, from the ratio); attention biases, which InternLM's attention may carry (4 h per layer, under 0.01% of the
parameters), left out."""

INTERNLM_TGS = {8: (4062, 4078), 16: (3842, 3939), 32: (3752, 3919), 64: (3690, 3944), 128: (3571, 3928),
                256: (3209, 3920), 512: (2861, 3835), 1024: (2271, 3625)}
"""GPUs: (TGS at ``zero1=-1``, TGS at ``zero1=8``), tp=1: InternLM's train_performance.md, Throughput table."""

INTERNLM_ACCUM = {(512, 2): (3900, 3084), (1024, 1): (3625, 2346), (1024, 2): (3625, 2817)}
"""(GPUs, micro-batches): (TGS at 4 micro-batches, TGS at that many), ``zero1=8``, 2 x 2048 tokens per micro-batch:
InternLM's train_performance.md, FLOPS table without activation checkpointing (packed samples)."""

INTERNLM_SCALES = (64, 256, 1024)
"""The scales whose rows are printed (the table has every power of two from 8)."""


def internlm_setup(gpus: int, zero1: int, micro_num: int = 4) -> Setup:
    """InternLM-7B on ``gpus`` A100 80 GB (8 per node, 4 x 100 Gbit/s) with optimizer states over ``zero1`` ranks
    (-1: all), parameters and gradients replicated; compute rate: the planner's FLOPs per token at the 8-GPU
    ``zero1=8`` TGS (that run taken as compute-bound: the one input taken from the table it is compared with);
    ``micro_num`` micro-batches of 2 x 2048 tokens per step."""
    model = from_hf_dict(INTERNLM_7B, "internlm-7b", 2048)
    flops = model.flops_per_token(2048) * INTERNLM_TGS[8][1]
    cluster = a100_cluster(gpus // 8, 80, 400, flops)
    shard = cluster.world if zero1 == -1 else zero1
    return Setup(model, cluster, Batch(2, 2048, micro_num, 2), Plan(Partition(1, 1, shard)))


def internlm_comparisons() -> list[Comparison]:
    source = "InternLM train_performance.md, Throughput table"
    setting = "InternLM-7B, {} A100 80 GB (8/node, 4 x 100 Gbit/s RoCE), 2 x 2K tok x 4 micro/GPU"
    out = []
    for column, zero1 in ((1, 8), (0, -1)):
        base = INTERNLM_TGS[8][column]
        for gpus in INTERNLM_SCALES:
            b = internlm_setup(gpus, zero1)
            tgs = INTERNLM_TGS[gpus][column]
            out.append(Comparison(
                "AMSP", source, setting.format(f"8 -> {gpus}"),
                f"scaling efficiency 8 -> {gpus} GPUs, zero1={zero1} ({b.label(1.0)})", internlm_setup(8, zero1), b,
                tgs / base, f"TGS {base} -> {tgs}"))
    for gpus in INTERNLM_SCALES[1:]:
        slow, fast = INTERNLM_TGS[gpus]
        out.append(Comparison(
            "AMSP", source, setting.format(gpus), f"zero1=8 / zero1=-1 at {gpus} GPUs (P1/G1/OS8 / ZeRO-1)",
            internlm_setup(gpus, -1), internlm_setup(gpus, 8), fast / slow, f"TGS {slow} -> {fast}"))
    for (gpus, micro_num), (four, fewer) in INTERNLM_ACCUM.items():
        out.append(Comparison(
            "AMSP", "InternLM train_performance.md, FLOPS table", setting.format(gpus).replace("x 4", f"x {micro_num}"),
            f"{micro_num} / 4 micro-batches per step at {gpus} GPUs, zero1=8 (P1/G1/OS8)",
            internlm_setup(gpus, 8), internlm_setup(gpus, 8, micro_num), fewer / four, f"TGS {four} -> {fewer}"))
    return out


PAPERS: dict[str, Callable[[], list[Comparison]]] = {
    "ZeRO++": zeropp_comparisons, "MiCS": mics_comparisons,
    "AMSP": lambda: amsp_comparisons() + internlm_comparisons()}


def comparisons(paper: str | None = None) -> list[Comparison]:
    """Every comparison of ``paper`` (one of ``PAPERS``), or of all three, ZeRO++ first."""
    if paper is not None and paper not in PAPERS:
        raise ValueError(f"paper={paper!r}: choose one of {list(PAPERS)}")
    return [c for name, make in PAPERS.items() if paper in (None, name) for c in make()]


def rows(cases: list[Comparison]) -> list[dict[str, Any]]:
    """One table row per comparison: reported and predicted ratios (overlap 1 and 0), TFLOPs for ZeRO++ rows."""
    out = []
    for c in cases:
        row: dict[str, Any] = {"paper": c.paper, "source": c.source, "setting": c.setting, "compared": c.compared,
                               "reported": c.reported_text,
                               "reported_x": "not found" if c.reported is None else c.reported,
                               "predicted_x (overlap 1)": c.predicted(1.0), "predicted_x (overlap 0)": c.predicted(0.0)}
        if c.paper == "ZeRO++":
            row["predicted TFLOPs (overlap 1 / 0)"] = (
                f"{tflops(c.a, 1.0):.0f} -> {tflops(c.b, 1.0):.0f} / {tflops(c.a, 0.0):.0f} -> {tflops(c.b, 0.0):.0f}")
        out.append(row)
    return out


COLUMNS = ("paper", "source", "setting", "compared", "reported", "reported_x", "predicted_x (overlap 1)",
           "predicted_x (overlap 0)", "predicted TFLOPs (overlap 1 / 0)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeropp.plan.papers", description=__doc__.splitlines()[0])
    parser.add_argument("--paper", choices=tuple(PAPERS), help="only this paper's rows")
    args = parser.parse_args(argv)
    cases = comparisons(args.paper)
    fmt = {"reported_x": ".3g", "predicted_x (overlap 1)": ".3g", "predicted_x (overlap 0)": ".3g"}
    print(rows_table(rows(cases), COLUMNS, fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
