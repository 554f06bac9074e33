"""ZeRO++ in the engine (issue 4, phase 2): qwZ, hpZ and qgZ, alone and together, on 4 real gloo ranks as 2 emulated
nodes of 2 (``ZEROPP_RANKS_PER_NODE=2``), against the exact ZeRO-3 run of the same job (one launched job, see
``engine_workers.zeropp_runs``).

Accuracy. Each run trains the tiny GPT (no biases) 10 AdamW steps (lr 3e-3) on crops of an English text, where the
loss falls from 5.57 to about 3.55, so a loss comparison means something. The yardstick for the parameters is the
exact run's own displacement ``||theta_exact - theta_0||``: a quantized run is compared by ``||theta - theta_exact||
/ ||theta_exact - theta_0||`` (fp32 master weights). Measured (torch 2.13 CPU): qwZ int8 0.050, hpZ 0
(bit-identical: secondaries are exact copies of the gathered values), qgZ int4 0.264, with error feedback 0.206, all
three 0.275, all three with error feedback and 2 accumulation steps 0.155, stage 2 with qwZ and qgZ 0.264, all three
on interleaved nodes ({0, 2}, {1, 3}) 0.261, int4 weights with int8 gradients (and hpZ) 0.381, qgZ int4 with the
32-element Hadamard rotation 0.241, all three rotated with error feedback 0.210, qgZ with int8 inside the node and
int4 across 0.200, int8 inside and int2 across 0.819 (0.585 with error feedback: int2 gradients learn markedly slower
here, their losses up to 15% above exact and the loss drop 73% of exact's), qgZ int4 with stochastic rounding 0.286
(unbiased but noisier than round to nearest: a code errs by up to a whole scale; final loss 3.551 against exact's
3.549), with LoCo's 8-bit moving-average residuals (beta 0.5) 0.204 (float32 residuals: 0.206). int4 codes carry ~12%
relative error per block, and Adam turns the error of small gradient elements into O(lr) steps, hence the larger qgZ
figure; int4 weights perturb every forward and backward too. An unrelated update would give ~1.4. Bounds: 0.1 for
qwZ alone, 0.35 with int4 qgZ, 0.5 with int4 qwZ, 0 for hpZ alone; losses within 1% of the exact run's at every
step, and the final loss drop at least 97% of the exact run's (measured: worst 98.7%, all three flags); int2
gradients: 1.0, 20% and 60%.

Bytes. Per step (forward, backward, step; ``comm.stats()`` of the last step) the cross-node bytes are compared
with the formulas of ``zeropp.comm.accounting`` evaluated by hand from each unit's shard size ``S`` (elements, a
multiple of the block size when anything is quantized): an exact gather or reduce-scatter of fp32 sends
``(P - d) * 4 S`` bytes across nodes; a qwZ gather ``(P - d) * (S * bits / 8 + 4 S / block)``; qgZ's second hop
``(n - 1) * (S * bits / 8 + 4 S / block)``; an hpZ backward gather ``0`` (and ``(h - 1) * 4 P S / h`` inside the
node). Stage 3 gathers the root unit once per micro-batch (it stays whole through backward), the others twice:
every run frees every unit after its use (``EVERY_GATHER``: no persistent units, reuse distance 0; the tiny GPT's
units would all persist under DeepSpeed's defaults, see ``test_reuse``).

Planner (issue 25). ``check_planner``: ``zeropp.plan`` predicts from the preset alone every field of the counters
(sent and received, intra and inter, per kind) and the bytes of the engine's parameter buffers, fp32 gradient
shards and optimizer states (masters and AdamW moments) of every run, stage 1 included.
"""

from __future__ import annotations

from engine_launch import launch

from zeropp.plan import Partition, Plan, from_preset
from zeropp.plan.memory import memory
from zeropp.plan.traffic import Layout, collectives, totals

P, D, N, BLOCK = 4, 2, 2, 128
QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}
HPZ = {"zero_hpz_partition_size": 2}
EF = {"zeropp": {"error_feedback": True}}
RUNS = {
    "exact": {},
    "qwz": {"zero": QW},
    "hpz": {"zero": HPZ},
    "qgz": {"zero": QG},
    "qgz-ef": {"zero": {**QG, **EF}},
    "all": {"zero": {**QW, **HPZ, **QG}},
    "all-ef-accum2": {"micro": 1, "accum": 2, "zero": {**QW, **HPZ, **QG, **EF}},
    "stage2-qwz-qgz": {"stage": 2, "zero": {**QW, **QG}},
    "stage1": {"stage": 1},
    "all-interleaved": {"interleaved": True, "zero": {**QW, **HPZ, **QG}},  # nodes {0, 2} and {1, 3}
    "all-w4-g8": {"zero": {**QW, **HPZ, **QG, "zeropp": {"weight_bits": 4, "gradient_bits": 8}}},
    "qgz-rot": {"zero": {**QG, "zeropp": {"gradient_rotation": "hadamard"}}},
    "all-rot-ef": {"zero": {**QW, **HPZ, **QG, "zeropp": {"gradient_rotation": "hadamard", "error_feedback": True}}},
    "qgz-8-4": {"zero": {**QG, "zeropp": {"gradient_bits_intra": 8}}},  # int8 inside the node, int4 across
    "qgz-8-2": {"zero": {**QG, "zeropp": {"gradient_bits_intra": 8, "gradient_bits": 2}}},
    "qgz-8-2-ef": {"zero": {**QG, "zeropp": {"gradient_bits_intra": 8, "gradient_bits": 2, "error_feedback": True}}},
    "qgz-sr": {"zero": {**QG, "zeropp": {"gradient_stochastic_rounding": True}}},  # unbiased rounding
    "qgz-loco": {"zero": {**QG, "zeropp": {"error_feedback": "loco"}}},  # LoCo's 8-bit residuals
}
EVERY_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
for _run in RUNS.values():
    _run["zero"] = {**EVERY_GATHER, **_run.get("zero", {})}


