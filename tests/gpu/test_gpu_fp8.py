"""The FP8 forward on CuPy: quantize_fp8 and hadamard_rotate against their NumPy results, and the Hopper kernel
against the CPU path on the same FP8Tensors (NumPy copies). Needs a GPU (the kernel: compute capability 9.0):

    python -m pytest -m gpu tests/gpu/test_gpu_fp8.py

The kernel's error against float64 attention on the dequantized inputs may be at most twice the CPU path's
(which is the naive implementation of the same numerics: tests/cpu/test_fp8.py), plus one rounding of out.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_bitwise_equal, to_host
from helpers.gpu import nan_filled_allocations

import cupyflash
from cupyflash import FP8Tensor, hadamard_rotate, quantize_fp8, reference
from cupyflash._cuda import plans
from cupyflash._fp8.tensor import DECODE_TABLE, encode_e4m3

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
INPUT_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
OUT_ULP = {np.dtype(BF16): 2.0**-8, np.dtype(np.float16): 2.0**-11}  # half a unit in the last place
# The products q k^T come from FP8 tensor cores, whose accumulation keeps about 13 significant bits, not
# float32's 24: each 32-wide k-step's sum is aligned to the running sum and cut there. A score may then be
# off by a few 2^-13 of the sum of |q_d k_d| per k-step (D / 32 of them), and lse by its row's largest such
# error. Measured on an H200 (q = k, D = 128, rows scaled by e^U(-1, 1)): up to 2.2 of them per k-step, every
# cut in one direction where the products are all positive; bound with 4, plus float32 rounding.
ACCUMULATION_ULP = 2.0**-13
ACCUMULATION_CUTS = 4


def _compute_capability():
    return int(cupy.cuda.Device().compute_capability)


@pytest.fixture
def hopper():
    if _compute_capability() != 90:
        pytest.skip(f"the FP8 kernel needs compute capability 9.0; this device is {_compute_capability()}")


def _varied(rng, shape, dtype=np.float32):
    """Standard normal values times a random magnitude per row (so that row-block scales differ)."""
    x = rng.standard_normal(shape, dtype=np.float32) * np.exp(rng.uniform(-1, 1, shape[:-1] + (1,)))
    return x.astype(np.float32).astype(dtype)


def _on_host(x8):
    return FP8Tensor(x8.data.get(), x8.scale.get(), x8.block)


# ------------------------------------------------------------------------------------------ array code
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("block", [None, "tensor", 128, 256])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 77, 40), (2, 1000, 128), (1, 2, 300, 96)])
def test_quantize_on_cupy_is_numpy_bit_for_bit(rng, dtype, block, shape):
    x = _varied(rng, shape, INPUT_DTYPES[dtype])
    host = quantize_fp8(x, block=block)
    dev = quantize_fp8(cupy.asarray(x), block=block)
    assert isinstance(dev.data, cupy.ndarray) and isinstance(dev.scale, cupy.ndarray) and dev.block == host.block
    assert (dev.data.get() == host.data).all()
    assert (dev.scale.get().view(np.uint32) == host.scale.view(np.uint32)).all()
    for out_dtype in (np.float32, BF16, np.float64):
        assert (to_host(dev.dequantize(out_dtype)) == to_host(host.dequantize(out_dtype))).all()


@pytest.mark.parametrize("dtype", dict(INPUT_DTYPES, float64=np.float64))
@pytest.mark.parametrize("d", [1, 3, 64, 96, 128, 256])
def test_hadamard_rotate_on_cupy_is_numpy(rng, dtype, d):
    x = _varied(rng, (2, 3, 50, d), INPUT_DTYPES.get(dtype, np.float64))
    host = hadamard_rotate(x, seed=9)
    dev = hadamard_rotate(cupy.asarray(x), seed=9)
    assert isinstance(dev, cupy.ndarray) and dev.dtype == host.dtype
    # The same float32 (float64) operations; their roundings may differ by a unit, then one rounding to dtype.
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-22, "float64": 2.0**-50}[dtype]
    assert np.abs(to_host(dev) - to_host(host)).max() <= ulp * np.abs(to_host(host)).max()


# ------------------------------------------------------------------------------------------ the kernel
def _check_kernel(q8, k8, v8, *, causal, scale=None, out_dtype=None):
    """The kernel on CuPy holders against the CPU path on their NumPy copies."""
    out, lse = cupyflash.attention_forward(q8, k8, v8, causal=causal, scale=scale, out_dtype=out_dtype)
    hq, hk, hv = (_on_host(x) for x in (q8, k8, v8))
    cpu_out, cpu_lse = cupyflash.attention_forward(hq, hk, hv, causal=causal, scale=scale, out_dtype=out_dtype)
    assert isinstance(out, cupy.ndarray) and out.dtype == cpu_out.dtype and out.shape == cpu_out.shape
    assert lse.dtype == np.float32 and lse.shape == cpu_lse.shape
    ref = reference.attention(*(x.dequantize(np.float64) for x in (hq, hk, hv)), causal=causal, scale=scale)
    out64, cpu64 = to_host(out), to_host(cpu_out)
    slack = OUT_ULP[out.dtype]
    assert np.isfinite(out64).all()

    def max_abs(x):
        return float(np.abs(x).max(initial=0))

    def rms(x):
        return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0

    assert max_abs(out64 - ref) <= 2 * max_abs(cpu64 - ref) + slack * max_abs(ref)
    assert rms(out64 - ref) <= 2 * rms(cpu64 - ref) + slack * rms(ref)
    lse_host = lse.get()
    assert np.array_equal(np.isneginf(lse_host), np.isneginf(cpu_lse))
    finite = np.isfinite(cpu_lse)
    q64, k64 = (np.abs(x.dequantize(np.float64)) for x in (hq, hk))
    sums = (q64 @ np.swapaxes(k64, -1, -2)).max(axis=-1, initial=0) * (scale or q64.shape[-1] ** -0.5)
    steps = -(-q64.shape[-1] // 32)
    bound = ACCUMULATION_CUTS * steps * ACCUMULATION_ULP * np.broadcast_to(sums, cpu_lse.shape) + 1e-5 * (
        1 + np.abs(cpu_lse)
    )
    assert (np.abs(lse_host - cpu_lse)[finite] <= bound[finite]).all()
    blind = np.isneginf(cpu_lse)
    assert (out64[blind] == 0).all()


BLOCKS = (None, "tensor", 128, 256)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", [1, 200, 1024, 2000])
@pytest.mark.parametrize("d", [64, 128, 256, 80])
@pytest.mark.parametrize("block", [None, 128])
def test_kernel_matches_the_cpu_path(rng, hopper, d, n, causal, block):
    batch = (1, 2) if n >= 1024 else (2, 3)
    q8, k8, v8 = (quantize_fp8(cupy.asarray(_varied(rng, batch + (n, d))), block=block) for _ in range(3))
    _check_kernel(q8, k8, v8, causal=causal)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("nq, nk", [(1, 300), (200, 77), (300, 1024), (1024, 300), (513, 2000)])
def test_kernel_nq_not_nk_and_blocks(rng, hopper, block, nq, nk):
    shapes = [(2, 2, nq, 128), (2, 2, nk, 128), (2, 2, nk, 128)]
    q8, k8, v8 = (quantize_fp8(cupy.asarray(_varied(rng, s)), block=block) for s in shapes)
    for causal in (False, True):
        _check_kernel(q8, k8, v8, causal=causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kernel_gqa_mixed_scales_and_float16_out(rng, hopper, d):
    q8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 3, 300, d), ml_dtypes.bfloat16)), block=128)
    k8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 1, 700, d), np.float16)))
    v8 = quantize_fp8(cupy.asarray(_varied(rng, (1, 2, 1, 700, d))), block="tensor")
    for out_dtype in (None, np.float16):
        _check_kernel(q8, k8, v8, causal=True, out_dtype=out_dtype)
    _check_kernel(q8, k8, v8, causal=False, scale=0.05)


def test_kernel_empty_and_outliers(rng, hopper):
    e = quantize_fp8(cupy.zeros((2, 0, 64), np.float32))
    k8 = quantize_fp8(cupy.ones((2, 5, 64), np.float32))
    out, lse = cupyflash.attention_forward(e, k8, k8)
    assert out.shape == (2, 0, 64) and lse.shape == (2, 0)
    shape = (1, 4, 1024, 128)
    x = [rng.standard_normal(shape) + 10 * rng.standard_normal(shape) * (rng.random(shape) < 0.001) for _ in range(3)]
    q, k, v = (cupy.asarray(a.astype(np.float32)) for a in x)
    qr, kr = (hadamard_rotate(a, seed=1) for a in (q, k))
    _check_kernel(*(quantize_fp8(a, block=128) for a in (qr, kr, v)), causal=False)


def test_below_hopper_raises(rng):
    cc = _compute_capability()
    if cc == 90:
        pytest.skip(f"compute capability {cc}: the FP8 kernel runs here")
    q8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 10, 64))))
    message = (
        r"FP8 attention needs a Hopper GPU \(compute capability 9.0, FP8 wgmma\); "
        rf"this device is {cc // 10}\.{cc % 10}"
    )
    with pytest.raises(RuntimeError, match=message):
        cupyflash.attention(q8, q8, q8)


@pytest.mark.parametrize(
    "d, d_v, block", [(40, 33, 128), (80, 200, None), (256, 256, 128), (64, 64, 256), (17, 250, "tensor")]
)
def test_kernel_head_dims_and_descale_blocks(rng, hopper, d, d_v, block):
    """Head dims that are not the kernel's (q, k padded to 16 bytes; an odd Dv, stored in pairs), Dv != D, and
    several descale blocks per sequence where a key block is smaller than a descale block (D = 256: 64 keys)."""
    q8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 700, d))), block=block)
    k8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 900, d))), block=block)
    v8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 900, d_v))), block=block)
    for causal in (False, True):
        _check_kernel(q8, k8, v8, causal=causal)


def test_kernel_broadcast_over_four_batch_dims(rng, hopper):
    """Broadcast dims that do not merge into the kernels' three (V^T's pass then reads a contiguous copy)."""
    q8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 4, 3, 5, 130, 64))), block=128)
    k8, v8 = (quantize_fp8(cupy.asarray(_varied(rng, (2, 1, 3, 1, 260, 64))), block=128) for _ in range(2))
    _check_kernel(q8, k8, v8, causal=True)


def test_kernel_one_descale_with_a_huge_block(rng, hopper):
    """A block of any length past N is one descale per slice (the kernel's row count stays in range)."""
    x8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 300, 128))))
    huge = FP8Tensor(x8.data, x8.scale, 2**40)
    _check_kernel(huge, huge, huge, causal=False)


