"""Issue 24's settings in combination (``combos_workers``): stages 1-3 x fp32/bf16 at world 2 (2 emulated nodes of
1), 4 (2 of 2, hpZ 2) and 8 (2 of 4, hpZ 2), one launch per world size. Each world runs three ``(stage, dtype)``
cells (``CELLS``: every pair in some world, stage 3 in both dtypes with hpZ); each cell its exact ZeRO run (AdamW,
the tiny GPT, one sample per rank) and the settings of ``combos_workers.settings`` against it:

* ``exact-rules`` (qwZ, qgZ, hpZ on, one rule making everything exact): the reference bit for bit (first reduced
  gradient, losses, masters);
* ``zeropp24`` (rules: exact embeddings and norms, int4/int8 MLPs, int2 attention gradients; int8 inside the node;
  the Hadamard rotation with error feedback; at stage 3 qwZ, hpZ and int4 weight deltas) and ``deltas-one-node``
  (world 2: deltas on a topology of one node of 2): the first reduced gradient of each parameter within its
  format's bound of the reference's (``_grad_bound``: relative 2-norm; exact-ruled parameters within float32
  rounding at stages 1-2), the losses within ``LOSS_BOUND``;
* ``onebit`` (OneBitAdam, ``freeze_step`` 1, at stage 3 with qwZ, hpZ and weight deltas): its warmup step's reduced
  gradient as the reference's (up to the summation order of its block-aligned layout); no loss bound: a variance
  frozen after one step makes the compressed steps large (docs/onebit.md, "Measured");
* weight deltas (wherever on): after every step the secondaries equal the owners' reconstructions bit for bit and
  each reconstruction is within half an int4 step of its delta's block (``combos_workers.delta_error`` < 1);
* every case ends with a NaN in the last rank's gradient: skipped on every rank, masters, compute shards, optimizer
  state, 1-bit momenta and errors, secondaries and reconstructions untouched bit for bit, qgZ residuals finite;
* world 4: checkpoints across settings (``combos_workers.checkpoints``: weight deltas on/off both ways, rotation on
  -> off, rules -> none, OneBitAdam saved before and after ``freeze_step`` and resumed bit for bit);
* worlds 4 and 8: 1-bit Adam at stage 3 with hpZ (and qwZ at world 4) against the float64 reference of
  docs/onebit.md (``test_onebit._check_reference``), its warmup AdamW's bit for bit on the same layout.

Cost (user + sys CPU of pytest and all ranks, measured at load average 70-110): world 2 20 s, world 4 38 s,
world 8 58 s; on an idle 2-core machine about half that in wall time for worlds 4 and 8.
"""

from __future__ import annotations

import pytest
from engine_launch import launch
from test_onebit import _check_reference

CELLS = {  # world -> (stage, dtype) cells: every pair in some world, stage 3 in both dtypes with hpZ
    2: [(1, "fp32"), (2, "bf16"), (3, "bf16")],
    4: [(1, "bf16"), (2, "fp32"), (3, "fp32")],
    8: [(1, "fp32"), (2, "bf16"), (3, "bf16")],
}
RANKS_PER_NODE = {2: 1, 4: 2, 8: 4}
HPZ = {2: 1, 4: 2, 8: 2}
# relative 2-norm error of the first reduced gradient, by the parameter's format in ``zeropp24``: int2 across nodes
# (attention; measured up to 0.74), int4 (wpe; 0.16) or int8 with int4 weights in the forward (MLPs); at stage 3 the
# exact-ruled ones see the other parameters' quantized weights in the forward (0.10-0.18)
INT2, INT4 = 0.85, 0.3
LOSS_BOUND = {"zeropp24": 0.06, "deltas-one-node": 0.02}  # relative, at every step (measured: 0.045, 0.001)


def _grad_bound(setting: str, stage: int, name: str) -> float:
    if setting == "onebit":  # its first step is the warmup's exact AdamW; at stage 3 with qwZ's int8 weights
        return 0.1 if stage == 3 else 1e-5  # (its units are block-aligned: another summation order)
    if setting == "deltas-one-node":
        return INT4
    if name.startswith("wte.") or "ln_" in name:  # exact rules: exact weights in the first forward at stages 1-2
        return INT4 if stage == 3 else 1e-5
    return INT2 if ".attn." in name else INT4


@pytest.mark.parametrize("world", [2, 4, 8])
def test_combinations(tmp_path, world):
    kwargs = {"path": str(tmp_path / "ckpt")} if world == 4 else {}
    if world > 2:
        kwargs["onebit_qwz"] = world == 4
    results = launch("combos_workers:all_cases", world, tmp_path, timeout=1800,
                     env={"ZEROPP_RANKS_PER_NODE": str(RANKS_PER_NODE[world])}, hpz=HPZ[world], cells=CELLS[world],
                     **kwargs)
    res = results[0]
    for r in results:
        assert all(r["checkpoints"].values()), r["checkpoints"]
    assert bool(res["checkpoints"]) == (world == 4)
    for case, got in res["matrix"].items():
        setting, stage = case.split("/")[0], int(case.split("/")[1][1])
        if setting == "exact-rules":
            assert got["identical"], case
            continue
        for name, err in got["grad_error"].items():
            assert err <= _grad_bound(setting, stage, name), (case, name, err)
        if setting in LOSS_BOUND:
            assert got["loss_error"] <= LOSS_BOUND[setting], (case, got["loss_error"])
        # weight deltas: within the bound after every step (stage 3, hpZ or one node)
        with_deltas = setting == "deltas-one-node" or stage == 3 and HPZ[world] > 1 and setting != "exact-rules"
        assert bool(got["deltas"]) == with_deltas, case
        assert all(e < 1 for e in got["deltas"]), (case, got["deltas"])
    if world > 2:
        case = res["onebit"]
        assert case["warmup_equal"] == [True] * 2  # on the same layout (combos_workers.onebit)
        _check_reference(case, world, 2, f"onebit-{world}")
