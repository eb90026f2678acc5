"""examples/gpt on CuPy: the matrix products (matmul.py: cuBLAS gemmEx on a handle of our own, cublas_ctypes.py)
against float64 NumPy on the shapes and operand layouts the model uses, in bfloat16, float16, float32 and float64,
eagerly, on several streams and captured in a CUDA graph; each fused kernel (fused.py) against the plain array code
it replaces, in float64, float32, float16 and bfloat16; the whole model's gradients fused and plain; AdamW's fused
update; the training step captured as a CUDA graph (graph.py) against the same steps run eagerly in each dtype,
the learning rate it reads at each replay, and replays that allocate nothing; short training runs in bfloat16 and
float16 that learn and, in bfloat16, stay near the float32 run. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_gpt_example.py

The CPU side (the NumPy path, and the cuBLAS path's arguments replayed on NumPy) is tests/cpu/test_gpt_example.py.
"""

import contextlib
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.gpu import nan_filled_allocations

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

import cublas_ctypes  # noqa: E402
import fused  # noqa: E402
import matmul  # noqa: E402
import model  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from graph import CapturedStep  # noqa: E402

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
# the unit roundoff of each dtype: 2^-p for p significant bits, round to nearest
UNIT = {BF16: 2.0**-8, F16: 2.0**-11, F32: 2.0**-24, F64: 2.0**-53}


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _rel_frobenius(found, expected):
    return np.linalg.norm(found - expected) / np.linalg.norm(expected)


def _bound(a, b, out_dtype):
    """The relative Frobenius error allowed for a @ b against the float64 product of the same values.

    The inputs are exact (the reference multiplies the very numbers cuBLAS gets), so two errors remain: rounding
    each output to ``out_dtype``, at most its unit roundoff of its value, hence in Frobenius norm too (none where
    the output is the accumulator's own dtype); and accumulation over k products, at most k u of sum |a_i b_i| per
    element (the classic bound, u = 2^-23 for float32 accumulation rather than 2^-24, in case the tensor cores
    truncate rather than round their adds; 2^-52 for float64), taken relative to the product as
    ||(|a| |b|)||_F / ||a b||_F.
    """
    accumulator = F64 if a.dtype == F64 else F32
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    growth = np.linalg.norm(np.abs(a64) @ np.abs(b64)) / np.linalg.norm(a64 @ b64)
    rounding = 0.0 if out_dtype == accumulator else UNIT[out_dtype]
    return rounding + a.shape[-1] * 2 * UNIT[accumulator] * growth


# (name, a and b as the model builds them from host arrays: functions of (xp, host operands), whether the result is
# asked for in float32, the accumulator of the half types, rather than in the operands' dtype)
PRODUCTS = {
    "linear forward: x (3, 37, 64) @ w (64, 96)": (lambda xp, h: (xp.asarray(h[0]), xp.asarray(h[1])), False),
    "linear backward dx: dout (3, 37, 96) @ w.T": (lambda xp, h: (xp.asarray(h[2]), xp.asarray(h[1]).T), False),
    "linear backward dw in float32: flat_x.T (64, 111) @ flat_dout (111, 96)": (
        lambda xp, h: (xp.asarray(h[0]).reshape(-1, 64).T, xp.asarray(h[2]).reshape(-1, 96)),
        True,
    ),
    "the tied head in float32: x[:, -1] (3, 64) @ wte.T (64, 119)": (
        lambda xp, h: (xp.asarray(h[0])[:, -1], xp.asarray(h[3]).T),
        True,
    ),
    "the head's backward: dlogits (111, 119) @ wte (119, 64)": (
        lambda xp, h: (xp.asarray(h[4]), xp.asarray(h[3])),
        False,
    ),
    "an operand that must be copied first: x[..., ::2] (3, 37, 32) @ w[::2] (32, 96)": (
        lambda xp, h: (xp.asarray(h[0])[..., ::2], xp.asarray(h[1])[::2]),
        False,
    ),
    "k = 1: x[..., :1] @ w[:1]": (lambda xp, h: (xp.asarray(h[0])[..., :1], xp.asarray(h[1])[:1]), False),
}
GEMM_DTYPES = [BF16, F16, F32, F64]


def _host_operands(rng, dtype):
    return (
        _normal(rng, (3, 37, 64), dtype),  # x
        _normal(rng, (64, 96), dtype),  # w
        _normal(rng, (3, 37, 96), dtype),  # dout
        _normal(rng, (119, 64), dtype),  # wte
        _normal(rng, (111, 119), dtype),  # dlogits
    )


def _check_product(found, a_host, b_host, out_dtype):
    assert isinstance(found, cupy.ndarray) and found.dtype == out_dtype
    assert found.shape == a_host.shape[:-1] + (b_host.shape[1],)
    expected = a_host.astype(np.float64) @ b_host.astype(np.float64)
    error = _rel_frobenius(found.get().astype(np.float64), expected)
    assert error <= _bound(a_host, b_host, out_dtype), error


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("name", PRODUCTS)
def test_products_against_float64(rng, name, dtype):
    """Each product the model makes, in each dtype, with the result in the operands' dtype or in float32 (written
    by cuBLAS for the half types; for float64, a cast afterwards)."""
    build, wide = PRODUCTS[name]
    out_dtype = F32 if wide else dtype
    host = _host_operands(rng, dtype)
    a_host, b_host = build(np, host)
    a, b = build(cupy, host)
    _check_product(matmul.matmul(a, b, out_dtype), a_host, b_host, out_dtype)


