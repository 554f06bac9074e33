"""Units kept whole at stage 3 (``zeropp.engine.reuse``): persistent units and reuse distance change which
gathers happen, never a value. On 4 gloo ranks (2 emulated nodes of 2), exact and with full ZeRO++ (qwZ, hpZ, qgZ
with error feedback), the tiny GPT (units: root, blocks.0, blocks.1, each under 10^5 elements) trains 4 steps with

* ``every``: no persistent unit, reuse distance 0: the root and both blocks gathered in forward, both blocks again
  in backward (5 all-gathers per step, the behaviour before these keys existed);
* ``last``: distance 1: blocks.1 (the last unit, distance 0) is kept whole for its backward: 3 + 1;
* ``reuse``: DeepSpeed's distance (1e9): from the second step on (the first has no learned order), no backward
  gather at all: 3 + 0;
* ``live``: distance 1e9 but ``stage3_max_live_parameters`` = root + one block: only blocks.1 kept: 3 + 1;
* ``default``: DeepSpeed's defaults: every unit is under the persistence threshold (1e5), so ONE bucketed
  all-gather at the start of each forward brings all three, moving exactly the bytes of the three separate gathers
  of ``every``'s forward, and backward gathers nothing: 1 + 0.

Every run's losses and final fp32 masters are bit-identical to ``every``'s, and every unit is released by each
optimizer step (its weights change).
"""

from __future__ import annotations

import pytest
import torch
from engine_launch import launch_cases

EVERY = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
FULL = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
        "zeropp": {"error_feedback": True}}


ZEROS = {"exact": {}, "zeropp": FULL}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Both ``ZEROS`` in one launch, after one launch probing the units' sizes under each."""
    tmp = tmp_path_factory.mktemp("reuse")
    env = {"ZEROPP_RANKS_PER_NODE": "2"}
    by_zero = {name: {"zero": zero} for name, zero in ZEROS.items()}
    probes = launch_cases("reuse_workers:reuse_runs", 4, tmp / "probe", by_zero, env=env, runs={"every": EVERY}, steps=1)
    cases = {}
    for name, zero in ZEROS.items():
        probe = probes[name][0]["every"]["numel"]
        assert all(n < 100_000 for n in probe.values())
        runs = {
            "every": EVERY,
            "last": {**EVERY, "stage3_max_reuse_distance": 1},
            "reuse": {"stage3_param_persistence_threshold": 0},
            "live": {"stage3_param_persistence_threshold": 0,
                     "stage3_max_live_parameters": probe[""] + probe["blocks.1"]},
            "default": {},
        }
        cases[name] = {"zero": zero, "runs": runs}
    return launch_cases("reuse_workers:reuse_runs", 4, tmp, cases, env=env, timeout=300)


@pytest.mark.parametrize("zero", list(ZEROS))
def test_kept_units_are_not_gathered_again(results, zero) -> None:
    for res in results[zero]:
        every = res["every"]
        for name, run in res.items():
            assert run["losses"] == every["losses"], name
            for key, want in every["masters"].items():
                assert torch.equal(run["masters"][key], want), (name, key)

        def calls(name: str, res: dict = res) -> list[list[int]]:
            return [[c for c, _ in step] for step in res[name]["phases"]]

        assert calls("every") == [[3, 2, 0]] * 4
        assert calls("last") == [[3, 2, 0]] + [[3, 1, 0]] * 3
        assert calls("reuse") == [[3, 2, 0]] + [[3, 0, 0]] * 3
        assert calls("live") == [[3, 2, 0]] + [[3, 1, 0]] * 3
        assert calls("default") == [[1, 0, 0]] * 4
        assert res["default"]["persistent"] == ["", "blocks.0", "blocks.1"]
        assert all(run["persistent"] == [] for name, run in res.items() if name != "default")
        fwd_bytes = [step[0][1] for step in every["phases"]]
        assert [step[0][1] for step in res["default"]["phases"]] == fwd_bytes
        # whole between forward and backward: the root always; the kept units; all three when persistent
        assert every["whole"] == [[""]] * 4
        assert res["last"]["whole"] == [[""]] + [["", "blocks.1"]] * 3
        assert res["reuse"]["whole"] == [[""]] + [["", "blocks.0", "blocks.1"]] * 3
        assert res["live"]["whole"] == [[""]] + [["", "blocks.1"]] * 3
        assert res["default"]["whole"] == [["", "blocks.0", "blocks.1"]] * 4
