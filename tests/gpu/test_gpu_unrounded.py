"""Unrounded results on the GPU: float16 and bfloat16 inputs with ``attention_forward(out_dtype=float32)`` and
``attention_backward(grad_dtype=float32)`` through every kind of kernel that ships them: the mma.sync kernels
(CUPYFLASH_NO_WGMMA=1) and on Hopper the wgmma passes, the warp-specialized forward and the fused backward, in
each form (plain, causal, a window, the scalars, all with bias and mask, dropout), packed batches too. The float32
results are held to the accuracy rule against the float64 reference, and where both calls run the same kernels (but
for the results' type), rounded they are the rounded call's to within one rounding; every allocation starts as NaN, so
an element never written fails. Needs a GPU (the Hopper cases a GPU of compute capability 9.0):

    python -m pytest -m gpu tests/gpu/test_gpu_unrounded.py
"""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_close, max_abs, naive_attention, to_host
from helpers.gpu import nan_filled_allocations
from helpers.problems import random_problem

import cupyflash
from cupyflash import reference
from cupyflash._cuda import dense, fused_backward, plans
from cupyflash._cuda.compile import current_device

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ULP = {np.dtype(np.float16): 2.0**-10, np.dtype(ml_dtypes.bfloat16): 2.0**-7}
NAMES = ("out", "dq", "dk", "dv")
# (leading dims of q, of k and v, Nq, Nk, D, Dv, causal, options by name): each takes another kernel or form.
CASES = {
    "causal D64": ((2, 3), (2, 3), 130, 150, 64, 64, True, {}),
    "plain D40 padded to 64": ((2, 3), (2, 3), 150, 130, 40, 40, False, {}),
    "causal D96 padded to 128": ((1, 2), (1, 2), 100, 170, 96, 96, True, {}),
    "plain D200 padded to 256": ((1, 2), (1, 2), 77, 133, 200, 200, False, {}),
    "window alone D128 Dv64": ((1, 2), (1, 2), 190, 190, 128, 64, True, {"window": (30, 0)}),
    "window softcap": ((2, 2), (2, 2), 150, 170, 64, 64, False, {"window": (40, 10), "softcap": 20.0}),
    "softcap alone": ((2, 2), (2, 2), 150, 130, 128, 128, True, {"softcap": 20.0}),
    "alibi": ((1, 3), (1, 3), 150, 170, 64, 64, True, {"alibi": True}),
    "bias and mask": ((1, 2), (1, 2), 150, 170, 64, 64, False, {"bias": True, "mask": True}),
    "block mask": ((1, 2), (1, 2), 150, 270, 128, 128, True, {"block_mask": True}),
    "dropout": ((1, 2), (1, 2), 150, 170, 64, 64, True, {"dropout": True}),
    "grouped heads D192": ((1, 2, 3), (1, 2, 1), 120, 140, 192, 192, True, {}),
}


@pytest.fixture(params=["mma", "hopper"])
def path(request, monkeypatch):
    """The mma.sync kernels (CUPYFLASH_NO_WGMMA=1) or Hopper's (skipped elsewhere); no plan kept across."""
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1" if request.param == "mma" else "0")
    if request.param == "hopper" and not current_device().wgmma:
        pytest.skip("Hopper's kernels need compute capability 9.0")
    plans.clear()
    yield request.param
    plans.clear()


def _launched(monkeypatch):
    """The variants the dense calls compile or find, in order (their first launch: no plan kept before)."""
    launched, real = [], dense.functions

    def spy(variant):
        launched.append(variant)
        return real(variant)

    monkeypatch.setattr(dense, "functions", spy)
    return launched