def test_bfloat16_product_of_gpt2_small_sizes(rng):
    """A (4, 256, 768) @ (768, 3072) product, the MLP's first in GPT-2 small: k large enough for the accumulation
    term of the bound to matter, and a size cuBLAS runs on its tensor-core kernels."""
    a_host, b_host = _normal(rng, (4, 256, 768), BF16), _normal(rng, (768, 3072), BF16)
    for out_dtype in (BF16, F32):
        _check_product(matmul.matmul(cupy.asarray(a_host), cupy.asarray(b_host), out_dtype), a_host, b_host, out_dtype)


def test_cublas_constants_and_streams(rng):
    """matmul.py's and cublas_ctypes.py's enum numbers are CuPy's; products on the default stream, on two streams of
    their own and back (each change of stream sets the handle's stream and that stream's workspace) are right, and
    a stream keeps the workspace it was given first."""
    from cupy.cuda import cublas, runtime

    assert (matmul.CUBLAS_OP_N, matmul.CUBLAS_OP_T) == (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
    assert (matmul.CUDA_R_32F, matmul.CUDA_R_64F) == (runtime.CUDA_R_32F, runtime.CUDA_R_64F)
    assert (matmul.CUDA_R_16F, matmul.CUDA_R_16BF) == (runtime.CUDA_R_16F, runtime.CUDA_R_16BF)
    assert (matmul.CUBLAS_COMPUTE_32F, matmul.CUBLAS_COMPUTE_64F) == (
        cublas.CUBLAS_COMPUTE_32F,
        cublas.CUBLAS_COMPUTE_64F,
    )
    assert matmul.CUBLAS_GEMM_DEFAULT == cublas.CUBLAS_GEMM_DEFAULT
    assert cublas_ctypes.CUBLAS_POINTER_MODE_HOST == cublas.CUBLAS_POINTER_MODE_HOST
    a_host, b_host = _normal(rng, (5, 40), BF16), _normal(rng, (40, 24), BF16)
    a, b = cupy.asarray(a_host), cupy.asarray(b_host)
    streams = [cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)]
    workspaces = {}
    for stream in [cupy.cuda.Stream.null, *streams, streams[0], cupy.cuda.Stream.null]:
        with stream:
            found = matmul.matmul(a, b, F32)
            stream.synchronize()
        _check_product(found, a_host, b_host, F32)
        handle = cublas_ctypes._local.handles[cupy.cuda.runtime.getDevice()]
        assert handle.stream == stream.ptr
        workspace = handle.workspaces[stream.ptr]
        assert workspaces.setdefault(stream.ptr, workspace) is workspace
        assert workspace.size == cublas_ctypes.WORKSPACE_BYTES


def test_products_of_mixed_or_other_dtypes_are_refused():
    """cuBLAS gets two operands of one dtype it takes: a bfloat16 @ float32 product is an error, not a silent
    cast, and so are float16 @ float32 and integer products."""
    for a, b in [
        (cupy.ones((2, 3), BF16), cupy.ones((3, 4), F32)),
        (cupy.ones((2, 3), F16), cupy.ones((3, 4), F32)),
        (cupy.ones((2, 3), np.int32), cupy.ones((3, 4), np.int32)),
    ]:
        with pytest.raises(TypeError, match="two operands of one dtype of"):
            matmul.matmul(a, b)


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_products_captured_in_a_graph(rng, dtype):
    """Every product of PRODUCTS captured in one CUDA graph (after one uncaptured run on the stream, which makes
    its workspace), replayed on new operand values written into the same buffers: each result right for the
    values of its replay (CuPy's own ``@`` would raise under the capture)."""
    cases = [(build(cupy, _host_operands(rng, dtype)), F32 if wide else dtype) for build, wide in PRODUCTS.values()]
    cupy.cuda.Device().synchronize()  # the operands, made on the default stream, which the one below does not wait for
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()  # the graph's buffers (its copies, its outputs): nothing else allocates them
    with stream, cupy.cuda.using_allocator(pool.malloc):
        for (a, b), out_dtype in cases:
            matmul.matmul(a, b, out_dtype)
        stream.begin_capture()
        try:
            outs = [matmul.matmul(a, b, out_dtype) for (a, b), out_dtype in cases]
        finally:
            graph = stream.end_capture()
    with stream:
        for _ in range(2):
            for (a, b), _ in cases:  # new values in place: a view's base, or the array itself
                for x in (a, b):
                    base = x.base if x.base is not None else x
                    base[...] = cupy.asarray(_normal(rng, base.shape, dtype))
            graph.launch(stream)
            stream.synchronize()
            for ((a, b), out_dtype), found in zip(cases, outs):
                _check_product(found, a.get(), b.get(), out_dtype)


def test_a_first_product_under_capture_is_refused():
    """The first product on a stream allocates the stream's cuBLAS workspace, which a capture must not do: it
    raises, saying to run one product on the stream before capturing."""
    a, b = cupy.ones((4, 8), BF16), cupy.ones((8, 4), BF16)
    matmul.matmul(a, b)  # the handle exists; the stream below is new to it
    handle = cublas_ctypes._local.handles[cupy.cuda.runtime.getDevice()]
    streams = [cupy.cuda.Stream(non_blocking=True)]
    while streams[-1].ptr in handle.workspaces:  # the pointer of a destroyed stream, which kept its workspace
        streams.append(cupy.cuda.Stream(non_blocking=True))
    stream = streams[-1]
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="run one product there before capturing"):
                matmul.matmul(a, b)
        finally:
            stream.end_capture()


