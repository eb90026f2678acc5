"""attention_with_kvcache on FP8 caches (FP8KVCache): random problems, and the check of one CPU call against the
float64 reference.

``check_fp8`` holds, for a call that appends and attends:

- the caches after the append to the reference's, which appends by its own code: codes and scales bit for
  bit, every position (so nothing else was written), except the rotated new keys: the reference rotates in
  float64 and rounds to float32 once, the CPU path rotates in float32, so such a key's code may lie one e4m3
  step away and a block's new scale a float32 rounding away;
- out and lse against the reference on the caches as the call left them (read as ``e4m3(code) * scale`` in
  float64) with no append: to one rounding of out to q's dtype plus float32 arithmetic (float64 q: float64
  rounding). The queries are rotated for the reference as the call rotates them and rounded to q's dtype.
"""

import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import reference
from cupyflash._arrays import cupy
from helpers.checks import FP32_RTOL, LSE_RTOL, assert_close, assert_lse_close, lse_atol, max_abs, to_host
from helpers.kvcache import Problem, make_problem, naive, run, to_device

SCALINGS = ("tensor", "head", "block")
# Half a unit in the last place of out's dtype, relative: the one rounding of out.
OUT_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
FLOAT64_RTOL = 1e-12
SCALE_RTOL = 2.0**-21  # a fresh block's scale from float32- or float64-rotated keys: a float32 rounding or two
REFERENCE_IGNORES = ("num_splits",)


def make_fp8_problem(rng, dtype, seqlens, *, scaling, outliers=1.0, mean=0.0, **kwargs) -> Problem:
    """helpers.kvcache.make_problem's random problem with its caches quantized to FP8KVCaches of ``scaling``
    (from float32 for float64 q); ``outliers`` multiplies key dims 3 and 7 of the caches and of the new keys
    (trained models' outlier channels); ``mean`` is added to every cached and new key and value (data away from
    zero, where a block's scale follows its mean, not its spread)."""
    p = make_problem(rng, dtype, seqlens, **kwargs)
    source = np.float32 if np.dtype(dtype) == np.float64 else dtype
    k_cache = p.k_cache.astype(np.float32)
    k_cache[..., [3, 7]] *= outliers
    p.k_cache = cupyflash.quantize_kvcache((k_cache + mean).astype(source), scaling)
    p.v_cache = cupyflash.quantize_kvcache((p.v_cache.astype(np.float32) + mean).astype(source), scaling)
    if p.k is not None:
        k = p.k.astype(np.float64)
        k[..., [3, 7]] *= outliers
        p.k = (k + mean).astype(dtype)
        p.v = (p.v.astype(np.float64) + mean).astype(dtype)
    return p


def copy_holder(x):
    return cupyflash.FP8KVCache(x.data.copy(), x.scale.copy(), x.scaling)


def snapshot(p: Problem) -> Problem:
    """p with copies of its holders (the call writes the originals)."""
    return Problem(p.q, copy_holder(p.k_cache), copy_holder(p.v_cache), p.k, p.v, dict(p.options))


def e4m3_values(codes):
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def check_fp8(p: Problem, call=run):
    """``call(p)`` (out and lse) held to the reference (module docstring); returns out, lse."""
    before = snapshot(p)
    options = {name: x for name, x in before.options.items() if name not in REFERENCE_IGNORES}
    _, _, ref_k_cache, ref_v_cache = reference.attention_with_kvcache(
        before.q, before.k_cache, before.v_cache, before.k, before.v, return_lse=True, return_caches=True, **options
    )
    out, lse = call(p)
    rotated = "rotary_cos" in p.options
    compare_caches("k_cache", p.k_cache, ref_k_cache, rotated)
    compare_caches("v_cache", p.v_cache, ref_v_cache, False)
    expected, expected_lse = attention_after(p)
    lse_dtype = np.float64 if p.q.dtype == np.float64 else np.float32
    assert (out.dtype, lse.dtype) == (p.q.dtype, lse_dtype), f"out {out.dtype}, lse {lse.dtype}"
    assert_attention_close(out, lse, expected, expected_lse, p.q.dtype)
    return out, lse


def compare_caches(name, cache, ref, rotated):
    """The codes and scales of ``cache`` (the call's) against ``ref`` (the reference's), as the module docstring
    says."""
    if not rotated:
        np.testing.assert_array_equal(cache.scale, ref.scale, err_msg=f"{name}: the scales differ")
        np.testing.assert_array_equal(cache.data, ref.data, err_msg=f"{name}: the codes differ")
        return
    scale_error = np.abs(cache.scale.astype(np.float64) / ref.scale - 1).max()
    assert scale_error <= SCALE_RTOL, f"{name}: scales differ by {scale_error:.3g} relative"
    got, want = e4m3_values(cache.data), e4m3_values(ref.data)
    step = 2.0**-3 * np.maximum(np.abs(want), 2.0**-6)  # one e4m3 unit in the last place (subnormals: 2^-9)
    # A scale an ulp apart moves every value of its block: compare the values, not the codes, where it did.
    far = np.abs(got - want) > step + 2 * SCALE_RTOL * np.abs(want)
    assert not far.any(), f"{name}: {int(far.sum())} codes differ by more than one e4m3 step"