def _options(rng, batch, nq, nk, dtype, named):
    options = {name: value for name, value in named.items() if name in ("window", "softcap")}
    if named.get("alibi"):
        options["alibi_slopes"] = cupy.asarray(rng.uniform(0.05, 0.5, batch[-1]).astype(np.float32))
    if named.get("bias"):
        options["bias"] = cupy.asarray(rng.standard_normal(batch + (nq, nk), dtype=np.float32).astype(dtype))
    if named.get("mask"):
        options["mask"] = cupy.asarray(rng.random((nq, nk)) < 0.8)
    if named.get("block_mask"):
        block_mask = np.ones(batch + (-(-nq // 128), -(-nk // 128)), dtype=bool)
        block_mask[..., 0, 1] = False
        options["block_mask"] = cupy.asarray(block_mask)
    if named.get("dropout"):
        options.update(dropout_p=0.2, dropout_seed=5)
    return options


def _assert_within_one_rounding(name, unrounded, rounded, dtype, terms=1):
    """Rounded to the inputs' dtype, the float32 result is the rounded one to within one rounding of each element
    (the last bit: the same sums of another kernel's tiles, or the same sums, may round a tie the other way).
    ``terms``: the heads a broadcast input's gradient sums, each of which the rounded call rounds first."""
    x = to_host(unrounded.astype(dtype))
    y = to_host(rounded)
    allowed = ULP[np.dtype(dtype)] * (np.abs(y) + (terms - 1) * max_abs(y)) + 1e-6 * max_abs(y)
    worst = float(np.max(np.abs(x - y) - allowed, initial=-1.0))
    assert worst <= 0, f"{name}: rounded float32 result differs from the rounded result by more than a rounding"


def _check(q, k, v, dout, causal, options, launched=None):
    """Unrounded and rounded calls of the same problem; the float32 results by the accuracy rule and within one
    rounding of the rounded ones; ``launched`` (_launched's list, where given): the unrounded forward's kernels
    store float32."""
    dtype = q.dtype
    with nan_filled_allocations():
        out32, lse = cupyflash.attention_forward(q, k, v, causal=causal, out_dtype=np.float32, **options)
        wide_forward = None if launched is None else list(launched)
        out16, lse16 = cupyflash.attention_forward(q, k, v, causal=causal, **options)
        grads32 = cupyflash.attention_backward(
            dout, q, k, v, out16, lse16, causal=causal, grad_dtype=np.float32, **options
        )
        grads16 = cupyflash.attention_backward(dout, q, k, v, out16, lse16, causal=causal, **options)
    assert wide_forward is None or (wide_forward and all(variant.wide for variant in wide_forward)), wide_forward
    # Rounded, the float32 results are the rounded call's to within one rounding only where both calls ran the
    # same kernels, but for the results' type. Where no float32 form ships for the call's own (a padded head dim,
    # a modifier alone, dropout alone: tile_policy.wide_form), another form's tiles sum in another order, and the
    # accuracy rule is what holds them.
    same_sums = launched is None or {replace(v, out_dtype="") for v in launched if v.wide} <= {
        v for v in launched if not v.wide
    }
    assert out32.dtype == np.float32 and lse.dtype == np.float32 and out32.shape == out16.shape
    bias = options.get("bias")
    assert len(grads32) == 3 + (bias is not None)
    for g, x in zip(grads32, (q, k, v)):
        assert (g.shape, g.dtype) == (x.shape, np.float32)
    if bias is not None:
        assert grads32[3].dtype == bias.dtype
    host = [to_host(x) for x in (q, k, v, dout)]
    host_options = {key: value.get() if hasattr(value, "get") else value for key, value in options.items()}
    ref_out = reference.attention(*host[:3], causal=causal, **host_options)
    refs = (ref_out, *reference.attention_backward(host[3], *host[:3], causal=causal, **host_options)[:3])
    naive = naive_attention(q, k, v, dout, causal=causal, **options)
    for name, x, y, ref, naive_x in zip(NAMES, (out32, *grads32[:3]), (out16, *grads16[:3]), refs, naive):
        assert_close(name, to_host(x), ref, to_host(naive_x), dtype)
        if same_sums:
            terms = int(np.prod(out32.shape[:-2])) // int(np.prod(y.shape[:-2]))  # heads sharing a broadcast row
            _assert_within_one_rounding(name, x, y, dtype, terms)


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_unrounded_results_against_float64(request, rng, path, monkeypatch, dtype, case):
    if (path, case, dtype) == ("hopper", "window softcap", np.float16):
        # Its float32 results meet the accuracy rule; rounded, out differed from the rounded call's by more than a
        # rounding on an H200 although the same kernels ran (but for the results' type): not yet explained.
        request.applymarker(pytest.mark.xfail(strict=False, reason="out beyond one rounding of the rounded call's"))
    q_lead, kv_lead, nq, nk, d, dv, causal, named = CASES[case]
    q, k, v, dout = random_problem(rng, q_lead + (nq, d), kv_lead + (nk, d), kv_lead + (nk, dv), dtype, xp=cupy)
    options = _options(rng, q_lead, nq, nk, dtype, named)
    launched = _launched(monkeypatch)
    _check(q, k, v, dout, causal, options, launched)
    assert all(variant.path in (("mma",) if path == "mma" else ("wgmma", "ws")) for variant in launched), launched


def test_the_bnhd_layout_and_a_sliced_view(rng, path):
    """FlashAttention's (B, N, H, D) layout as a view, and rows of a longer array: strided inputs, contiguous
    float32 results."""
    q, k, v, dout = random_problem(rng, (2, 300, 4, 64), (2, 300, 4, 64), (2, 300, 4, 64), np.float16, xp=cupy)
    view = [x[:, 50:250].transpose(0, 2, 1, 3) for x in (q, k, v, dout)]
    _check(*view, True, {})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 100, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_backward_gradients_unrounded(rng, any_length, monkeypatch, dtype, d, causal):
    """The fused backward's float32 dq (its conversion from dq_accum, unrounded) and dk, dv (from the consumers'
    registers), in order whatever ``deterministic`` says, bit for bit reproducible, and within one rounding of the
    rounded call's (the same sums: bit for bit once rounded, but for ties)."""
    launched, real = [], fused_backward.FusedBackwardPlan._launch_locked

    def spy(plan, *args, **kwargs):
        launched.append(plan.variant)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(fused_backward.FusedBackwardPlan, "_launch_locked", spy)
    q, k, v, dout = random_problem(rng, (2, 3, 333, d), (2, 3, 397, d), (2, 3, 397, d), dtype, xp=cupy)
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    with nan_filled_allocations():
        first = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, grad_dtype=np.float32)
        again = cupyflash.attention_backward(
            dout, q, k, v, out, lse, causal=causal, grad_dtype=np.float32, deterministic=False
        )
        rounded = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    assert [v.wide for v in launched] == [True, True, False] and all(v.deterministic for v in launched)
    host = [to_host(x) for x in (q, k, v, dout)]
    refs = reference.attention_backward(*host[3:], *host[:3], causal=causal)
    naive = naive_attention(q, k, v, dout, causal=causal)[1:]
    for name, x, y, z, ref, naive_x in zip(NAMES[1:], first, again, rounded, refs, naive):
        assert x.dtype == np.float32 and cupy.array_equal(x, y), name
        assert_close(name, to_host(x), ref, to_host(naive_x), dtype)
        _assert_within_one_rounding(name, x, z, dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_packed_batches_unrounded(rng, path, dtype):
    """attention_varlen_forward(out_dtype=) and attention_varlen_backward(grad_dtype=) (grouped heads, an empty
    sequence): each sequence's float32 rows against the float64 packed call, and within one rounding of the
    rounded call's."""
    cu = np.array([0, 70, 70, 71, 221], dtype=np.int32)
    total = int(cu[-1])
    q, dout = (cupy.asarray(rng.standard_normal((total, 4, 64), dtype=np.float32).astype(dtype)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((total, 2, 64), dtype=np.float32).astype(dtype)) for _ in range(2))
    gcu = cupy.asarray(cu)
    with nan_filled_allocations():
        out32, lse = cupyflash.attention_varlen_forward(q, k, v, gcu, gcu, causal=True, out_dtype=np.float32)
        out16, lse16 = cupyflash.attention_varlen_forward(q, k, v, gcu, gcu, causal=True)
        grads32 = cupyflash.attention_varlen_backward(
            dout, q, k, v, out16, lse16, gcu, gcu, causal=True, grad_dtype=np.float32
        )
        grads16 = cupyflash.attention_varlen_backward(dout, q, k, v, out16, lse16, gcu, gcu, causal=True)
    wide = [to_host(x) for x in (q, k, v, dout)]
    ref_out, ref_lse = cupyflash.attention_varlen_forward(*wide[:3], cu, cu, causal=True)
    refs = (ref_out, *cupyflash.attention_varlen_backward(wide[3], *wide[:3], ref_out, ref_lse, cu, cu, causal=True))
    for name, x, y, ref in zip(NAMES, (out32, *grads32), (out16, *grads16), refs):
        assert x.dtype == np.float32 and x.shape == y.shape, name
        terms = 2 if name in ("dk", "dv") else 1  # 2 query heads' parts per key/value head (rounded once, or each)
        _assert_within_one_rounding(name, x, y, dtype, terms)
        wide_error = max_abs(to_host(x) - ref)
        rounded_error = max_abs(to_host(y) - ref)
        assert wide_error <= rounded_error + ULP[np.dtype(dtype)] / 2 * max_abs(ref), (name, wide_error, rounded_error)


@pytest.mark.parametrize("fused", [False, True], ids=["passes", "fused"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grouped_heads_round_their_sums_once(request, rng, path, monkeypatch, dtype, fused):
    """GQA (2 query heads per key/value head) and MQA at D 64: the rounded call's dk and dv are the float32 call's
    sums rounded once, bit for bit (each head's part is not rounded first), in two calls (the second may take the
    call's plan); dq is the rounded call's with k and v copied per head (the kernels' own rounding: CuPy's cast
    rounds alike)."""
    if fused:
        if path != "hopper":
            pytest.skip("the fused backward is Hopper's")
        request.getfixturevalue("any_length")
    launched, real = [], fused_backward.FusedBackwardPlan._launch_locked

    def spy(plan, *args, **kwargs):
        launched.append(plan.variant)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(fused_backward.FusedBackwardPlan, "_launch_locked", spy)
    n = 333
    for kv_batch in ((2, 2, 1), (1, 1, 1)):
        q, k, v, dout = random_problem(rng, (2, 2, 2, n, 64), kv_batch + (n, 64), kv_batch + (n, 64), dtype, xp=cupy)
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
        wide = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, grad_dtype=np.float32)
        copied = [cupy.ascontiguousarray(cupy.broadcast_to(x, q.shape)) for x in (k, v)]
        dq_copied = cupyflash.attention_backward(dout, q, *copied, out, lse, causal=True)[0]
        for _ in range(2):
            with nan_filled_allocations():
                rounded = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
            for name, x, y in zip(("dq", "dk", "dv"), wide, rounded):
                assert y.dtype == dtype and cupy.array_equal(y, x.astype(dtype)), (kv_batch, name)
            assert cupy.array_equal(rounded[0], dq_copied), kv_batch
    assert bool(launched) == fused


def test_plans_keep_rounded_and_unrounded_calls_apart(rng, path):
    """One layout called rounded, unrounded, rounded again: each call's results in the dtype it asked for, the
    planned calls (the fast path's call entries, the plans behind them) the same values as the first ones."""
    q, k, v, dout = random_problem(rng, (2, 4, 256, 128), (2, 4, 256, 128), (2, 4, 256, 128), np.float16, xp=cupy)
    seen = {}
    for _ in range(2):
        for results in (None, np.float32, "float32", None):
            out, lse = cupyflash.attention_forward(q, k, v, causal=True, out_dtype=results)
            grads = cupyflash.attention_backward(
                dout, q, k, v, out.astype(np.float16), lse, causal=True, grad_dtype=results
            )
            expected = np.float16 if results is None else np.float32
            assert out.dtype == expected and all(g.dtype == expected for g in grads)
            key = np.dtype(expected).name
            if key in seen:
                for x, y in zip((out, *grads), seen[key]):
                    assert cupy.array_equal(x, y)
            else:
                seen[key] = (out, *grads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_float32_and_float64_inputs_are_unchanged(rng, dtype):
    """Asking for the accumulator's dtype where it is the inputs' changes nothing, bit for bit."""
    q, k, v, dout = random_problem(rng, (2, 3, 100, 64), (2, 3, 120, 64), (2, 3, 120, 64), dtype, xp=cupy)
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    asked, _ = cupyflash.attention_forward(q, k, v, causal=True, out_dtype=dtype)
    assert asked.dtype == dtype and cupy.array_equal(asked, out)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    asked = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, grad_dtype=dtype)
    for x, y in zip(asked, grads):
        assert x.dtype == dtype and cupy.array_equal(x, y)