def packed(s: int, bits: int) -> int:
    """Bytes of one pack of ``s`` elements (a multiple of the block): codes then one fp32 scale per block."""
    assert s % BLOCK == 0
    return s * bits // 8 + 4 * (s // BLOCK)


def expected_inter(run: dict, units: list[dict]) -> dict[str, int]:
    """Cross-node bytes this rank sends in one optimizer step of ``run``, by collective kind."""
    zero, stage, accum = run.get("zero", {}), run.get("stage", 3), run.get("accum", 1)
    hpz = zero.get("zero_hpz_partition_size", 1) > 1
    bits = zero.get("zeropp", {})
    qw = bits.get("weight_bits", 8) if zero.get("zero_quantized_weights") else None
    qg = bits.get("gradient_bits", 4) if zero.get("zero_quantized_gradients") else None

    def gather(s: int) -> int:  # one all-gather over the DP group
        return (P - D) * (packed(s, qw) if qw else 4 * s)

    ag = rs = 0
    for u in units:
        s = u["shard"]
        if stage == 3:
            # first micro-batch: forward gather, then (non-root) the backward re-gather, from secondaries with hpZ;
            # later micro-batches gather from secondaries with hpZ, else over the DP group again
            per_micro = 1 + (u["name"] != "")
            ag += gather(s) * (1 if hpz else per_micro * accum)
        else:
            ag += gather(s)  # the post-step gather
        rs += accum * ((N - 1) * packed(s, qg) if qg else (P - D) * 4 * s)
    return {"all_gather": ag, "reduce_scatter": rs}


def planned(run: dict) -> Plan:
    """The ``zeropp.plan`` plan of one run."""
    zero, stage = run.get("zero", {}), run.get("stage", 3)
    bits = zero.get("zeropp", {})
    part = {1: Partition(1, 1, P), 2: Partition(1, P, P), 3: Partition(P, P, P)}[stage]
    return Plan(part, weight_bits=bits.get("weight_bits", 8) if zero.get("zero_quantized_weights") else None,
                gradient_bits=bits.get("gradient_bits", 4) if zero.get("zero_quantized_gradients") else None,
                gradient_bits_intra=bits.get("gradient_bits_intra"), hpz=zero.get("zero_hpz_partition_size", 1))


def check_planner(res: dict) -> None:
    """``zeropp.plan`` predicts, from the preset alone, every byte the counters saw (all four fields of each kind)
    and the bytes of the parameters, gradient shards and optimizer states the engine holds (fp32 here)."""
    model = from_preset("tiny:nobias")
    for name, run in RUNS.items():
        plan = planned(run)
        want = totals(collectives(model, plan, Layout(P, D), run.get("accum", 1), 4))
        got = {k: {f: v for f, v in res[name]["traffic"][k].items() if f != "calls"} for k in want}
        assert got == want and all(not res[name]["traffic"][k]["calls"] for k in set(res[name]["traffic"]) - set(want)
                                   ), (name, got, want)
        mem = memory(model, plan, P, run.get("micro", 2), 64, 4)
        assert res[name]["memory"] == {"params": mem["params"], "grads": mem["grads"], "optimizer": mem["optimizer"]}, (
            name, res[name]["memory"], mem)


