"""Shared test machinery: the `gpu` marker, a per-test seeded RNG, and the accuracy check.

The accuracy rule is FlashAttention's: against a float64 reference computed from the very same inputs,
our error in float16/bfloat16 must be at most twice the error of a naive implementation in that dtype,
plus the error of rounding the reference itself to that dtype (as FlashAttention-3's tests add: a perfect
implementation has that much, while the naive may round its worst element luckily). In float32 the error
must be at most 1e-5 of the reference's largest magnitude. Errors are max|x - ref|, on the same scale for
ours and the naive. A result that is exactly 0 everywhere (dq and dk when Nk == 1) gets an absolute bound.
"""

import importlib.util
import zlib
from pathlib import Path

import cupy
import numpy as np
import pytest

from cupyflash import reference
from cupyflash._api import sum_to_shape

NO_GPU_REASON = "no CUDA GPU: cupy.cuda.is_available() is False"

FP32_RTOL = 1e-5
NAIVE_FACTOR = 2.0
# For results that are exactly 0 (dq and dk when Nk == 1: softmax over one key is constant), where every
# relative bound is 0 and the naive is exact too: float32 rounding of dP - delta, sums over D terms of O(1)
# standard normal products, leaves about 1e-6 there.
ZERO_ATOL = 1e-5
LSE_RTOL = 1e-5
# With a softcap, the GPU's 16-bit kernels take tanh from the hardware's tanh.approx.f32 (relative error
# ~2^-11; README, score modifiers): each logit then carries up to softcap * 2^-11, and so does lse. The
# bound allows twice that.
TANH_APPROX_RTOL = 2.0 ** -10


def load_bench_script(name, filename):
    """bench/<filename> as a module named ``name`` (bench/ is no package: the script is loaded by path)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_addoption(parser):
    group = parser.getgroup("cupyflash", "cupyflash test options")
    group.addoption("--random-cases", type=int, default=None, metavar="N",
                    help="tests/test_random_cases.py: run N random cases (default: its modest count)")
    group.addoption("--random-seed", type=int, default=None, metavar="S",
                    help="tests/test_random_cases.py: base seed of the random cases (default: a fixed one)")


def pytest_configure(config):
    config.addinivalue_line("markers", f"gpu: needs a CUDA GPU; skipped with '{NO_GPU_REASON}'")
    config.addinivalue_line("markers", "huge: more than 2^31 elements in one tensor; needs >= 40 GiB of free GPU memory")


def pytest_collection_modifyitems(config, items):
    if cupy.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the test's id: fresh data for every test, the same data on every run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def assert_matches_reference():
    """``check(q, k, v, dout, results, causal=..., scale=None)`` with results = (out, lse, dq, dk, dv)."""
    return _assert_matches_reference


def _assert_matches_reference(q, k, v, dout, results, *, causal, scale=None):
    out, lse, dq, dk, dv = results
    xp = cupy.get_array_module(q)
    for name, x, like in (("out", out, dout), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert isinstance(x, xp.ndarray), f"{name} is a {type(x)}, expected {xp.__name__}.ndarray"
        assert (x.shape, x.dtype) == (like.shape, q.dtype), f"{name}: {x.shape} {x.dtype}"
    assert (lse.shape, lse.dtype) == (out.shape[:-1], np.float32), f"lse: {lse.shape} {lse.dtype}"

    host = [_to_host(x) for x in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention(*host[:3], causal=causal, scale=scale, return_lse=True)
    ref_grads = reference.attention_backward(host[3], *host[:3], causal=causal, scale=scale)
    naive = [_to_host(x) for x in naive_attention(q, k, v, dout, causal=causal, scale=scale)]

    _assert_lse_close(_to_host(lse), ref_lse)
    names, ours, refs = ("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)
    for name, x, ref, naive_x in zip(names, ours, refs, naive):
        _assert_close(name, _to_host(x), ref, naive_x, q.dtype)


def _assert_close(name, x, ref, naive, dtype):
    assert not np.isnan(x).any(), f"{name} has NaN (an element never written, or a 0/0)"
    error, size = _max_abs(x - ref), _max_abs(ref)
    if size == 0:
        bound, detail = ZERO_ATOL, "the exact result is 0"
    elif dtype == np.float32:
        bound, detail = FP32_RTOL * size, f"relative error {error / size:.3g}, max|ref| {size:.3g}"
    else:
        naive_error = _max_abs(naive - ref)
        rounding = _max_abs(ref.astype(dtype).astype(np.float64) - ref)
        bound = NAIVE_FACTOR * naive_error + rounding
        detail = f"naive error {naive_error:.3g}, ref rounding {rounding:.3g}, max|ref| {size:.3g}"
    dtype_name = np.dtype(dtype).name
    assert error <= bound, f"{name} ({dtype_name}): max error {error:.3g} > bound {bound:.3g} ({detail})"


def _max_abs(x):
    return float(np.max(np.abs(x), initial=0))


def lse_atol(dtype, softcap):
    """What a softcap adds to lse's bound: softcap * TANH_APPROX_RTOL for 16-bit inputs, else 0."""
    return float(softcap or 0.0) * TANH_APPROX_RTOL if np.dtype(dtype).itemsize == 2 else 0.0