def _train(dtype, steps, seed=0, extra=()):
    argv = ["--device", "gpu", "--dtype", dtype, "--steps", str(steps), "--warmup", "5", "--seed", str(seed),
            "--eval-every", str(steps), "--checkpoint", "", "--sample", "0", *extra]  # fmt: skip
    return np.array(train.main(argv)["history"]["train"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_twenty_steps_learn(dtype):
    """The default small model (2 layers, width 64, context 64, batch 16) for 20 steps: every loss finite, and
    the last five 0.5 below the first three on average (all three dtypes measured 1.1 lower on an H200)."""
    losses = _train(dtype, 20)
    assert np.isfinite(losses).all(), losses
    assert losses[-5:].mean() < losses[:3].mean() - 0.5, losses


# bfloat16 against float32 from the same seed (the same initial parameters and batches). The first loss differs
# only by the forward's roundings, which average out over the batch's 1024 tokens; the updates barely move apart
# because Adam's first steps are close to lr * sign(gradient), which a gradient's relative rounding error of
# 2^-8 rarely flips. Measured on an H200: at most 2e-4 apart over the 8 steps (and over 20), in which the loss
# falls from 4.8 to 4.0, about 0.1 a step. The bound, a tenth of one step's progress, leaves 50 times the measured
# gap for other cuBLAS kernels and accumulation orders.
BFLOAT16_LOSS_GAP = 0.01


def test_bfloat16_tracks_float32():
    """Eight steps in bfloat16 and in float32 from one seed: each step's loss within BFLOAT16_LOSS_GAP; and the
    bfloat16 steps on the plain array code (--plain) within the same gap of the fused ones."""
    bf16, f32 = _train("bfloat16", 8), _train("float32", 8)
    assert np.isfinite(bf16).all() and np.abs(bf16 - f32).max() < BFLOAT16_LOSS_GAP, (bf16 - f32, f32)
    plain = _train("bfloat16", 8, extra=["--plain"])
    assert np.abs(plain - bf16).max() < BFLOAT16_LOSS_GAP, (plain - bf16, bf16)


# ------------------------------------------------------------------------------------------ fused kernels
DTYPES = [F64, F32, F16, BF16]
# Elementwise results that the fused kernel and the array code compute with the same operations in the same dtype
# can still differ where the compiler contracts a multiply and an add into one FMA (one rounding instead of two),
# or where a sum runs in another order: a few units of the accumulator's last place, which rounding to a
# half-precision dtype turns into at most one unit of that dtype's last place (2^-8 relative for bfloat16, 2^-11
# for float16) for the few values that sit next to a rounding boundary.
ELEMENT_RTOL = {F64: 1e-13, F32: 1e-5, F16: 2.0**-10, BF16: 2.0**-7}
# Norm-wise bounds for results that are sums over many terms (statistics, weight gradients): summation order.
SUM_RTOL = {F64: 1e-12, F32: 1e-5, F16: 1e-5, BF16: 1e-5}


def _device(rng, shape, dtype, scale=1.0, offset=0.0):
    """A CuPy array of ``dtype`` from standard normal values * scale + offset (the same draws for every dtype)."""
    return cupy.asarray((rng.standard_normal(shape) * scale + offset).astype(dtype))


def _host64(x):
    return x.get().astype(np.float64)


def _assert_elementwise(found, expected, dtype, atol=0.0):
    assert found.dtype == expected.dtype and found.shape == expected.shape, (found.dtype, expected.dtype)
    np.testing.assert_allclose(_host64(found), _host64(expected), rtol=ELEMENT_RTOL[np.dtype(dtype)], atol=atol)


def _rel_error(found, expected, scale=None):
    """||found - expected|| / scale (Frobenius norms), ``scale`` ||expected|| unless given; 0 where both are 0.

    Where the result is what is left of larger terms that cancel, give their size as ``scale``: rounding errors are
    relative to the terms, and what is left of them may be nothing (a layernorm's dx over a row of one element is
    exactly 0 in the array code, and a few units of the last place of the terms in a kernel that contracts an FMA).
    """
    scale = np.linalg.norm(expected) if scale is None else scale
    return np.linalg.norm(found - expected) / max(scale, np.finfo(np.float64).tiny)


def _assert_sums(found, expected, dtype, terms=None):
    """found and expected, sums, within SUM_RTOL norm-wise of expected or, where ``terms`` (the summands, as a
    host float64 array) are given, of their root-sum-square: for random terms of mean 0 about as large as the sums
    themselves (the bound as strict), and not 0 where they cancel."""
    assert found.dtype == expected.dtype and found.shape == expected.shape, (found.dtype, expected.dtype)
    scale = None if terms is None else np.linalg.norm(terms)
    error = _rel_error(_host64(found), _host64(expected), scale)
    assert error <= SUM_RTOL[np.dtype(dtype)], error


def _both(function, *args, **kwargs):
    """function(*args) on the fused kernels (their allocations filled with NaN first, so that an output element
    the kernels never write fails) and on the plain array code."""
    with nan_filled_allocations():
        found = function(*args, **kwargs)
    with fused.disabled():
        expected = function(*args, **kwargs)
    return found, expected


@pytest.fixture
def launches(monkeypatch):
    """The fused.cu kernels launched inside the test, as their name expressions (which say the pack: the elements
    per load and store), in order."""
    names = []
    function = fused._function

    def recorded(name, dtype, pack=None):
        names.append(fused._template(name, dtype, pack))
        return function(name, dtype, pack)

    monkeypatch.setattr(fused, "_function", recorded)
    return names


def _wide(dtype) -> int:
    """Elements of ``dtype`` in a 16-byte pack."""
    return 16 // np.dtype(dtype).itemsize


def _off_by_one(a):
    """a's values in a C-contiguous view one element past the start of its allocation: no 16-byte pack fits its
    address, so the kernels that take it move one element at a time."""
    flat = cupy.empty(a.size + 1, a.dtype)
    view = flat[1:].reshape(a.shape)
    view[...] = a
    return view


# Where the pointwise kernels move 16-byte packs and where one element at a time: rows of whole packs in arrays
# that start at their allocations ("packed"), rows that no pack divides ("odd width"), and an input whose address
# is one element off ("offset").
LAYOUTS = ["packed", "odd width", "offset"]


def _layout_input(rng, layout, rows, width, dtype, **kwargs):
    """(an input (3, rows, width) for the layout; width made odd for "odd width"), and the pack the kernels should
    take for it."""
    if layout == "odd width":
        width += 1
    x = _device(rng, (3, rows, width), dtype, **kwargs)
    if layout == "offset":
        x = _off_by_one(x)
    wide = _wide(dtype)
    return x, (wide if layout == "packed" else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37, 200), (2, 64, 768), (5, 1)])
