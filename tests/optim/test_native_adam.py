"""``zeropp.optim.native.adam_step`` against its spec, torch's fused CPU Adam/AdamW step plus ``out.copy_(param)``,
bit for bit, on fresh random inputs: every build of the native library (the default one, the one without AVX-512
kernels, the portable one), Adam and AdamW with and without weight decay, several steps (the bias correction
changes), varied hyperparameters, sizes with every tail, unaligned starts, 1 and 2 threads, each output dtype; the
probe's choice under torch's default (no-FMA) kernels; special values; argument checks.
"""

import os
import subprocess
import sys

import pytest
import torch
from torch.optim.adam import adam as torch_adam

from zeropp.optim import native

BUILDS = {"native": None, "native-avx2": "libzeropp_cpu_avx2.so", "native-baseline": "libzeropp_cpu_baseline.so"}

# (beta1, beta2, lr, eps): the usual ones, and ones with 1 - beta1 >= 0.5 (torch's lerp takes its other form).
HYPERPARAMETERS = [(0.9, 0.999, 1e-3, 1e-8), (0.3, 0.95, 0.07, 1e-6)]
SIZES = [1, 7, 16, 1023, 100003]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, None]


def load(build: str) -> native.Library:
    """The library build named (see ``BUILDS``); skips the test, naming what is missing, when it does not load
    (fails instead under ``ZEROPP_REQUIRE_NATIVE=1``)."""
    name = BUILDS[build]
    try:
        return native.Library(native.DEFAULT_PATH.with_name(name)) if name else native.library()
    except native.NativeLibraryError as e:
        if os.environ.get("ZEROPP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"ZEROPP_REQUIRE_NATIVE=1 but the native CPU library does not load: {e}")
        pytest.skip(f"native CPU library not built: {e}")


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request) -> native.Library:
    return load(request.param)


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def unaligned(values: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A contiguous copy of ``values`` starting at a random float offset in a larger buffer (not 64-byte aligned)."""
    offset = int(torch.randint(0, 16, (), generator=gen))
    buf = torch.empty(values.numel() + offset, dtype=values.dtype)
    out = buf[offset:]
    out.copy_(values)
    return out


def state(numel: int, gen: torch.Generator) -> list[torch.Tensor]:
    """param, exp_avg, exp_avg_sq as after some training: parameters around 1, moments of gradients around 1."""
    return [torch.randn(numel, generator=gen), 0.1 * torch.randn(numel, generator=gen),
            0.01 * torch.rand(numel, generator=gen)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    differ = (bits(actual) != bits(expected)).nonzero().flatten()
    assert differ.numel() == 0, (
        f"{what}: {differ.numel()} of {actual.numel()} elements differ, first at {differ[:5].tolist()}: "
        f"{actual[differ[:5]].tolist()} vs {expected[differ[:5]].tolist()}"
    )


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("hyper", HYPERPARAMETERS, ids=["beta1=0.9", "beta1=0.3"])
def test_bit_exact_with_torch_fused(lib, threads, decoupled, weight_decay, hyper):
    beta1, beta2, lr, eps = hyper
    gen = torch.Generator().manual_seed(1000 * threads + 100 * decoupled + int(1000 * (weight_decay + beta1)))
    for numel in SIZES:
        expected = state(numel, gen)
        ours = [unaligned(t, gen) for t in expected]
        state_step = torch.zeros((), dtype=torch.float32)
        for step, out_dtype in enumerate(OUT_DTYPES, start=1):
            grad = torch.randn(numel, generator=gen)
            torch_adam([expected[0]], [grad.clone()], [expected[1]], [expected[2]], [], [state_step], fused=True,
                       decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                       weight_decay=weight_decay, eps=eps, maximize=False)
            out = None if out_dtype is None else unaligned(torch.zeros(numel, dtype=out_dtype), gen)
            our_grad = unaligned(grad, gen)
            lib.adam_step(ours[0], our_grad, ours[1], ours[2], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay, decoupled=decoupled, out=out)
            where = f"numel {numel}, step {step}"
            for name, a, e in zip(("param", "exp_avg", "exp_avg_sq"), ours, expected):
                assert_bits_equal(a, e, f"{name}, {where}")
            assert_bits_equal(our_grad, grad, f"grad (read only), {where}")
            if out is not None:
                assert_bits_equal(out, expected[0].to(out_dtype), f"out {out_dtype}, {where}")


def test_module_function_runs_the_default_library():
    lib = load("native")
    gen = torch.Generator().manual_seed(5)
    param, exp_avg, exp_avg_sq = state(999, gen)
    grad, out = torch.randn(999, generator=gen), torch.empty(999, dtype=torch.bfloat16)
    mine = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    native.adam_step(param, grad, exp_avg, exp_avg_sq, step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.01, decoupled=True, out=out)
    lib.adam_step(mine[0], grad, mine[1], mine[2], step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01, decoupled=True)
    assert native.available() and native.unavailable_reason() is None
    for a, b in zip(mine, (param, exp_avg, exp_avg_sq)):
        assert_bits_equal(a, b, "module adam_step vs the library's")
    assert_bits_equal(out, param.to(torch.bfloat16), "out")


_DEFAULT_KERNELS_SCRIPT = """
import torch
from torch.optim.adam import adam
from zeropp.optim import native
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT", torch.backends.cpu.get_cpu_capability()
lib = native.library()
assert not lib.arithmetic.fma, lib.arithmetic
gen = torch.Generator().manual_seed(11)
for decoupled in (False, True):
    p, m, v, g = (torch.randn(1029, generator=gen) for _ in range(4))
    v = v.abs()
    ours = [t.clone() for t in (p, m, v)]
    step = torch.zeros(())
    for n in (1, 2):
        adam([p], [g], [m], [v], [], [step], fused=True, decoupled_weight_decay=decoupled, amsgrad=False, beta1=0.3,
             beta2=0.99, lr=0.01, weight_decay=0.1, eps=1e-8, maximize=False)
        lib.adam_step(ours[0], g, ours[1], ours[2], step=n, lr=0.01, beta1=0.3, beta2=0.99, eps=1e-8,
                      weight_decay=0.1, decoupled=decoupled)
    for a, b in zip(ours, (p, m, v)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
print("ok")
"""


def test_probe_finds_torch_default_kernels():
    """Under torch's default (no-FMA) kernels the library takes its FMA-free variant and still matches torch."""
    load("native")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    run = subprocess.run([sys.executable, "-c", _DEFAULT_KERNELS_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_special_values(lib):
    """Float16 overflow to Inf and bfloat16 ties round as .to() does; a NaN gradient makes NaNs, not garbage."""
    gen = torch.Generator().manual_seed(7)
    numel = 64
    param = torch.randn(numel, generator=gen) * 1e5
    param[:8] = torch.tensor([65504.0, 65519.0, 65520.0, -70000.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3e-8, -0.0])
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    grad = torch.zeros(numel)
    grad[10] = float("nan")
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    torch_adam([expected[0]], [grad.clone()], [expected[1]], [expected[2]], [], [torch.zeros(())], fused=True,
               decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.0,
               eps=1e-8, maximize=False)
    for dtype in (torch.float16, torch.bfloat16):
        ours = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
        out = torch.empty(numel, dtype=dtype)
        lib.adam_step(ours[0], grad, ours[1], ours[2], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0, decoupled=True, out=out)
        nan = expected[0].isnan()
        assert nan.tolist() == ours[0].isnan().tolist() == out.isnan().tolist() and nan[10]
        for a, e in zip(ours, expected):
            assert_bits_equal(a[~nan], e[~nan], "state outside the NaN")
        assert_bits_equal(out[~nan], expected[0][~nan].to(dtype), f"out {dtype}")
        if dtype == torch.float16:
            assert out[2:4].isinf().all()


def _args(numel: int = 10) -> dict:
    return dict(param=torch.zeros(numel), grad=torch.zeros(numel), exp_avg=torch.zeros(numel),
                exp_avg_sq=torch.zeros(numel))


BAD_CALLS = {
    "float64 param": (dict(param=torch.zeros(10, dtype=torch.float64)), {}, "param has dtype torch.float64"),
    "bf16 grad": (dict(grad=torch.zeros(10, dtype=torch.bfloat16)), {}, "grad has dtype torch.bfloat16"),
    "numel": (dict(exp_avg=torch.zeros(11)), {}, "exp_avg has 11 elements, param has 10"),
    "strided": (dict(exp_avg_sq=torch.zeros(20)[::2]), {}, "exp_avg_sq .* is not contiguous"),
    "out dtype": ({}, dict(out=torch.zeros(10, dtype=torch.int8)), "out has dtype torch.int8"),
    "out numel": ({}, dict(out=torch.zeros(9, dtype=torch.bfloat16)), "out has 9 elements"),
    "step 0": ({}, dict(step=0), "step must be an int >= 1"),
    "step float": ({}, dict(step=1.0), "step must be an int >= 1"),
    "beta1": ({}, dict(beta1=1.0), r"beta1=1.0 must be finite and in \[0, 1\)"),
    "lr": ({}, dict(lr=float("nan")), "lr=nan must be finite"),
    "eps": ({}, dict(eps=-1.0), "eps=-1.0 must be finite and >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_before_writing(case):
    lib = load("native")
    tensors, options, message = BAD_CALLS[case]
    args = {**_args(), **tensors}
    args["grad"] = args["grad"] + 1 if args["grad"].dtype == torch.float32 else args["grad"]
    before = {k: v.clone() for k, v in args.items()}
    kwargs = {**dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True), **options}
    with pytest.raises((ValueError, TypeError), match=message):
        lib.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **kwargs)
    for k, v in args.items():
        assert torch.equal(v, before[k]), f"{k} was written"


def test_shared_memory_is_refused():
    lib = load("native")
    buf = torch.zeros(30)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        lib.adam_step(buf[:10], torch.zeros(10), buf[10:20], buf[15:25], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=0.0, decoupled=True)
    with pytest.raises(ValueError, match="param and out share memory"):
        lib.adam_step(buf[:10], torch.zeros(10), buf[10:20], buf[20:], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                      eps=1e-8, weight_decay=0.0, decoupled=True, out=buf[:10])


def test_library_without_the_op_is_refused_with_the_fix(tmp_path):
    """A library of another build (here: not a library at all) is refused, saying how to rebuild."""
    fake = tmp_path / "libzeropp_cpu.so"
    fake.write_bytes(b"not a library")
    with pytest.raises(native.NativeLibraryError, match="rebuild it"):
        native.Library(fake)
    with pytest.raises(native.NativeLibraryError, match="does not exist"):
        native.Library(tmp_path / "missing.so")


def test_pieces_with_their_share_of_the_tail_equal_the_whole_tensor_step() -> None:
    """A tensor cut into pieces at random offsets, each stepped alone with ``tail_in_piece``: bit for bit torch's
    fused step on the whole tensor (without ``tail`` a piece's own last elements would round as a tail)."""
    if not native.available():
        pytest.skip(f"native CPU library not built: {native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for numel in (1, 7, 100, 1023, 4099):
        whole = [torch.randn(numel, generator=gen) for _ in range(2)] + [0.01 * torch.rand(numel, generator=gen)]
        grad = 10 * torch.randn(numel, generator=gen)
        ref = [t.clone() for t in whole]
        torch_adam([ref[0]], [grad], [ref[1]], [ref[2]], [], [torch.tensor(2.0)], fused=True,
                   decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.1,
                   eps=1e-8, maximize=False)
        cuts = sorted({0, numel, *torch.randint(0, numel + 1, (4,), generator=gen).tolist()})
        for a, b in zip(cuts, cuts[1:]):
            native.adam_step(whole[0][a:b], grad[a:b], whole[1][a:b], whole[2][a:b], step=3, lr=1e-2, beta1=0.9,
                             beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                             tail=native.tail_in_piece(a, b, numel))
        for got, want in zip(whole, ref):
            assert torch.equal(got, want), numel
