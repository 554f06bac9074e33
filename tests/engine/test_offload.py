"""The optimizer offload tiers (``zeropp.engine.offload``, DeepSpeed's ``offload_optimizer``) change where the fp32
masters, gradient shards and Adam states live, never a value.

On 4 gloo ranks as 2 emulated nodes of 2, the tiny GPT trains 3 steps per case with the optimizer's side on the
device (``none``, the reference), on the CPU (``cpu``: on this CPU-only machine the same memory as ``none``; the
host-device copies run in the CUDA tests), and on NVMe swap files under pytest's tmp dir (``nvme``: pipelined reads
and writes with 4 buffers; ``nvme_sync``: neither pipelined, one buffer, so every unit is read and written alone;
at stage 3, ``cpu_ratio``: ``ratio`` 0.5, half the units' optimizer side on the host, and ``nvme_param_cpu``: with
``offload_param: cpu`` too, the compute shards in host memory).
Cases: stages 1, 2 and 3; fp32, bf16 and fp16 (loss scaling); gradient accumulation 2; clipping; a frozen block;
full ZeRO++ (qwZ, qgZ, hpZ). Every run's losses and final fp32 masters are bit-identical to ``none``'s; NVMe runs
hold one swap file per unit and state kind, release the masters' and states' memory between steps (from the end
of ``initialize``: never more than ``buffer_count`` units' in memory at once, construction included), and delete
the files at ``destroy()``.

Checkpoints: a 4-rank NVMe run saves, then every tier loads it at 4 and at 2 ranks and continues: the loaded masters
equal the saved ones, and at 4 ranks the continued losses and masters equal the NVMe run's own continuation.

Faults: a swap file of one rank corrupted, truncated or deleted between steps: the next step raises
``OffloadError`` on every rank (naming the failing rank; that rank's message names the file), and any later use of
the engine raises too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_launch import launch

NODES = {"ZEROPP_RANKS_PER_NODE": "2"}
FULL = {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}
RUNS = {
    "none": {},
    "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": False}},
    "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "pipeline_read": True,
                                   "pipeline_write": True, "buffer_count": 4, "pin_memory": False}},
    "nvme_sync": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "buffer_count": 1,
                                        "pin_memory": False}},
    "cpu_ratio": {"offload_optimizer": {"device": "cpu", "ratio": 0.5, "pin_memory": False}},
    "nvme_param_cpu": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "pin_memory": False},
                       "offload_param": {"device": "cpu", "pin_memory": False}},
}
CASES = {
    "stage1_fp32": {"zero": {"stage": 1}},
    "stage2_bf16_clip": {"zero": {"stage": 2}, "dtype": "bf16", "clipping": 0.5},
    "stage3_fp16_accum": {"zero": {"stage": 3}, "dtype": "fp16", "accumulation": 2},
    "stage3_zeropp_frozen": {"zero": {"stage": 3, **FULL}, "dtype": "bf16", "frozen": True, "clipping": 1.0},
}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_tier_trains_bit_identically(tmp_path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = launch("offload_workers:tiers", 4, tmp_path, env=NODES, timeout=600, cases=CASES, runs=RUNS,
                     nvme=str(nvme))
    for rank, res in enumerate(results):
        for case, runs in res.items():
            stage3 = CASES[case]["zero"]["stage"] == 3
            assert ("nvme_param_cpu" in runs) == ("cpu_ratio" in runs) == stage3, (case, list(runs))
            ref = runs["none"]
            assert len(ref["losses"]) == 3 * CASES[case].get("accumulation", 1)
            for name, run in runs.items():
                assert run["losses"] == ref["losses"], (rank, case, name)
                assert _same(run["masters"], ref["masters"]), (rank, case, name)
                if name.startswith("nvme"):  # files "<index>-unit<u>.<kind>.swap"
                    regions = {f.split("-", 1)[1].rsplit(".", 1)[0] for f in run["files"]}
                    assert regions == {f"unit{u}.{kind}" for u in run["stepped"]
                                       for kind in ("master", "exp_avg", "exp_avg_sq")}, run["files"]
                    assert run["released"], (case, name)
                    assert 0 < run["peak"][0] <= run["peak"][1], (case, name, run["peak"])
                    assert not run["left"], "destroy() left the swap directory"
    # the masters moved: the comparison is not of untouched weights
    first = results[0]["stage1_fp32"]["none"]
    assert first["losses"][-1] < first["losses"][0]
    assert not list((nvme / "zeropp-swap").glob("*-rank*")), "swap directories left behind"


def test_checkpoints_load_across_tiers_and_world_sizes(tmp_path) -> None:
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    saved = launch("offload_workers:checkpoint_across_tiers", 4, tmp_path, env=NODES, timeout=300, nvme=str(nvme),
                   save_dir=str(ckpt), phase="save")
    loaded4 = launch("offload_workers:checkpoint_across_tiers", 4, tmp_path, env=NODES, timeout=300, nvme=str(nvme),
                     save_dir=str(ckpt), phase="load")
    loaded2 = launch("offload_workers:checkpoint_across_tiers", 2, tmp_path, timeout=300, nvme=str(nvme),
                     save_dir=str(ckpt), phase="load")
    for want, res in zip(saved, loaded4):  # losses are each rank's own micro-batch's
        for name, run in res.items():
            assert _same(run["loaded"], want["saved"]), name
            assert run["losses"] == want["losses"], name
            assert _same(run["masters"], want["masters"]), name
    for res in loaded2:
        for name, run in res.items():
            assert _same(run["loaded"], saved[0]["saved"]), name
        assert res["none"]["losses"] == res["nvme"]["losses"] == res["cpu"]["losses"]
        assert _same(res["none"]["masters"], res["nvme"]["masters"])


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "delete"])
def test_a_damaged_swap_file_stops_every_rank(tmp_path, fault) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = launch("offload_workers:swap_faults", 2, tmp_path, timeout=300, nvme=str(nvme), fault=fault, victim=1)
    for rank, res in enumerate(results):
        assert res["step"] is not None, (rank, "the step after the damage went on")
        assert "failed reading or writing the NVMe offload's swap files on rank(s) [1]" in res["step"], res["step"]
        assert "load the last checkpoint" in res["step"]
        assert res["later"] is not None and res["later"].startswith("this engine cannot go on"), res["later"]
    victim = results[1]["step"]
    assert "unit1.exp_avg" in victim, victim


def test_hugging_face_trainer_templates_run_unchanged(tmp_path) -> None:
    """transformers' ds_config_zero2.json (optimizer offload to CPU) and ds_config_zero3.json (optimizer and
    parameter offload to CPU), autos filled as the Trainer fills them (train_batch_size 16 = 4 x 2 x 2 ranks):
    they run as they are, with the tiers they ask for, bit-identical to the same config without offload."""
    fixtures = Path(__file__).parent / "fixtures" / "hf_trainer"
    paths = [str(fixtures / "ds_config_zero2_filled.json"), str(fixtures / "ds_config_zero3_filled.json")]
    results = launch("offload_workers:hf_templates", 2, tmp_path, timeout=300, paths=paths)
    for res in results:
        assert res["ds_config_zero2_filled.json"]["template"]["tiers"] == ["cpu", False]
        assert res["ds_config_zero3_filled.json"]["template"]["tiers"] == ["cpu", True]
        for runs in res.values():
            assert runs["template"]["losses"] == runs["no offload"]["losses"]
            assert _same(runs["template"]["masters"], runs["no offload"]["masters"])
            assert len(runs["template"]["losses"]) == 4
            assert runs["template"]["applied"] >= 1, "every step was skipped (fp16 overflow): nothing was compared"


def _offload(tmp_path, numels: list[int], **keys):
    from zeropp.config import AioConfig, OffloadOptimizerConfig
    from zeropp.engine.offload import OptimizerOffload

    config = OffloadOptimizerConfig(**{"pin_memory": False, **keys})
    return OptimizerOffload(config, AioConfig(), device=torch.device("cuda"), numels=numels, rank=0)


def test_ratio_puts_the_first_units_up_to_that_fraction_on_the_host(tmp_path) -> None:
    """DeepSpeed's partial offload: the first units whose elements add up to at most ``ratio`` of all go to the
    host, the rest stay on the device (a device object only: nothing is allocated)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _offload(tmp_path, [10, 10, 10, 10], device="cpu", ratio=0.5).homes == [cpu, cpu, cuda, cuda]
    assert _offload(tmp_path, [30, 10, 10, 50], device="cpu", ratio=0.5).homes == [cpu, cpu, cpu, cuda]
    assert _offload(tmp_path, [60, 10], device="cpu", ratio=0.5).homes == [cuda, cuda]
    assert _offload(tmp_path, [10, 10], device="cpu").homes == [cpu, cpu]
    assert _offload(tmp_path, [10, 10]).homes == [cuda, cuda]