def test_fused_layernorm(rng, dtype, shape):
    """Forward (out, mean, rstd) and backward (dx with and without the residual's gradient, dg, db); widths that
    are and are not multiples of the warp, and a row of one element; x with a mean far from 0 (the two-pass
    variance)."""
    x = _device(rng, shape, dtype, scale=2.0, offset=3.0)
    g, b = _device(rng, shape[-1:], F32), _device(rng, shape[-1:], F32)
    if dtype == F64:
        g, b = g.astype(F64), b.astype(F64)
    dout, dresidual = _device(rng, shape, dtype), _device(rng, shape, dtype)
    (out, saved), (out_plain, saved_plain) = _both(model.layernorm_forward, x, g, b)
    _assert_elementwise(out, out_plain, dtype, atol=ELEMENT_RTOL[dtype])
    for i in (1, 2):  # mean, rstd
        _assert_sums(saved[i], saved_plain[i], dtype)
    # both backwards take the fused forward's statistics: xhat and rstd * dxhat, the terms below, are theirs
    x64, mean, rstd = _host64(x), _host64(saved[1]), _host64(saved[2])
    dout64, xhat = _host64(dout), (x64 - mean) * rstd
    rstd_dxhat = np.linalg.norm(rstd * dout64 * _host64(g))
    for residual in (None, dresidual):
        (dx, dg, db), (dx_plain, dg_plain, db_plain) = _both(model.layernorm_backward, dout, saved, residual)
        # dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)) (+ dresidual): terms that cancel (all of them over
        # a row of one element), so compared as a sum against the size of its terms, rstd * dxhat's and the
        # residual's (about ||dx|| over rows of 37 and more), plus one rounding of the result
        scale = np.hypot(rstd_dxhat, 0.0 if residual is None else np.linalg.norm(_host64(residual)))
        tolerance = SUM_RTOL[dtype] + (ELEMENT_RTOL[dtype] if dtype in (F16, BF16) else 0.0)
        error = _rel_error(_host64(dx), _host64(dx_plain), scale)
        assert error <= tolerance, error
        assert dx.dtype == dtype
        _assert_sums(dg, dg_plain, dtype, terms=dout64 * xhat)
        _assert_sums(db, db_plain, dtype, terms=dout64)


