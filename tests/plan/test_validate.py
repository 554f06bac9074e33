"""``zeropp.plan.validate``'s pure parts: case parsing and its errors, the named plans (each one the engine runs,
with a config the loader takes), and a row's ratios and tolerances against a prediction made here. The cluster
jobs themselves are run by hand (docs/results/planner.md); nothing here times anything."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeropp.config import load_config
from zeropp.plan import Batch, Cluster, from_preset, predict
from zeropp.plan.validate import PLANS, Case, compare, parse_case, plan_of, table


def test_parse_case_and_its_errors() -> None:
    assert parse_case(" zeropp@100mbit@2X4") == Case("zeropp", "100mbit", 2, 4)
    for bad, needle in (("zero3@1gbit", "PLAN@RATE@NODESxRANKS"), ("zero9@1gbit@2x2", "zero9"),
                        ("zero3@1gbps@2x2", "1gbps"), ("zero3@1gbit@2by2", "2by2"), ("zero3@1gbit@1x4", "2 nodes")):
        with pytest.raises(ValueError, match=needle):
            parse_case(bad)


@pytest.mark.parametrize("layout", [(2, 2), (2, 4), (4, 2)])
def test_every_named_plan_runs_today_with_a_config_the_loader_takes(layout) -> None:
    nodes, d = layout
    world = nodes * d
    labels = set()
    for name in PLANS:
        plan = plan_of(name, nodes, d)
        assert plan.unsupported(world, d) is None, name
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": plan.zero_config(world)},
                    world_size=world)
        labels.add(plan.label(world, d))
    assert len(labels) == len(PLANS)  # no two names are the same plan


def test_row_ratios_and_tolerances() -> None:
    cluster = Cluster(2, 2, 1e9, 1.25e8, 1e-5, 1e-4, 8e9, 2e10, 5e9)
    case = Case("zero3", "1gbit", 2, 2)
    pred = predict(from_preset("tiny", 32), plan_of("zero3", 2, 2), cluster, Batch(1, 32, 1, 4))
    states = {k: pred.memory[k] for k in ("params", "secondary", "grads", "optimizer")}
    assert states["params"] > 0 and states["optimizer"] == 3 * states["grads"]
    slow = {"step_s": 1.2 * pred.step_time, "times": [1.0], "rss_peak": 0,
            "memory": {**states, "optimizer": int(states["optimizer"] * 1.05)}}
    row = compare(case, cluster, slow, "tiny", 1, 32, 0.15, 0.10)
    assert row["time_ratio"] == pytest.approx(1.2) and not row["time_ok"]
    want = (sum(states.values()) + int(states["optimizer"] * 1.05) - states["optimizer"]) / sum(states.values())
    assert row["mem_ratio"] == pytest.approx(want) and row["mem_ok"]
    fast = compare(case, cluster, {**slow, "step_s": 0.9 * pred.step_time}, "tiny", 1, 32, 0.15, 0.10)
    assert fast["time_ok"] and fast["plan"] == "ZeRO-3"
    text = table([row, fast])
    assert text.count("\n") == 3 and "| no " in text and "| yes " in text


def test_model_step_rate_and_analyse_of_a_kept_folder(tmp_path) -> None:
    # the prediction uses the model's own compute rate when the job measured it (the matmul rate's ratio kept);
    # --analyse re-applies the planner to the kept files (manifest, job, calibration) and gives the same row
    import argparse
    import json

    from zeropp.plan.validate import analyse, main, summary

    cluster = Cluster(2, 2, 1e9, 1.25e8, 1e-5, 1e-4, 8e9, 2e10, 5e9, kernel_bw=2e9, overlap=0.0, backend="gloo")
    case = Case("mics-qgz", "1gbit", 2, 2)
    batch = Batch(1, 32, 1, 4)
    spec = from_preset("tiny", 32)
    fast = predict(spec, plan_of("mics-qgz", 2, 2), cluster, batch)
    slow = predict(spec, plan_of("mics-qgz", 2, 2), replace(cluster, flops=1e10), batch)
    assert slow.step_time == pytest.approx(fast.step_time + fast.breakdown["compute"])
    states = {k: slow.memory[k] for k in ("params", "secondary", "grads", "optimizer")}
    measured = {"step_s": slow.step_time, "times": [1.0, slow.step_time], "rss_peak": 0, "memory": states,
                "phases_s": {"forward": 0.1, "backward": 0.2, "step": 0.05}}
    row = compare(case, cluster, measured, "tiny", 1, 32, 0.15, 0.10, model_flops=1e10)
    assert row["time_ratio"] == pytest.approx(1.0) and row["time_ok"] and row["meas_step_s"] == slow.step_time
    assert (row["rank0_forward_s"], row["rank0_backward_s"], row["rank0_step_s"]) == (0.1, 0.2, 0.05)
    assert row["time_ratio_matmul"] == pytest.approx(slow.step_time / fast.step_time)
    assert row["pred_quant_s"] == pytest.approx(fast.breakdown["quant"]) and row["pred_quant_s"] > 0
    (tmp_path / "cluster0.json").write_text(cluster.to_json())
    (tmp_path / "job0.json").write_text(json.dumps({"cluster": "cluster0.json", "load": [[1, 1, 1], [2, 2, 2]],
                                                    "model_flops": 1e10, "plans": {"mics-qgz": measured}}))
    (tmp_path / "manifest.json").write_text(json.dumps([{"nodes": 2, "ranks_per_node": 2, "rate": "1gbit",
                                                         "plans": ["mics-qgz"], "out": "job0.json",
                                                         "cluster": "cluster0.json"}]))
    args = argparse.Namespace(model="tiny", micro=1, seq=32, time_tol=0.15, mem_tol=0.10)
    kept = analyse(str(tmp_path), args)
    assert len(kept) == 1 and kept[0]["time_ratio"] == pytest.approx(1.0) and kept[0]["cal_overlap"] == 0.0
    assert kept[0]["cal_overlap_intra"] == ""  # a file from before overlap_intra: the planner uses overlap
    assert "1/1 rows from calibrations without overlap_intra" in summary(kept, args)
    assert main(["--analyse", str(tmp_path), "--model", "tiny", "--seq", "32", "--csv",
                 str(tmp_path / "out.csv")]) == 0
    assert (tmp_path / "out.csv").read_text().count("\n") == 2
