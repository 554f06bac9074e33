"""qgZ's options on 4 real gloo processes (2 emulated nodes of 2), one launch (``qgz_options_workers.options``):

* stochastic rounding (``reduce_scatter(seed=)``): the bytes of the spec's composition, reproducible, unbiased;
* LoCo's 8-bit error feedback (``ErrorFeedback("loco", beta)``): the residuals follow a float64 run of the
  recurrence, take ``1 + 4 / block`` bytes per element, and keep the accumulated error as low as fp32 feedback.
"""

from __future__ import annotations

from comm_launch import launch

BLOCK = 64


def test_stochastic_rounding_and_loco(tmp_path):
    results = launch("qgz_options_workers:options", 4, tmp_path, timeout=300, seeds=64, steps=4, beta=0.5,
                     env={"ZEROPP_QUANT_BACKEND": "native"})
    for res in results:
        r = res["rounding"]
        # the mean over 64 seeds is within its bound; round to nearest keeps its whole error whatever the seed
        assert r["stochastic_mean"] <= r["bound"] * 1.5, r
        assert r["stochastic_mean"] < 0.3 * r["nearest"], r
        lo = res["loco"]
        # fp32 residuals take 4 bytes per element (LoCo's 1 + 4 / 64 is asserted in the worker)
        assert lo["fp32_bytes"] == 4 * (3 * BLOCK * 4 + 2 * 3 * BLOCK), lo
        # 16 reductions of one gradient: without feedback the error adds up; LoCo's 8-bit residuals keep it about
        # as low as float32 ones
        assert lo["loco"] * 4 < lo["plain"] and lo["loco"] < 1.5 * lo["fp32"] + 0.01, lo