# GELU's tails: where tanh is within a few units of the last place of +-1, 1 + tanh (forward) and 1 - tanh^2
# (backward) keep only those few units, so a one-unit difference in tanh's argument (a contracted FMA) moves the
# result by about one unit of 1 in the accumulator, times |x| (forward) or |x|^3 (backward): absolute, not relative.
GELU_ATOL = {F64: 1e-13, F32: 1e-5, F16: 1e-5, BF16: 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_gelu(rng, dtype, layout, launches):
    """Forward and backward over values up to |x| ~ 12 (both tails of the tanh): each element within one rounding
    of the result dtype, or an absolute GELU_ATOL (times |x|^2 |dout| for the backward) in the tails, and the
    whole within float32's (float64's) rounding norm-wise; in packs of 16 bytes and one element at a time."""
    x, pack = _layout_input(rng, layout, 33, 64, dtype, scale=3.0)
    dout = _device(rng, x.shape, dtype)
    (y, saved), (y_plain, _) = _both(model.gelu_forward, x)
    _assert_elementwise(y, y_plain, dtype, atol=GELU_ATOL[dtype])
    dx, dx_plain = _both(model.gelu_backward, dout, saved)
    scale = float(abs(x).astype(F32).max()) ** 2 * float(abs(dout).astype(F32).max())
    _assert_elementwise(dx, dx_plain, dtype, atol=GELU_ATOL[dtype] * scale)
    for found, expected in ((y, y_plain), (dx, dx_plain)):
        assert _rel_error(_host64(found), _host64(expected)) <= SUM_RTOL[dtype] + ELEMENT_RTOL[dtype] / 8
    assert launches[0].endswith(f", {pack}>") and launches[1].endswith(f", {pack}>"), launches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_linear_gelu(rng, dtype, layout, launches):
    """The MLP's first half, GELU(x @ w + b): the fused bias-and-GELU pass against linear_forward then
    gelu_forward (act, and the pre-activation it keeps), and GELU's backward with the bias gradient summed in the
    same pass against gelu_backward then linear_backward; widths of whole packs and not, an offset input; 3 * 300
    rows, more than one chunk of the column sums."""
    h, _ = _layout_input(rng, layout, 300, 32, dtype)
    width = 96 if layout != "odd width" else 97  # the product's width: the bias and GELU kernels' rows
    master = F64 if dtype == F64 else F32
    w, b = _device(rng, (h.shape[-1], width), master, scale=0.3), _device(rng, (width,), master)
    (act, saved), (act_plain, saved_plain) = _both(model.linear_gelu_forward, h, w, b)
    (pre,), (pre_plain,) = saved[1], saved_plain[1]
    _assert_elementwise(pre, pre_plain, dtype, atol=1e-30)  # y + b, one rounding in both
    _assert_elementwise(act, act_plain, dtype, atol=GELU_ATOL[dtype])
    dout = _device(rng, act.shape, dtype)
    (dx, dw, db), (dx_plain, dw_plain, db_plain) = _both(model.linear_gelu_backward, dout, saved)
    # db sums the gradient the kernel wrote: against the sums of that gradient (d_fc, recomputed here as the
    # product dx came from would have it), in the summation order's bounds; d_fc itself against the plain one
    with fused.disabled():
        d_fc_plain = model.gelu_backward(dout, saved[1])
    d_fc = fused.gelu_backward(dout, pre)
    scale = float(abs(pre).astype(F32).max()) ** 2 * float(abs(dout).astype(F32).max())
    _assert_elementwise(d_fc, d_fc_plain, dtype, atol=GELU_ATOL[dtype] * scale)
    terms = _host64(d_fc).reshape(-1, width)
    assert _rel_error(_host64(db), terms.sum(0), np.linalg.norm(terms)) <= SUM_RTOL[dtype]
    for found, expected in ((dx, dx_plain), (dw, dw_plain), (db, db_plain)):
        assert found.dtype == expected.dtype and found.shape == expected.shape
        assert _rel_error(_host64(found), _host64(expected)) <= SUM_RTOL[dtype] + ELEMENT_RTOL[dtype], found.shape
    packs = [name for name in launches if name.startswith(("bias_gelu_forward", "column_sums"))]
    wide = 1 if width % _wide(dtype) else _wide(dtype)  # (the offset input is the product's: aligned by cuBLAS)
    assert packs and all(name.endswith(f", {wide}>") for name in packs), launches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_bias_residual_and_bias_gradient(rng, dtype, layout, launches):
    """A linear layer's output with its bias, with and without the residual added (one rounding), and its bias
    gradient (column sums over 3 * 300 rows, more than one chunk of the column-sum kernel); in packs and one
    element at a time (the residual and dout as the layout makes them)."""
    residual, pack = _layout_input(rng, layout, 300, 40, dtype, scale=10.0)
    width = residual.shape[-1]
    x = _device(rng, (3, 300, 48), dtype)
    w, b = _device(rng, (48, width), F32 if dtype != F64 else F64), _device(rng, (width,), F32 if dtype != F64 else F64)
    for extra in (None, residual):
        (y, saved), (y_plain, _) = _both(model.linear_forward, x, w, b, extra)
        _assert_elementwise(y, y_plain, dtype, atol=1e-30)
    dout, _ = _layout_input(rng, layout, 300, 40, dtype)
    (_, _, db), (_, _, db_plain) = _both(model.linear_backward, dout, saved)
    _assert_sums(db, db_plain, dtype, terms=_host64(dout))
    residual_add, sums, totals = launches[1], launches[-2], launches[-1]
    assert residual_add.startswith("bias_add") and residual_add.endswith(f", {pack}>"), launches
    assert sums.startswith("column_sums") and sums.endswith(f", {pack}>"), launches
    assert totals == fused._template("column_totals", dtype), launches  # the chunks' partial sums, added


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["packed", "head dim 6", "odd column offset"])
def test_fused_merge_heads(rng, dtype, case, launches):
    """Attention's heads (B, Hk, G, N, D) merged into each token's row: into a whole array, and into a column
    slice of a wider one (the qkv gradient's thirds) whose other columns stay as they were; exactly the plain
    code's copy. Head dims and column offsets that 16-byte packs divide and that they do not."""
    b, hk, g, n = 2, 3, 2, 37
    d = 6 if case == "head dim 6" else 64
    x = _device(rng, (b, hk, g, n, d), dtype)
    with nan_filled_allocations():
        out = model.merge_heads(x, cupy.empty((b, n, hk * g * d), dtype))
    with fused.disabled():
        out_plain = model.merge_heads(x, cupy.empty((b, n, hk * g * d), dtype))
    np.testing.assert_array_equal(_host64(out), _host64(out_plain))
    first = 1 if case == "odd column offset" else hk * g * d
    wide = cupy.full((b, n, first + 2 * hk * g * d), 7.0, F32).astype(dtype)
    columns = slice(first, first + hk * g * d)
    model.merge_heads(x, wide[..., columns])
    np.testing.assert_array_equal(_host64(wide[..., columns]), _host64(out_plain))
    rest = np.delete(_host64(wide), np.arange(first, first + hk * g * d), axis=-1)
    assert (rest == 7.0).all()
    pack = _wide(dtype) if d % _wide(dtype) == 0 and first % _wide(dtype) == 0 else 1
    assert launches[-1] == fused._template("merge_heads", dtype, pack), launches