# ------------------------------------------------------------------------------------------ long sequences
def _last_rows(q8, k8, v8, rows, causal):
    """Over the last ``rows`` query rows (Nq = Nk), float64 on the GPU: attention of the dequantized inputs, and
    the FP8 algorithm with exact sums (the format's own error: e4m3 q, k, v, and P = 2^(c S - c max + 8) rounded
    to e4m3, l from P before its rounding)."""
    qd, kd, vd = (x.dequantize(np.float64) for x in (q8, k8, v8))
    n, d = qd.shape[-2], qd.shape[-1]
    s = qd[..., n - rows :, :] @ kd.swapaxes(-1, -2)
    if causal:
        s = cupy.where(cupy.arange(n)[None, :] > cupy.arange(n - rows, n)[:, None], -cupy.inf, s)
    s = (s - s.max(axis=-1, keepdims=True)) * (np.log2(np.e) / np.sqrt(d))
    p = cupy.exp2(s)
    exact = (p @ vd) / p.sum(axis=-1, keepdims=True)
    p = cupy.exp2(s + 8).astype(np.float32)
    p8 = cupy.asarray(DECODE_TABLE)[encode_e4m3(p)].astype(np.float64)
    return exact, (p8 @ vd) / p.astype(np.float64).sum(axis=-1, keepdims=True)