def test_zeropp_flags_accuracy_and_cross_node_bytes(tmp_path):
    results = launch("engine_workers:zeropp_runs", P, tmp_path, env={"ZEROPP_RANKS_PER_NODE": str(D)},
                     timeout=420, runs=RUNS)
    for r in results[1:]:  # the losses are all-reduced, the layouts and the symmetric byte counts are the same
        assert r == results[0] or all(r[k]["losses"] == results[0][k]["losses"] for k in RUNS)
    res = results[0]
    exact = res["exact"]["losses"]
    drop = exact[0] - exact[-1]
    assert drop > 1.5, exact  # the job learns
    check_planner(res)
    inter = {}
    for name, run in RUNS.items():
        r = res[name]
        quantized = bool({"zero_quantized_weights", "zero_quantized_gradients"} & set(run.get("zero", {})))
        assert all(u["align"] == (BLOCK if quantized else 1) for u in r["units"]), name
        # accuracy against the exact run
        if name != "exact":
            int2 = name.startswith("qgz-8-2")
            slack, keep = (0.2, 0.6) if int2 else (0.01, 0.97)  # int2 codes learn slower
            for got, want in zip(r["losses"], exact):
                assert abs(got - want) <= slack * want, (name, r["losses"], exact)
            assert r["losses"][0] - r["losses"][-1] >= keep * drop, (name, r["losses"], exact)
            bound = 1.0 if int2 else {"hpz": 0.0, "qwz": 0.1, "all-w4-g8": 0.5}.get(name, 0.35)
            assert r["rel_to_update"] <= bound, (name, r["rel_to_update"])
        # bytes against the formulas
        t = r["traffic"]
        want = expected_inter(run, r["units"])
        got = {kind: t[kind]["sent_inter"] for kind in want}
        assert got == want, (name, got, want)
        assert all(t[k]["sent_inter"] == t[k]["recv_inter"] for k in want), name
        inter[name] = got
    assert res["hpz"]["losses"] == exact and res["hpz"]["rel_to_update"] == 0.0  # hpZ is exact
    assert res["qgz-ef"]["rel_to_update"] < res["qgz"]["rel_to_update"]  # error feedback helps
    # the rotation (R = 32) is on where asked, keys the residuals, changes the numbers and moves the same bytes
    assert [res[k]["rotation"] for k in ("qgz", "qgz-rot", "all-rot-ef")] == [None, 32, 32]
    assert res["all-rot-ef"]["ef_keys"] and all(key[4] == 32 for key in res["all-rot-ef"]["ef_keys"])
    assert res["qgz-rot"]["rel_to_update"] < res["qgz"]["rel_to_update"]  # and helps here (0.241 against 0.264)
    assert inter["qgz-rot"] == inter["qgz"] and inter["all-rot-ef"] == inter["all"]
    # int8 inside the node and int4 across (gradient_bits_intra): the cross-node bytes of int4, less error
    assert inter["qgz-8-4"] == inter["qgz"] and res["qgz-8-4"]["rel_to_update"] < res["qgz"]["rel_to_update"]
    assert inter["qgz-8-2"]["reduce_scatter"] < 0.6 * inter["qgz"]["reduce_scatter"]  # int2 across: about half
    # stochastic rounding changes the numbers, not the bytes; LoCo's 8-bit residuals help as float32 ones do
    assert res["qgz-sr"]["losses"] != res["qgz"]["losses"] and inter["qgz-sr"] == inter["qgz"]
    assert res["qgz-loco"]["rel_to_update"] < res["qgz"]["rel_to_update"] and inter["qgz-loco"] == inter["qgz"]

    total = {name: sum(v.values()) for name, v in inter.items()}
    e = inter["exact"]
    # full ZeRO++ moves at most 0.27x (measured 0.116x: fp32 here, not bf16) of exact ZeRO-3's cross-node bytes
    assert total["all"] <= 0.27 * total["exact"], total
    # each flag moves its own collective only, by its ratio (padding to the block grid costs ~1% of S);
    # qwZ int8 vs an exact fp32 gather: S + 4 S / block against 4 S bytes
    assert inter["qwz"]["reduce_scatter"] <= 1.02 * e["reduce_scatter"]
    assert 0.99 * (1 + 4 / BLOCK) / 4 <= inter["qwz"]["all_gather"] / e["all_gather"] <= 1.02 * (1 + 4 / BLOCK) / 4
    assert inter["hpz"]["reduce_scatter"] == e["reduce_scatter"]
    # hpZ: only the forward gathers cross nodes (root 1 of 1 gathers, others 1 of 2)
    fwd = sum((P - D) * 4 * u["shard"] for u in res["exact"]["units"])
    assert inter["hpz"]["all_gather"] == fwd and 0.5 < fwd / e["all_gather"] < 0.6
    assert inter["qgz"]["all_gather"] <= 1.02 * e["all_gather"]
    # qgZ int4 vs an exact fp32 reduce-scatter: (n - 1) (S / 2 + S / 32) against (P - d) 4 S bytes = 1 / 15.06
    ratio = inter["qgz"]["reduce_scatter"] / e["reduce_scatter"]
    assert 0.99 * (0.5 + 4 / BLOCK) / 8 <= ratio <= 1.02 * (0.5 + 4 / BLOCK) / 8, ratio
    # with hpZ and accumulation only the first forward of a step crosses nodes
    assert inter["all-ef-accum2"]["all_gather"] == inter["all"]["all_gather"]
    # hpZ's backward gathers stay inside the node: exact fp32, (h - 1) * 4 P S / h bytes each
    t = res["hpz"]["traffic"]["all_gather"]
    units = res["hpz"]["units"]
    assert t["sent_intra"] == sum((D - 1) * 4 * u["shard"] for u in units) + sum(
        4 * P * u["shard"] // 2 for u in units if u["name"])
