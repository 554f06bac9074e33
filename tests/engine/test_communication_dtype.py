"""``communication_data_type`` (issue 11): the dtype of the exact gradient reduce-scatter, on 4 gloo ranks as 2
emulated nodes of 2 (one launched job, ``reduce_dtype_workers``).

* bf16 compute, default (the compute dtype, DeepSpeed's default) or ``"bf16"``: every unit's fp32 gradient shard
  after one backward is *bit-identical* to the float64 mean of the 4 ranks' bf16 gradients rounded once to fp32 —
  the sum of four bf16 values is exact in float64 (8 significant bits each), so the bf16 wire loses nothing — and
  it sends half the cross-node bytes of the fp32 wire.
* fp32 compute (default), and bf16 compute with ``"fp32"``: bit-identical to gloo's fp32 reduce-scatter of the
  (upcast) gradients divided by 4, the path every run took before the option existed.
* fp16 wire at the range's ends: 4 x 60000 (the sum overflows fp16) averages to exactly 60000 and 4 x 2^-24 (fp16's
  smallest subnormal, which a division before the sum would flush to zero) to exactly 2^-24: the sum happens
  after the wire, in float64, and the division after the sum.
"""

from __future__ import annotations

from engine_launch import launch

RUNS = {
    "bf16-default": {"bf16": True, "comm": None, "expect": "float64-mean"},
    "bf16-bf16": {"bf16": True, "comm": "bf16", "expect": "float64-mean"},
    "bf16-fp32": {"bf16": True, "comm": "fp32", "expect": "gloo-fp32"},
    "fp32-default": {"bf16": False, "comm": None, "expect": "gloo-fp32"},
}


def test_communication_data_type(tmp_path) -> None:
    env = {"ZEROPP_RANKS_PER_NODE": "2"}
    results = launch("reduce_dtype_workers:gradient_shards", 4, tmp_path, env=env, timeout=180, runs=RUNS)
    for res in results:
        assert res["bf16-default"]["worst"] <= 2.0**-24  # one rounding to fp32 of values below 1 in magnitude
        assert res["bf16-default"]["sent_inter"] * 2 == res["bf16-fp32"]["sent_inter"] > 0
        assert res["bf16-bf16"] == res["bf16-default"]
        assert res["fp32-default"]["sent_inter"] == res["bf16-fp32"]["sent_inter"]
    ranges = launch("reduce_dtype_workers:fp16_range", 4, tmp_path / "fp16", env=env)
    for res in ranges:
        assert res["big"] == [60000.0] * 4
        assert res["tiny"] == [2.0**-24] * 4