def _relative(x, ref):
    return float(cupy.linalg.norm((x - ref).ravel()) / cupy.linalg.norm(ref.ravel()))


@pytest.mark.parametrize("d, causal, v_mean", [(64, True, 0.5), (128, True, 0.5), (256, False, 0.5), (128, False, 0.0)])
def test_kernel_error_does_not_grow_with_the_keys(hopper, d, causal, v_mean):
    """65,536 keys and v with a mean, where accumulating P V in the FP8 tensor cores' own accumulator lost a
    third of out: the last rows (they see every key) against float64 attention of the dequantized inputs within
    5e-3, and within 1.5x the format's own error (the algorithm with exact sums) plus one bfloat16 rounding of
    out. The format's error sets the bound for a v of zero mean: about 2.6e-2 there (P's e4m3 rounding, averaged
    over many keys, against an out near 0)."""
    n, rows = 65536, 256
    rng = cupy.random.default_rng(d + 7 * causal)
    q, k, v = (rng.standard_normal((1, 2, n, d), dtype=np.float32) for _ in range(3))
    v += np.float32(v_mean)
    q8, k8, v8 = (quantize_fp8(x, block=128) for x in (q, k, v))
    with nan_filled_allocations():
        out, _ = cupyflash.attention_forward(q8, k8, v8, causal=causal)
    ref, emulated = _last_rows(q8, k8, v8, rows, causal)
    error, format_error = _relative(out[..., n - rows :, :].astype(np.float64), ref), _relative(emulated, ref)
    assert error <= 1.5 * format_error + OUT_ULP[np.dtype(BF16)], (error, format_error)
    if v_mean:
        assert error <= 5e-3, error


