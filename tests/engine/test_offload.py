"""The offload tiers (``zeropp.engine.offload``, DeepSpeed's ``offload_optimizer``; ``zeropp.engine.param_offload``,
``offload_param``) change where the fp32 masters, gradient shards, Adam states and compute shards live, never a
value.

On 4 gloo ranks as 2 emulated nodes of 2, the tiny GPT trains 3 steps per case with the optimizer's side on the
device (``none``, the reference), on the CPU (``cpu``: on this CPU-only machine the same memory as ``none``; the
host-device copies run in the CUDA tests), and on NVMe swap files under pytest's tmp dir (``nvme``: pipelined reads
and writes with 4 buffers; ``nvme_sync``: neither pipelined, one buffer, so every unit is read and written alone;
at stage 3, ``cpu_ratio``: ``ratio`` 0.5, half the units' optimizer side on the host, ``nvme_param_cpu``: with
``offload_param: cpu`` too, the compute shards in host memory, ``param_nvme``: every compute shard (trainable and
frozen) in NVMe swap files, 4 buffers, read ahead by the prefetcher, and ``nvme_param_nvme``: the optimizer's side
and the shards past ``max_in_cpu`` on NVMe, one buffer of fewer elements than a shard (chunked), no read-ahead); and ``budget``: ``memory_budget`` with NVMe allowed,
sized so that the first step's placement keeps the root unit in memory and the blocks on NVMe; the placement
reported must be the rule's (``zeropp.engine.placement.place``) and what the engine holds, and a checkpoint saved
with it loads back exactly).
Cases: stages 1, 2 and 3; fp32, bf16 and fp16 (loss scaling); gradient accumulation 2; clipping; a frozen block;
full ZeRO++ (qwZ, qgZ, hpZ); meta-device init (``zeropp.Init``); a NaN gradient on one rank (the step skipped, as
without offload); and at world size 1, stage 3 in bf16. Every run's losses and final fp32 masters are bit-identical
to ``none``'s; NVMe runs hold one swap file per unit and state kind (per swapped shard), release the masters',
states' (shards') memory between steps (from the end of ``initialize``: never more than ``buffer_count`` units' in
memory at once, construction included; uses: at most ``buffer_count`` shards hold memory at any module's forward),
and delete the files at ``destroy()``.

Checkpoints: a 4-rank run with the optimizer's side and the compute shards on NVMe saves, then every tier loads it at
4 and at 2 ranks and continues: the loaded masters equal the saved ones, and at 4 ranks the continued losses and
masters equal the saving run's own continuation; a checkpoint saved without parameter offload right after such a
load loads into a run with the shards on NVMe the same way; a budget run, its units then in memory and on NVMe,
saves and loads back its own masters exactly. The NVMe save reads each parameter's piece from the swap files as DCP
writes it (no unit held in memory); the NVMe load holds ``buffer_count`` units at a time.

Faults: a swap file of one rank corrupted, truncated or deleted between steps: the next step raises
``OffloadError`` on every rank (naming the failing rank; for the optimizer's files its message, which names the file,
on every rank), and any later use of the engine raises too; a corrupted parameter-shard swap file: the same from the
next step, or from the next forward under ``torch.no_grad()``; corrupted before a checkpoint load into the engine:
``CheckpointError`` on every rank, the engine refuses to go on, and a new engine loads the checkpoint; one rank's
``nvme_path`` missing: ``initialize`` raises on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_launch import launch, launch_cases

NODES = {"ZEROPP_RANKS_PER_NODE": "2"}
BUDGET = 450_000  # bytes per rank: the tiny GPT's root unit in memory, its blocks on NVMe (not all: frozen)
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
    "param_nvme": {"offload_param": {"device": "nvme", "nvme_path": "{nvme}", "max_in_cpu": 0, "buffer_count": 4,
                                     "pin_memory": False},
                   "stage3_param_persistence_threshold": 0},
    "nvme_param_nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "pin_memory": False},
                        "offload_param": {"device": "nvme", "nvme_path": "{nvme}", "max_in_cpu": 20_000,
                                          "buffer_count": 1, "buffer_size": 1000, "pin_memory": False},
                        "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
    "budget": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "buffer_count": 1, "pin_memory": False},
               "zeropp": {"memory_budget": {"device": BUDGET, "cpu": BUDGET + 1}}},
}
PARAM_NVME = ("param_nvme", "nvme_param_nvme")
CASES = {
    "stage1_fp32_nan": {"zero": {"stage": 1}, "spoil": 1},
    "stage2_bf16_clip": {"zero": {"stage": 2}, "dtype": "bf16", "clipping": 0.5},
    "stage3_fp16_accum": {"zero": {"stage": 3}, "dtype": "fp16", "accumulation": 2,
                          "only": [r for r in RUNS if r not in PARAM_NVME]},
    "stage3_zeropp_frozen_meta": {"zero": {"stage": 3, **FULL}, "dtype": "bf16", "frozen": True, "clipping": 1.0,
                                  "meta": True},
    "stage3_fp32_param_nvme": {"zero": {"stage": 3}, "only": ["none", *PARAM_NVME]},
}
WORLD1 = {"stage3_bf16_world1": {"zero": {"stage": 3}, "dtype": "bf16", "clipping": 1.0, "spoil": 2,
                                  "only": [r for r in RUNS if r not in (*PARAM_NVME, "budget")]}}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [4, 1])
def test_every_tier_trains_bit_identically(tmp_path, world) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cases = CASES if world == 4 else WORLD1
    results = launch("offload_workers:tiers", world, tmp_path, env=NODES if world == 4 else {}, timeout=600,
                     cases=cases, runs=RUNS, nvme=str(nvme))
    for rank, res in enumerate(results):
        for case, runs in res.items():
            stage3 = cases[case]["zero"]["stage"] == 3
            stage3_runs = {"cpu_ratio", "nvme_param_cpu", *PARAM_NVME}
            want = [r for r in cases[case].get("only", RUNS) if stage3 or r not in stage3_runs]
            assert list(runs) == want, (case, list(runs))
            ref = runs["none"]
            assert len(ref["losses"]) == 3 * cases[case].get("accumulation", 1)
            if "spoil" in cases[case]:  # the NaN step was skipped, here as without offload
                assert ref["skipped"] >= 1, case
            for name, run in runs.items():
                assert run["losses"] == ref["losses"], (rank, case, name)
                assert _same(run["masters"], ref["masters"]), (rank, case, name)
                assert run["skipped"] == ref["skipped"], (rank, case, name)
                if name.startswith("nvme") or name == "budget":  # files "<index>-unit<u>.<kind>.swap"
                    assert _regions(run["files"]) == _swapped(run["stepped"]), run["files"]
                    assert run["released"], (case, name)
                    assert 0 < run["peak"][0] <= run["peak"][1], (case, name, run["peak"])
                    assert not run["left"], "destroy() left the swap directory"
                if name == "budget":
                    _check_budget(run, case, rank)
                if name in PARAM_NVME:
                    _check_param_swap(RUNS[name]["offload_param"], run, case, name)
    # the masters moved: the comparison is not of untouched weights
    first = results[0][next(iter(cases))]["none"]
    assert first["losses"][-1] < first["losses"][0]
    assert not list((nvme / "zeropp-swap").glob("*-rank*")), "swap directories left behind"


def _regions(files: list[str]) -> set[str]:
    return {f.split("-", 1)[1].rsplit(".", 1)[0] for f in files}


def _swapped(units: list[int]) -> set[str]:
    return {f"unit{u}.{kind}" for u in units for kind in ("master", "exp_avg", "exp_avg_sq")}


def _check_budget(run: dict, case: str, rank: int) -> None:
    """The placement the engine reported is the rule's for the units' sizes and the budget (the smaller of the two:
    on this CPU-only machine the device is host memory), fits it, mixes memory and NVMe (not with a frozen block:
    its units then all fit in memory), and is what the engine holds: swap files and released storage for the NVMe
    units only."""
    from zeropp.engine.placement import UnitStates, place

    chosen = run["placement"]
    assert chosen is not None, (case, "no placement after the first step")
    units = [UnitStates(*size) for size in chosen["sizes"]]
    room = BUDGET - chosen["fixed"].get("device", 0)
    assert chosen["room"] == {"device": room}
    assert chosen["tiers"] == list(place(units, farthest="nvme", room={"device": room}, buffer_count=1, shared=True))
    assert chosen["offload_tiers"] == chosen["tiers"]
    assert chosen["used"]["device"] <= room and chosen["used"]["cpu"] == 0
    nvme = [u for u, t in enumerate(chosen["tiers"]) if t == "nvme"]
    if not CASES[case].get("frozen"):
        assert "device" in chosen["tiers"] and nvme, (case, chosen)
    stepped = [u for u in nvme if chosen["sizes"][u][0]]
    assert _regions(run["files_after"]) == _swapped(stepped), (rank, case, run["files_after"])
    assert run["swapped_out"] == stepped, (rank, case)
    assert _same(run["reloaded"], run["masters"]), (rank, case)  # saved with that placement, loaded back exactly


def _check_param_swap(keys: dict, run: dict, case: str, name: str) -> None:
    """The shards past ``max_in_cpu`` (the first ones, in unit order, up to that many elements stay) have a swap
    file each, hold no memory after the steps and at most ``buffer_count`` at any forward; reads were made (ahead
    of the gathers when the buffers allow)."""
    kept, swapped = 0, set()
    for u, kind, numel in run["shards"]:
        if numel and (swapped or kept + numel > keys["max_in_cpu"]):
            swapped.add(f"unit{u}.{kind}")
        else:
            kept += numel
    assert swapped and (kept > 0) == (keys["max_in_cpu"] > 0), (case, name, run["shards"])  # both kinds of home
    assert {f.split("-", 1)[1].rsplit(".", 1)[0] for f in run["param_files"]} == swapped, run["param_files"]
    assert run["param_released"], (case, name)
    assert run["most_resident"] <= keys["buffer_count"], (case, name, run["most_resident"])
    assert run["param_read"] > 0, (case, name)
    assert (run["reads_ahead"] > 0) == (keys["buffer_count"] > 2), (case, name, run["reads_ahead"])
    assert not run["left"], "destroy() left the parameter swap directory"


def test_checkpoints_load_across_tiers_and_world_sizes(tmp_path) -> None:
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    saved = launch("offload_workers:checkpoint_across_tiers", 4, tmp_path, env=NODES, timeout=300, nvme=str(nvme),
                   save_dir=str(ckpt), phase="save")
    loaded4 = launch("offload_workers:checkpoint_across_tiers", 4, tmp_path, env=NODES, timeout=300, nvme=str(nvme),
                     save_dir=str(ckpt), phase="load")
    loaded2 = launch("offload_workers:checkpoint_across_tiers", 2, tmp_path, timeout=300, nvme=str(nvme),
                     save_dir=str(ckpt), phase="load")
    for want in saved:  # the save read each parameter's piece from the swap files, holding no unit in memory
        assert want["held"] == 0 and 0 < want["read"] <= want["state_bytes"], want
    for res in loaded4 + loaded2:  # the load held buffer_count (2) units at a time
        assert res["nvme"]["held"] == 2 < saved[0]["units"], res["nvme"]["held"]
    for want, res in zip(saved, loaded4):  # losses are each rank's own micro-batch's
        for name, run in res.items():
            assert _same(run["loaded"], want["saved"]), name
            assert run["losses"] == want["losses"], name
            assert _same(run["masters"], want["masters"]), name
    for res in loaded2:
        for name, run in res.items():
            assert _same(run["loaded"], saved[0]["saved"]), name
        assert res["none"]["losses"] == res["nvme"]["losses"] == res["cpu"]["losses"] == res["budget"]["losses"]
        assert res["none"]["losses"] == res["param_nvme"]["losses"]
        for name in ("nvme", "budget", "param_nvme"):
            assert _same(res["none"]["masters"], res[name]["masters"]), name
    for res in loaded4 + loaded2:  # the budget run saves and loads back its own masters exactly
        run = res["budget"]
        assert run["placement"]["tiers"], run["placement"]
        assert _same(run["reloaded"], run["masters"])


DAMAGED = [("optimizer", "corrupt", False), ("optimizer", "truncate", False), ("optimizer", "delete", False),
           ("param", "corrupt", False), ("param", "corrupt", True)]


@pytest.fixture(scope="module")
def swap_faults(tmp_path_factory) -> dict[str, list[dict]]:
    """Every damaged-swap-file case in one launch of 2 ranks, each on a fresh engine with swap files of its own:
    ``DAMAGED`` by index, and ``"load"`` (a file damaged before a checkpoint load)."""
    tmp = tmp_path_factory.mktemp("swap_faults")
    cases = {str(i): {"fault": fault, "tier": tier, "eval_forward": eval_forward}
             for i, (tier, fault, eval_forward) in enumerate(DAMAGED)}
    cases["load"] = {"fault": "corrupt", "during": "load", "save_dir": str(tmp / "ckpt")}
    for name, case in cases.items():
        case["nvme"] = str(tmp / f"nvme{name}")
        Path(case["nvme"]).mkdir()
    return launch_cases("offload_workers:swap_faults", 2, tmp, cases, timeout=600, victim=1)


@pytest.mark.parametrize("tier, fault, eval_forward", DAMAGED)
def test_a_damaged_swap_file_stops_every_rank(swap_faults, tier, fault, eval_forward) -> None:
    results = swap_faults[str(DAMAGED.index((tier, fault, eval_forward)))]
    said = ("failed reading or writing the NVMe offload's swap files on rank(s) [1]" if tier == "optimizer"
            else "reading or writing the NVMe parameter offload's swap files failed on rank(s) [1]")
    for rank, res in enumerate(results):
        assert res["step"] is not None, (rank, "the step after the damage went on")
        assert said in res["step"], res["step"]
        assert "load the last checkpoint" in res["step"]
        if tier == "optimizer":  # the cause, everywhere
            assert "(rank 1: " in res["step"] and "unit1.exp_avg" in res["step"], res["step"]
        assert res["later"] is not None and res["later"].startswith("this engine cannot go on"), res["later"]
    victim = results[1]["step"]
    assert "unit1.shard" in victim if tier == "param" else "(rank 1: " in victim, victim
    if tier == "param":
        assert res["step"].startswith("forward()" if eval_forward else "step 3"), res["step"]


def test_a_missing_nvme_path_on_one_rank_stops_every_rank_at_initialize(tmp_path) -> None:
    results = launch("offload_workers:swap_setup_fault", 2, tmp_path, timeout=300, nvme=str(tmp_path), victim=1)
    for message in results:
        assert message is not None and message.startswith(
            "setting up the engine failed reading or writing the NVMe offload's swap files on rank(s) [1] (rank 1: "
            "zero_optimization.offload_optimizer.nvme_path="), message
        assert "does not exist" in message and "mkdir -p" in message, message
    assert not list(tmp_path.glob("zeropp-swap/*")), "rank 0's swap files were left behind"


def test_a_swap_file_damaged_before_a_checkpoint_load_stops_every_rank(swap_faults) -> None:
    """The load reads each group of units from the swap files before loading into them: rank 1's corrupted file
    fails that read, and every rank raises (no rank waits in DCP's collectives); the engine refuses to go on, and
    the checkpoint stays loadable (a new engine loads the saved masters exactly)."""
    for rank, res in enumerate(swap_faults["load"]):
        assert res["kind"] == "CheckpointError" and res["step"].startswith("loading checkpoint"), res["step"]
        assert "on rank 1" in res["step"] and "CRC-32C" in res["step"], res["step"]
        assert res["later"] is not None and res["later"].startswith("this engine cannot go on"), res["later"]
        assert _same(res["reloaded"], res["saved"])


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


def test_a_rank_killed_during_a_write_behind(tmp_path) -> None:
    """Rank 1 is killed (SIGKILL) while its step's NVMe writes are in flight: rank 0's step raises an
    ``OffloadError`` that says the ranks could not agree and what to do (no hang, no step returned as if done), the
    checkpoint saved before loads in a new 2-rank job with the saved masters exactly, and the next swap space made
    on that disk warns about the dead rank's files."""
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    survivor, victim = launch("offload_workers:killed_during_write", 2, tmp_path, timeout=300, nvme=str(nvme),
                              save_dir=str(ckpt), victim=1)
    assert victim == {"killed": True}
    kind, message = survivor["raised"]
    assert kind == "OffloadError", (kind, message)
    assert "could not agree" in message and "load the last checkpoint" in message, message
    reloaded = launch("offload_workers:load_masters", 2, tmp_path, timeout=300, save_dir=str(ckpt))
    for masters in reloaded:
        assert _same(masters, survivor["saved"])
    from zeropp.offload import SwapSpace

    left = sorted(p.name for p in (nvme / "zeropp-swap").iterdir())  # the killed rank's files stay; the next swap
    assert len(left) == 1 and left[0].endswith("-rank1"), left  # space on that disk says so
    with pytest.warns(RuntimeWarning, match=r"1 swap directory of processes that no longer run .*-rank1"):
        SwapSpace(nvme, {"x": 4096}).close()