@pytest.mark.parametrize("grad_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("vocab", [300, 301])
def test_fused_cross_entropy_backward_in_the_activation_dtype(rng, grad_dtype, vocab, launches):
    """The loss's gradient (p - onehot) / rows from float32 probabilities, written in bfloat16 or float16 (a new
    array) or in place (float32): exactly the plain code's float32 gradient rounded once. A vocabulary of whole
    packs of four and one not."""
    rows = 67
    logits = _device(rng, (rows, vocab), F32, scale=4.0)
    targets = cupy.asarray(rng.integers(0, vocab, size=rows).astype(np.int32))
    probs = logits.copy()
    fused.softmax_cross_entropy(probs, targets)
    expected = probs.copy()
    expected[cupy.arange(rows), targets] -= 1.0
    expected /= rows
    expected = expected.astype(grad_dtype)
    with nan_filled_allocations():
        d = fused.cross_entropy_backward(probs, targets, grad_dtype)
    assert d.dtype == grad_dtype and (d is probs) == (grad_dtype == F32)
    np.testing.assert_array_equal(_host64(d), _host64(expected))
    assert launches[-1].endswith(f", {4 if vocab % 4 == 0 else 1}>"), launches


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("vocab", [11, 1000, 50304])
def test_fused_softmax_cross_entropy(rng, dtype, vocab):
    """The loss and its gradient from logits (rows, V) of a wide spread (scale 8: without the max, exp would
    overflow float32 in some rows; wider, the plain code's log(probability) underflows past exp(-87), where the
    kernel's log-sum-exp form does not); a vocabulary smaller than the block, one not a multiple of it, and GPT-2's
    padded one. The fused forward's probabilities overwrite its logits, and its backward overwrites them with
    dlogits."""
    rows = 67
    logits = _device(rng, (rows, vocab), dtype, scale=8.0)
    targets = cupy.asarray(rng.integers(0, vocab, size=rows))
    probs_plain = logits.copy()
    probs_plain -= probs_plain.max(-1, keepdims=True)
    probs_plain = cupy.exp(probs_plain)
    probs_plain /= probs_plain.sum(-1, keepdims=True)
    losses_plain = -cupy.log(probs_plain[cupy.arange(rows), targets])
    probs = logits.copy()
    losses = fused.softmax_cross_entropy(probs, targets)
    tolerance = 1e-12 if dtype == F64 else 1e-5
    np.testing.assert_allclose(_host64(losses), _host64(losses_plain), rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(_host64(probs), _host64(probs_plain), rtol=tolerance, atol=1e-30)
    dlogits_plain = probs_plain.copy()
    dlogits_plain[cupy.arange(rows), targets] -= 1.0
    dlogits_plain /= rows
    dlogits = fused.cross_entropy_backward(probs, targets)
    assert dlogits is probs
    np.testing.assert_allclose(_host64(dlogits), _host64(dlogits_plain), rtol=tolerance, atol=tolerance / rows)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fused_head_and_loss_in_the_model(rng, dtype):
    """model.cross_entropy_forward / backward (the tied head, the loss and its gradients) fused and plain."""
    x = _device(rng, (2, 37, 64), dtype)
    wte = _device(rng, (300, 64), F32, scale=0.5)
    targets = cupy.asarray(rng.integers(0, 300, size=(2, 37)).astype(np.int32))
    (loss, saved), (loss_plain, saved_plain) = _both(model.cross_entropy_forward, x, wte, targets)
    assert abs(float(loss) - float(loss_plain)) <= 1e-5 * abs(float(loss_plain))
    dx, dwte = model.cross_entropy_backward(saved)
    with fused.disabled():
        dx_plain, dwte_plain = model.cross_entropy_backward(saved_plain)
    # dlogits rounded to bfloat16 for both products: a one-unit difference there where the float32 dlogits differ
    assert _rel_error(_host64(dx), _host64(dx_plain)) <= SUM_RTOL[dtype] + ELEMENT_RTOL[dtype]
    assert _rel_error(_host64(dwte), _host64(dwte_plain)) <= SUM_RTOL[dtype] + ELEMENT_RTOL[dtype]


@pytest.mark.parametrize("dtype", [F64, F32])
def test_fused_sum_of_squares(rng, dtype):
    """Over more elements than the fixed grid covers in one pass, and over fewer than one block."""
    for n in (3, 5_000_001):
        x = _device(rng, (n,), dtype)
        found = fused.sum_squares(x)
        assert found.shape == (1,) and found.dtype == dtype
        expected = float((x.get().astype(np.float64) ** 2).sum())
        assert abs(float(found[0]) - expected) <= (1e-12 if dtype == F64 else 1e-5) * expected


def _optimizer_steps(params, steps, clip):
    optimizer = optim.AdamW(params, lr=1e-3, clip=clip)
    norms = []
    for i, grads in enumerate(steps):
        optimizer.set_lr(1e-3 * (i + 1))
        norms.append(float(optimizer.step(grads)))
    return optimizer, norms


@pytest.mark.parametrize("clip", [1.0, None])
def test_fused_adamw_matches_the_array_code(rng, clip):
    """Four steps of the flat-buffer AdamW, fused and plain, from the same parameters and gradients (norm ~30:
    clipped when clip is 1): parameters, moments and norms agree to float32 rounding."""
    shapes = {"w": (40, 30), "e": (70, 16), "b": (30,), "g": (16,)}
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    steps = [{k: cupy.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()} for _ in range(4)]
    params = {k: cupy.asarray(v) for k, v in start.items()}
    optimizer, norms = _optimizer_steps(params, steps, clip)
    params_plain = {k: cupy.asarray(v) for k, v in start.items()}
    with fused.disabled():
        plain, norms_plain = _optimizer_steps(params_plain, steps, clip)
    np.testing.assert_allclose(norms, norms_plain, rtol=1e-6)
    for name in shapes:
        np.testing.assert_allclose(params[name].get(), params_plain[name].get(), rtol=1e-6, atol=1e-7, err_msg=name)
    # m sums gradients of either sign, so an element can cancel to far below its terms: its float32 rounding
    # is relative to the terms (about the moment's largest element), not to itself.
    for found, expected in ((optimizer.m, plain.m), (optimizer.v, plain.v)):
        expected = expected.get()
        np.testing.assert_allclose(found.get(), expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    assert int(optimizer.t[0]) == int(plain.t[0]) == 4


@pytest.mark.parametrize("copy_dtype", [BF16, F16])
def test_fused_adamw_writes_the_half_precision_copies(rng, copy_dtype):
    """AdamW keeping the matrices in bfloat16 or float16 (optim.AdamW.copies): after each of four steps, fused and
    plain, the copy is exactly the float32 master of each matrix rounded to nearest even (ml_dtypes' cast on the
    host), the views the optimizer handed out first among them; biases and gains have no copy. Sizes that no pack
    divides: the matrices end inside a pack of four, and the buffer in a tail of two."""
    shapes = {"w": (13, 7), "e": (5, 3), "b": (7,), "g": (3,), "c": (2,)}  # matrices 106 elements, all 118
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    steps = [{k: cupy.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()} for _ in range(4)]
    for plain in (False, True):
        params = {k: cupy.asarray(v) for k, v in start.items()}
        with fused.disabled() if plain else contextlib.nullcontext():
            optimizer = optim.AdamW(params, lr=1e-3, clip=1.0)
            copies = optimizer.copies(copy_dtype)
            assert set(copies) == {"w", "e"} and all(copies[k].dtype == copy_dtype for k in copies)
            for i, grads in enumerate(steps):
                optimizer.set_lr(1e-3 * (i + 1))
                optimizer.step(grads)
                for name in copies:
                    expected = params[name].get().astype(copy_dtype)
                    np.testing.assert_array_equal(copies[name].get(), expected, err_msg=f"{name}, step {i}")
        assert optimizer.copies(copy_dtype)["w"].data.ptr == copies["w"].data.ptr  # one buffer, cast again
    with pytest.raises(ValueError, match="keeps its copies"):
        optimizer.copies(F16 if copy_dtype == BF16 else BF16)


def test_fused_adamw_one_element_at_a_time_matches_packs(rng):
    """fused.adamw on buffers whose addresses no 16-byte pack fits (views one element in: the kernel's one-element
    path) and on the same values where packs fit: the same parameters, moments and bfloat16 copy."""
    n, decay_end = 1001, 999
    values = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    values[3] = np.abs(values[3])  # v >= 0
    sumsq = cupy.asarray(np.array([float((values[1].astype(np.float64) ** 2).sum())], np.float32))
    lr, t = cupy.full(1, 1e-2, np.float32), cupy.full(1, 3, np.int32)
    found = {}
    for layout in ("packed", "offset"):
        p, g, m, v = (cupy.asarray(x) if layout == "packed" else _off_by_one(cupy.asarray(x)) for x in values)
        copy = cupy.empty(decay_end, BF16)
        copy = copy if layout == "packed" else _off_by_one(copy)
        fused.adamw(p, g, m, v, sumsq=sumsq, lr=lr, t=t, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0,
                    decay_end=decay_end, copy=copy)  # fmt: skip
        found[layout] = [x.get() for x in (p, m, v, copy)]
        np.testing.assert_array_equal(found[layout][3], found[layout][0][:decay_end].astype(BF16))
    for packed, single in zip(found["packed"], found["offset"]):
        np.testing.assert_allclose(packed.astype(F64), single.astype(F64), rtol=1e-6, atol=1e-7)


SMALL = model.Config(vocab=97, context=64, layers=2, width=64, heads=4, kv_heads=2)


def _gradients(params, tokens, targets, dtype):
    loss, state = model.forward(params, tokens, targets, SMALL, dtype)
    return float(loss), model.backward(state, params, SMALL)


def test_whole_model_fused_against_plain_and_float64(rng):
    """The whole model's loss and gradients with the fused kernels and with the array code: in float64 and
    float32 the two agree to summation order; in bfloat16 the fused gradients are no further from the float64
    ones than the plain bfloat16 gradients are (each a few roundings of 2^-8 away)."""
    params = model.init(SMALL, cupy, 3)
    for name in params:  # gains and biases away from 1 and 0, so that their gradients are exercised
        params[name] = params[name] + cupy.asarray(0.05 * rng.standard_normal(params[name].shape), np.float32)
    tokens, targets = (cupy.asarray(rng.integers(0, SMALL.vocab, size=(3, SMALL.context))) for _ in range(2))
    params64 = {k: v.astype(F64) for k, v in params.items()}
    loss64, grads64 = _gradients(params64, tokens, targets, F64)
    with fused.disabled():
        loss64_plain, grads64_plain = _gradients(params64, tokens, targets, F64)
    assert abs(loss64 - loss64_plain) <= 1e-12 * loss64
    for dtype in (F32, BF16):
        loss, grads = _gradients(params, tokens, targets, dtype)
        with fused.disabled():
            loss_plain, grads_plain = _gradients(params, tokens, targets, dtype)
        assert abs(loss - loss_plain) <= (1e-5 if dtype == F32 else 1e-2) * loss64
        for name in params:
            expected = grads64[name].get()
            np.testing.assert_allclose(grads64_plain[name].get(), expected, rtol=1e-10, atol=1e-13, err_msg=name)
            found, found_plain = grads[name].get().astype(F64), grads_plain[name].get().astype(F64)
            if dtype == F32:
                assert _rel_error(found, found_plain) <= 1e-4, name
            else:
                error, error_plain = _rel_error(found, expected), _rel_error(found_plain, expected)
                assert error <= 1.5 * error_plain + 1e-3, (name, error, error_plain)


# ------------------------------------------------------------------------------------------ the CUDA graph
# Eager and captured steps run the same kernels on the same values, so their losses should agree to the bit, but
# for the order of the atomic adds that scatter the embedding's gradient (cupyx.scatter_add) and any other
# algorithm cuBLAS picks under capture: far below a bfloat16 rounding of the loss (2^-8 of ~4, 0.016). The bound
# is a quarter of that.
GRAPH_LOSS_GAP = 0.004


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_graph_mode_matches_eager(dtype):
    """Ten steps of the default small model from one seed (the same parameters and batches), eagerly and with
    --graph (step 1 uncaptured, the capture, then nine replays), in each dtype train.py offers."""
    eager, graph = _train(dtype, 10), _train(dtype, 10, extra=["--graph"])
    assert np.isfinite(graph).all() and np.abs(graph - eager).max() <= GRAPH_LOSS_GAP, (graph - eager, eager)
    assert eager[-1] < eager[0] - 0.3  # a run that learns (not one that stands still in both modes)


# A kernel that spins for about a tenth of a second (clock64 ticks at ~1.7-2 GHz), to hold the default stream back.
_SPIN = r"""
extern "C" __global__ void spin(long long ticks) {
    long long start = clock64();
    while (clock64() - start < ticks) {
    }
}
"""


def test_graph_mode_waits_for_the_default_stream(monkeypatch):
    """train.py --graph with the default stream held back while the model and optimizer are made on it: the
    graph's non-blocking stream must still see the optimizer's initial state before its first learning-rate update
    (had the update run first, the initial fill would overwrite it and the first step take the peak rate)."""
    spin = cupy.RawKernel(_SPIN, "spin")
    made = optim.AdamW.__init__

    def held_back(self, *args, **kwargs):
        spin((1,), (1,), (np.int64(200_000_000),))  # on the default stream, before the optimizer's fills
        made(self, *args, **kwargs)

    monkeypatch.setattr(optim.AdamW, "__init__", held_back)
    eager, graph = _train("float32", 3), _train("float32", 3, extra=["--graph"])
    assert np.abs(graph - eager).max() <= GRAPH_LOSS_GAP, (graph - eager, eager)


def _captured_model(rng, lr=1e-3):
    params = model.init(SMALL, cupy, 0)
    optimizer = optim.AdamW(params, lr=lr)
    step = CapturedStep(train.make_step(params, optimizer, SMALL, BF16), (4, SMALL.context))
    batches = [tuple(rng.integers(0, SMALL.vocab, size=(4, SMALL.context)).astype(np.int32) for _ in range(2))]
    return params, optimizer, step, batches * 8


def test_graph_replays_read_the_learning_rate_and_allocate_nothing(rng):
    """The captured step takes its learning rate from the device at each replay (a rate of 0 leaves the
    parameters as they were; the next rate moves them again), advances Adam's step count at each replay, and
    allocates nothing: neither the graph's pool nor CuPy's default pool grows over the replays."""
    params, optimizer, step, batches = _captured_model(rng)
    with step.stream:
        for x, y in batches[:2]:  # the uncaptured step and the capture, then the first replay
            step(x, y)
        before = {k: v.copy() for k, v in params.items()}
        step.stream.synchronize()
        pools = (step.pool.total_bytes(), cupy.get_default_memory_pool().total_bytes())
        used = cupy.get_default_memory_pool().used_bytes()
        optimizer.set_lr(0.0)
        loss, norm = step(*batches[2])
        step.stream.synchronize()
        for name in params:
            np.testing.assert_array_equal(params[name].get(), before[name].get(), err_msg=name)
        assert float(norm) > 0 and np.isfinite(float(loss))
        optimizer.set_lr(1e-3)
        losses = []
        for x, y in batches[3:]:
            loss, _ = step(x, y)
            losses.append(float(loss))
        step.stream.synchronize()
    assert all(not np.array_equal(params[k].get(), before[k].get()) for k in params)
    assert int(optimizer.t[0]) == len(batches)
    assert (step.pool.total_bytes(), cupy.get_default_memory_pool().total_bytes()) == pools
    assert cupy.get_default_memory_pool().used_bytes() == used
    assert losses[-1] < losses[0]  # one batch, over and over: the replays learn it