# ------------------------------------------------------------------------------------------ the fast path
def test_repeated_calls_take_the_kept_plan_and_inputs(rng, hopper):
    """A second call on the same holders takes the plan of the first (its call entry) and the arrays kept with the
    holders (V^T among them), with bitwise the same results; new holders of the same layout take the same plan
    and their own arrays; a broadcast (GQA) layout keeps its copies with the holders too."""
    q8 = quantize_fp8(cupy.asarray(_varied(rng, (2, 4, 300, 128))), block=128)
    k8, v8 = (quantize_fp8(cupy.asarray(_varied(rng, (2, 4, 500, 128)))) for _ in range(2))
    plans.clear()
    first = cupyflash.attention_forward(q8, k8, v8, causal=True)
    # v keeps its layout key, V^T and its descale table; the fast path then adds the two's addresses
    assert len(plans.entries("call", "fp8")) == 1
    assert set(v8._kept) == {"layout", ("values", (2, 4)), ("descales", (2, 4))}
    kept = dict(v8._kept)
    with nan_filled_allocations():
        again = cupyflash.attention_forward(q8, k8, v8, causal=True)
    assert len(plans.entries("call", "fp8")) == 1 and all(v8._kept[key] is kept[key] for key in kept)
    assert set(v8._kept) - set(kept) == {("value addresses", (2, 4))}
    assert_bitwise_equal(first, again, ("out", "lse"))
    other = [quantize_fp8(cupy.asarray(_varied(rng, x.shape))) for x in (k8, v8)]
    _check_kernel(q8, *other, causal=True)
    assert len(plans.entries("call", "fp8")) == 1
    q_gqa = quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 3, 200, 64))), block=128)
    k_gqa, v_gqa = (quantize_fp8(cupy.asarray(_varied(rng, (2, 2, 1, 400, 64)))) for _ in range(2))
    first = cupyflash.attention_forward(q_gqa, k_gqa, v_gqa)
    with nan_filled_allocations():
        again = cupyflash.attention_forward(q_gqa, k_gqa, v_gqa)
    assert len(plans.entries("call", "fp8")) == 2 and ("rows", (2, 2, 3), 64) in k_gqa._kept
    assert_bitwise_equal(first, again, ("out", "lse"))
    _check_kernel(q_gqa, k_gqa, v_gqa, causal=False)


def test_fast_path_keys_on_the_options(rng, hopper):
    """Another causal, scale or out_dtype is another plan; an option FP8 does not take still raises."""
    x8 = quantize_fp8(cupy.asarray(_varied(rng, (1, 2, 256, 64))))
    plans.clear()
    results = [
        cupyflash.attention_forward(x8, x8, x8, causal=c, scale=s, out_dtype=o)
        for c, s, o in ((False, None, None), (True, None, None), (True, 0.2, None), (True, 0.2, np.float16))
    ]
    assert len(plans.entries("call", "fp8")) == 4 and results[3][0].dtype == np.float16
    assert not np.array_equal(to_host(results[0][0]), to_host(results[1][0]))
    with pytest.raises(ValueError, match="window is not supported with FP8 inputs"):
        cupyflash.attention_forward(x8, x8, x8, causal=True, window=(4, 0))