class _FakeUnit:
    def __init__(self, master: torch.Tensor) -> None:
        self.master = master


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_the_stream_holds_at_most_buffer_count_units_and_keeps_every_value(tmp_path, pipelined, buffers) -> None:
    """Units of random sizes through an NVMe tier, set up as the engine does: each master swapped out as soon as it
    exists (``admit``), ``exp_avg`` made by ``zeros`` (no memory, no write until first stepped), ``exp_avg_sq``
    handed over in memory (``attach``). At most ``buffer_count`` units ever hold memory at once, during set-up and
    at every yield, and the yielded one does; what the consumer wrote comes back from the swap files exactly (a
    reference of the same updates applied to copies in memory; the zero state read as zeros without a read). A
    consumer that stops early leaves nothing held, and the unit it held keeps its last written values."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    sizes = [int(n) for n in torch.randint(1, 5000, (7,), generator=gen)]
    masters = [torch.randn(n, generator=gen) for n in sizes]
    units = [_FakeUnit(m) for m in masters]
    off = _offload(tmp_path, sizes, device="nvme", nvme_path=str(tmp_path), buffer_count=buffers,
                   pipeline_read=pipelined, pipeline_write=pipelined)
    off.open(sizes, ("exp_avg", "exp_avg_sq"))
    ref = []
    for u, m in enumerate(masters):
        ref.append([m.clone(), torch.zeros(sizes[u])])
        off.admit(u, m)
        assert sum(1 for v in masters[:u + 1] if v.untyped_storage().nbytes()) <= buffers
    state = {"exp_avg": [off.zeros(u, m, "exp_avg") for u, m in enumerate(masters)],
             "exp_avg_sq": [torch.randn(n, generator=gen) for n in sizes]}
    for u in range(len(units)):
        ref[u].append(state["exp_avg_sq"][u].clone())
    assert all(t.untyped_storage().nbytes() == 0 for t in state["exp_avg"])
    off.attach(units, state)
    assert all(t.untyped_storage().nbytes() == 0 for t in [*masters, *state["exp_avg"], *state["exp_avg_sq"]])
    assert off.peak_resident <= buffers
    for step in range(3):
        for u in off.stream(units, write=True):
            held = [v for v in range(len(units)) if masters[v].untyped_storage().nbytes()]
            assert u in held and len(held) <= buffers, (u, held)
            delta = torch.randn(sizes[u], generator=gen)
            for t in [masters[u], *(state[k][u] for k in state)]:
                t.add_(delta)
            if step == 2 and u == 3:
                break  # a consumer that stops early (an error): every transfer ends, unit 3's update is dropped
            for r in ref[u]:
                r.add_(delta)
        if step == 0:  # the first pass read the masters and exp_avg_sq only: exp_avg was zero-filled
            assert off.counters["bytes_read"] == 4 * 2 * sum(sizes)
    assert off.peak_resident <= buffers
    assert all(m.untyped_storage().nbytes() == 0 for m in masters)
    with off.resident(units, write=False):
        for u in range(len(units)):
            for t, r in zip([masters[u], *(state[k][u] for k in state)], ref[u]):
                assert torch.equal(t, r), u
    off.close()
    assert not list((tmp_path / "zeropp-swap").glob("*")), "close() left swap files"
