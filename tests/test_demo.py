"""The demo: it runs on a tiny model, and the numbers it reports agree with an independent float64 computation."""

import numpy as np
import pytest
import torch

from zeropp import demo
from zeropp.models import GPT, GPTConfig


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    # conftest turns the Triton interpreter on for CPU runs; the demo's numbers are checked on the reference.
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")


def numpy_block_quantize(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, int]:
    """Independent block quantization: returns the dequantized values (float32) and the packed byte count."""
    qmax = 2 ** (bits - 1) - 1
    n = w.size
    blocks = -(-n // block)
    x = np.zeros(blocks * block, dtype=np.float32)
    x[:n] = w.reshape(-1)
    x = x.reshape(blocks, block)
    scale = (np.abs(x).max(axis=1) / np.float32(qmax)).astype(np.float32)
    r = np.float32(1) / np.where(scale > 0, scale, np.float32(1)).astype(np.float32)  # normal scales here
    codes = np.clip(np.round(x.astype(np.float64) * r[:, None]), -qmax, qmax)  # exact product; half to even
    deq = (codes.astype(np.float32) * scale[:, None]).reshape(-1)[:n]
    return deq, blocks * (block * bits // 8 + 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reported_errors_match_float64(dtype):
    bits, block_sizes = (8, 4), (32, 256)
    model, results = demo.run("tiny", bits, block_sizes, dtype=dtype, seed=3, progress=False)
    assert [(r.bits, r.block_size) for r in results] == [(b, s) for b in bits for s in block_sizes]

    # Rebuild the weights independently: same preset and seed, each distinct parameter once.
    fresh = GPT(GPTConfig.preset("tiny"), seed=3)
    weights = [p.detach().to(dtype).float().numpy().astype(np.float64) for p in fresh.parameters()]
    assert sum(w.size for w in weights) == fresh.num_params() == results[0].numel
    for r in results:
        err_sq = ref_sq = max_abs = 0.0
        packed = 0
        for w in weights:
            deq, nbytes = numpy_block_quantize(w.astype(np.float32), r.bits, r.block_size)
            d = w.reshape(-1) - deq.astype(np.float64)
            err_sq += float(np.dot(d, d))
            ref_sq += float(np.dot(w.reshape(-1), w.reshape(-1)))
            max_abs = max(max_abs, float(np.abs(d).max()))
            packed += nbytes
        assert r.tensors == len(weights)
        assert r.packed_bytes == packed
        assert r.ratio == pytest.approx(2 * r.numel / packed)
        assert r.rel_l2 == pytest.approx(np.sqrt(err_sq / ref_sq), rel=1e-9)
        assert r.max_abs == pytest.approx(max_abs, rel=1e-6)
        assert r.backend == "torch" and r.seconds > 0
    # Sanity of the magnitudes: int4 is much worse than int8, smaller blocks are no worse.
    by = {(r.bits, r.block_size): r.rel_l2 for r in results}
    assert by[8, 256] < 0.02 < by[4, 256] < 0.3
    assert by[8, 32] <= by[8, 256] and by[4, 32] <= by[4, 256]


def test_main_prints_a_table(capsys):
    assert demo.main(["--preset", "tiny", "--bits", "8", "4", "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "tiny (120,576 parameters" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("int")]
    assert [(r[0], r[1]) for r in rows] == [("int8", "64"), ("int4", "64")]
    assert all(r[-1] == "torch" for r in rows)


def test_main_rejects_a_bad_block_size(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--preset", "tiny", "--block-size", "100"])
    assert "power of two" in capsys.readouterr().err


def test_progress_bar_draws_on_a_terminal():
    class Tty:
        text = ""

        def isatty(self):
            return True

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    stream = Tty()
    bar = demo.Progress(10, "work", stream=stream)
    bar.update(10)
    bar.close()
    assert "100%" in stream.text and stream.text.endswith("\r")