def rotated_queries(p: Problem):
    """q as the call rotates it (the float64 rotation, rounded to q's dtype); q itself without rotary."""
    o = p.options
    if "rotary_cos" not in o:
        return p.q
    nq = p.q.shape[2]
    advance = o.get("causal", False) or o.get("window") not in (None, (-1, -1))
    steps = np.arange(nq) if advance else np.zeros(nq, dtype=np.int64)
    q = np.empty_like(p.q)
    for b, start in enumerate(p.seqlens()):
        q[b] = reference.rotary(
            p.q[b], o["rotary_cos"], o["rotary_sin"], start + steps, o.get("rotary_interleaved", False)
        ).astype(p.q.dtype)
    return q


def attention_after(p: Problem):
    """The reference's out and lse on p's caches as they are (after the call's append), with no append."""
    skip = REFERENCE_IGNORES + ("rotary_cos", "rotary_sin", "rotary_interleaved", "cache_seqlens")
    options = {name: x for name, x in p.options.items() if name not in skip}
    return reference.attention_with_kvcache(
        rotated_queries(p), p.k_cache, p.v_cache, cache_seqlens=p.seqlens() + p.nnew, return_lse=True, **options
    )


def assert_attention_close(out, lse, expected, expected_lse, dtype):
    """out and lse within one rounding of out to ``dtype`` plus float32 arithmetic of the float64 ``expected``
    (float64: float64 rounding); rows that see no key exactly out 0, lse -inf."""
    name = np.dtype(dtype).name
    out, lse = to_host(out), to_host(lse)
    seen = np.isfinite(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen, err_msg="lse is -inf for other rows than the reference")
    assert not out[~seen].any(), "a row that sees no key has a nonzero out"
    if name == "float64":
        out_bound = FLOAT64_RTOL * max_abs(expected)
        lse_bound = FLOAT64_RTOL * max(1.0, max_abs(expected_lse[seen]))
    else:
        out_bound = OUT_ROUNDING[name] * np.abs(expected) + FP32_RTOL * max_abs(expected)
        lse_bound = LSE_RTOL * max(1.0, max_abs(expected_lse[seen]))
    excess = np.abs(out - expected) - out_bound
    assert (excess <= 0).all(), (
        f"out differs beyond its bound by up to {excess.max():.3g} (max|ref| {max_abs(expected):.3g})"
    )
    error = max_abs(lse[seen] - expected_lse[seen])
    assert error <= lse_bound, f"lse differs by {error:.3g} > {lse_bound:.3g}"


# ------------------------------------------------------------------------------------ on the GPU
def holder_to_device(x):
    """A CuPy copy of a NumPy holder, its codes in the same memory order (a transposed view stays one)."""
    data = to_device(Problem(x.data, None, None)).q
    return cupyflash.FP8KVCache(data, cupy.asarray(x.scale), x.scaling)


def device_problem(p: Problem) -> Problem:
    """CuPy copies of a NumPy FP8 problem (holders included)."""
    d = to_device(Problem(p.q, None, None, p.k, p.v, p.options))
    return Problem(d.q, holder_to_device(p.k_cache), holder_to_device(p.v_cache), d.k, d.v, d.options)


def check_fp8_on_gpu(p: Problem, call=run, naive_factor=2):
    """``call`` on CuPy copies of the NumPy problem p, held to the reference: the caches after the append as
    check_fp8 holds the CPU path's (codes and scales bit for bit; rotated keys within one e4m3 step), and out and lse
    against the float64 reference on the caches' values after the call by the 16-bit accuracy rule (out within
    ``naive_factor`` times the error of a naive attention in q's dtype on the values rounded to it; lse to float32
    accuracy: the kernel multiplies exact 16-bit values and applies the scales in float32). p's holders get the
    GPU's caches. Returns out, lse on the host."""
    before = snapshot(p)
    options = {name: x for name, x in before.options.items() if name not in REFERENCE_IGNORES}
    _, _, ref_k_cache, ref_v_cache = reference.attention_with_kvcache(
        before.q, before.k_cache, before.v_cache, before.k, before.v, return_lse=True, return_caches=True, **options
    )
    d = device_problem(p)
    out, lse = call(d)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    for host, device in ((p.k_cache, d.k_cache), (p.v_cache, d.v_cache)):
        host.data[...] = device.data.get()
        host.scale[...] = device.scale.get()
    rotated = "rotary_cos" in p.options
    compare_caches("k_cache", p.k_cache, ref_k_cache, rotated)
    compare_caches("v_cache", p.v_cache, ref_v_cache, False)
    expected, expected_lse = attention_after(p)
    assert (out.dtype, lse.dtype) == (p.q.dtype, np.float32), f"out {out.dtype}, lse {lse.dtype}"
    out, lse = to_host(out), to_host(lse)
    values = [x.dequantize(np.float64) for x in (p.k_cache, p.v_cache)]
    naive_out, _ = naive(before, *values)
    seen = np.isfinite(expected_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen, err_msg="lse is -inf for other rows than the reference")
    assert not out[~seen].any(), "a row that sees no key has a nonzero out"
    if seen.any():
        assert_close("out", out[seen], expected[seen], naive_out[seen], p.q.dtype, naive_factor)
        assert_lse_close(lse[seen], expected_lse[seen], lse_atol(p.q.dtype, p.options.get("softcap")))
    return out, lse