def _assert_lse_close(lse, ref, atol=0.0):
    """lse is float32 from exact inputs in every dtype, so it is held to float32 accuracy (plus ``atol``:
    lse_atol's allowance for the 16-bit softcap's tanh)."""
    assert not np.isnan(lse).any(), "lse has NaN"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref)), "lse is -inf for other rows than the reference"
    seen = np.isfinite(ref)
    error = _max_abs(lse[seen] - ref[seen])
    bound = LSE_RTOL * max(1.0, _max_abs(ref[seen])) + atol
    assert error <= bound, f"lse: max error {error:.3g} > bound {bound:.3g}"


def naive_attention(q, k, v, dout, *, causal, scale=None):
    """Forward and backward the obvious way in q's dtype, for NumPy or CuPy: returns out, dq, dk, dv.

    "In that dtype" means what a framework's float16 ops do: each matmul accumulates in float32 and rounds
    its result to the dtype, and softmax computes in float32 from dtype inputs and rounds its result.
    We emulate exactly that (compute in float32, round after every op), which also works for bfloat16,
    whose NumPy matmul would otherwise return float32.
    """
    xp = cupy.get_array_module(q)
    dtype = q.dtype

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    qf, kf, vf = (xp.broadcast_to(x, batch + x.shape[-2:]).astype(xp.float32) for x in (q, k, v))
    dout = dout.astype(xp.float32)
    s = rounded(qf @ _transpose(kf))
    p = rounded(_masked_softmax(scale * s, causal))
    out = rounded(p @ vf)
    dv = rounded(_transpose(p) @ dout)
    dp = rounded(dout @ _transpose(vf))
    ds = rounded(p * (dp - xp.sum(p * dp, axis=-1, keepdims=True)))
    dq = rounded(scale * rounded(ds @ kf))
    dk = rounded(scale * rounded(_transpose(ds) @ qf))
    grads = (sum_to_shape(g.astype(dtype), x.shape) for g, x in ((dq, q), (dk, k), (dv, v)))
    return (out.astype(dtype), *grads)


def _masked_softmax(s, causal):
    xp = cupy.get_array_module(s)
    if causal:
        nq, nk = s.shape[-2:]
        sees = xp.arange(nk)[None, :] <= xp.arange(nq)[:, None] + (nk - nq)
        s = xp.where(sees, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -xp.inf, 0, m)  # rows that see no key: exp(-inf) = 0 everywhere, not NaN
    e = xp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    return e / xp.where(total > 0, total, 1)


def _transpose(x):
    return x.swapaxes(-1, -2)


def _to_host(x):
    """float64 NumPy copy of a NumPy or CuPy array (bfloat16 included)."""
    if isinstance(x, cupy.ndarray):
        x = x.get()
    return np.asarray(x, dtype=np.float64)
