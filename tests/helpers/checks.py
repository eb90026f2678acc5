"""The accuracy rule every test holds results to, and the naive implementation it is measured against.

The rule is FlashAttention's: against a float64 reference computed from the very same inputs, our error in
float16/bfloat16 must be at most twice the error of a naive implementation in that dtype, plus the error of
rounding the reference itself to that dtype (as FlashAttention-3's tests add: a perfect implementation has
that much, while the naive may round its worst element luckily). In float32 the error must be at most 1e-5
of the reference's largest magnitude. Errors are max|x - ref|, on the same scale for ours and the naive. A
result that is exactly 0 everywhere (dq and dk when Nk == 1) gets an absolute bound.

Everything here takes NumPy or CuPy arrays and imports no CuPy of its own (``cupyflash._arrays.cupy`` is None
without it).
"""

import math

import numpy as np

from cupyflash import reference
from cupyflash._arrays import cupy, is_cupy, sum_to_shape
from cupyflash._modifiers import BLOCK_MASK_TILE

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
TANH_APPROX_RTOL = 2.0**-10
NAMES = ("out", "lse", "dq", "dk", "dv")


def array_module(x):
    """cupy for a CuPy array, else numpy."""
    return cupy if is_cupy(x) else np


def to_host(x):
    """float64 NumPy copy of a NumPy or CuPy array (bfloat16 included)."""
    if is_cupy(x):
        x = x.get()
    return np.asarray(x, dtype=np.float64)


def on_host(x):
    """An option as NumPy sees it: CuPy arrays copied off the GPU; pairs, floats and NumPy arrays as they are."""
    return x.get() if is_cupy(x) else x


def bits(x):
    """The array's memory as unsigned integers (NumPy or CuPy): compares bit for bit, NaN and bfloat16
    included."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def same_bits(x, y):
    """Whether two arrays of one type hold the same bits (NaN payloads included)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return bool(array_module(x).array_equal(bits(x), bits(y)))


def assert_bitwise_equal(xs, ys, names=NAMES):
    for name, x, y in zip(names, xs, ys):
        assert same_bits(x, y), f"{name} differs"


def max_abs(x):
    return float(np.max(np.abs(x), initial=0))


# A blocked schedule (the ring) against its single call: a max error moves with the order of the sums even for one
# GPU against itself, a norm of every element's error does not (docs/design/distributed.md, Exactness).
BLOCKED_NORM_RATIO = 1.10
BLOCKED_MAX_RATIO = 2.0


def assert_as_exact_as_the_single_call(names, blocked, single, exact, dtype, chunks=1):
    """Each result of ``blocked`` against the float64 ``exact``, beside ``single``'s: in each of ``chunks`` equal
    runs of rows (the sequence axis: lse's last, the others' second to last; a ring's shards, so that rows one
    block computes alone do not dilute those it merges), a relative Frobenius error at most BLOCKED_NORM_RATIO
    times the single call's, and over all rows a max error at most BLOCKED_MAX_RATIO times. Where the single
    call's error is float32 (float64) noise, as lse's and float32's are, 1e-6 (1e-13) of the reference's norm or
    largest magnitude stands for it; a run whose reference is all zeros is held to ZERO_ATOL. Non-finite
    reference values (lse of rows without keys) must be matched exactly. Returns (worst run's norm ratio, max
    ratio) per result."""
    assert len(names) == len(blocked) == len(single) == len(exact), (names, len(blocked), len(single), len(exact))
    tiny = 1e-13 if np.dtype(dtype) == np.float64 else 1e-6
    ratios = []
    for name, x, y, ref in zip(names, blocked, single, exact):
        x, y, ref = (np.array(to_host(a)) for a in (x, y, ref))  # copies: non-finite entries are zeroed below
        assert x.shape == y.shape == ref.shape, (name, x.shape, y.shape, ref.shape)
        unseen = ~np.isfinite(ref)
        for a in (x, y):
            assert np.array_equal(a[unseen], ref[unseen]), f"{name}: non-finite values differ from the reference's"
            a[unseen] = 0.0
        ref = np.where(unseen, 0.0, ref)
        peak = [max_abs(a - ref) for a in (x, y)]
        max_ratio = peak[0] / max(peak[1], tiny * max(1.0, max_abs(ref)))
        assert max_ratio <= BLOCKED_MAX_RATIO, (
            f"{name}: max error {peak[0]:.3g} is {max_ratio:.2f}x the single call's {peak[1]:.3g}"
        )
        axis = -1 if name == "lse" else -2
        norm_ratio = 0.0
        for i, (xc, yc, rc) in enumerate(zip(*(np.array_split(a, chunks, axis=axis) for a in (x, y, ref)))):
            size = float(np.linalg.norm(rc))
            if size == 0.0:
                assert max_abs(xc) <= ZERO_ATOL, f"{name}, rows {i} of {chunks}: {max_abs(xc):.3g} where all is 0"
                continue
            norm = [float(np.linalg.norm(a - rc)) / size for a in (xc, yc)]
            run_ratio = norm[0] / max(norm[1], tiny)
            assert run_ratio <= BLOCKED_NORM_RATIO, (
                f"{name}, rows {i} of {chunks}: relative Frobenius error {norm[0]:.3g} is {run_ratio:.3f}x the "
                f"single call's {norm[1]:.3g}"
            )
            norm_ratio = max(norm_ratio, run_ratio)
        ratios.append((norm_ratio, max_ratio))
    return ratios


def lse_atol(dtype, softcap):
    """What a softcap adds to lse's bound: softcap * TANH_APPROX_RTOL for 16-bit inputs, else 0."""
    return float(softcap or 0.0) * TANH_APPROX_RTOL if np.dtype(dtype).itemsize == 2 else 0.0


def assert_close(name, x, ref, naive, dtype, naive_factor=NAIVE_FACTOR):
    """Host arrays: ours ``x``, the float64 ``ref`` and the ``naive`` same-dtype result, by the rule above
    (``naive_factor``: the multiple of the naive's error allowed, where a test says why it is not 2)."""
    assert not np.isnan(x).any(), f"{name} has NaN (an element never written, or a 0/0)"
    error, size = max_abs(x - ref), max_abs(ref)
    if size == 0:
        bound, detail = ZERO_ATOL, "the exact result is 0"
    elif np.dtype(dtype) == np.float32:
        bound, detail = FP32_RTOL * size, f"relative error {error / size:.3g}, max|ref| {size:.3g}"
    else:
        naive_error = max_abs(naive - ref)
        rounding = max_abs(ref.astype(dtype).astype(np.float64) - ref)
        bound = naive_factor * naive_error + rounding
        detail = f"naive error {naive_error:.3g}, ref rounding {rounding:.3g}, max|ref| {size:.3g}"
    dtype_name = np.dtype(dtype).name
    assert error <= bound, f"{name} ({dtype_name}): max error {error:.3g} > bound {bound:.3g} ({detail})"


def assert_lse_close(lse, ref, atol=0.0):
    """lse is float32 from exact inputs in every dtype, so it is held to float32 accuracy (plus ``atol``:
    lse_atol's allowance for the 16-bit softcap's tanh)."""
    assert not np.isnan(lse).any(), "lse has NaN"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref)), "lse is -inf for other rows than the reference"
    seen = np.isfinite(ref)
    error = max_abs(lse[seen] - ref[seen])
    bound = LSE_RTOL * max(1.0, max_abs(ref[seen])) + atol
    assert error <= bound, f"lse: max error {error:.3g} > bound {bound:.3g}"


def assert_matches_reference(
    q, k, v, dout, results, *, causal, scale=None, round_scaled_scores=True, naive_factors=None, **options
):
    """``results`` = (out, lse, dq, dk, dv[, dbias]) of the public functions with ``options`` (score
    modifiers, dropout) against the float64 reference, by the rule above; the naive implementation gets
    ``round_scaled_scores`` (see naive_attention); ``naive_factors`` (result name -> factor) replaces
    NAIVE_FACTOR where a test says why. Types, shapes and dtypes are checked first; dbias is held to the
    inputs' precision too (a float32 bias does not make float16 scores exact)."""
    bias = options.get("bias")
    out, lse, dq, dk, dv, *rest = results
    assert len(rest) == (bias is not None), f"{len(results)} results; dbias is returned iff bias is given"
    xp = array_module(q)
    named = [
        (name, x, like, q.dtype) for name, x, like in (("out", out, dout), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v))
    ]
    if bias is not None:
        named.append(("dbias", rest[0], bias, bias.dtype))
    for name, x, like, dtype in named:
        assert isinstance(x, xp.ndarray), f"{name} is a {type(x)}, expected {xp.__name__}.ndarray"
        assert (x.shape, x.dtype) == (like.shape, dtype), f"{name}: {x.shape} {x.dtype}"
    assert (lse.shape, lse.dtype) == (out.shape[:-1], np.float32), f"lse: {lse.shape} {lse.dtype}"

    host = [to_host(x) for x in (q, k, v, dout)]
    host_options = {name: on_host(x) for name, x in options.items()}
    ref_out, ref_lse = reference.attention(*host[:3], causal=causal, scale=scale, return_lse=True, **host_options)
    ref_grads = reference.attention_backward(host[3], *host[:3], causal=causal, scale=scale, **host_options)
    naive = naive_attention(
        q, k, v, dout, causal=causal, scale=scale, round_scaled_scores=round_scaled_scores, **options
    )

    assert_lse_close(to_host(lse), ref_lse, lse_atol(q.dtype, options.get("softcap")))
    for (name, x, *_), ref, naive_x in zip(named, (ref_out, *ref_grads), naive):
        assert_close(name, to_host(x), ref, to_host(naive_x), q.dtype, (naive_factors or {}).get(name, NAIVE_FACTOR))


def naive_attention(q, k, v, dout, *, causal, scale=None, round_scaled_scores=True, **options):
    """Forward and backward the obvious way in q's dtype, for NumPy or CuPy, with every score modifier and
    dropout: returns out, dq, dk, dv and, with a bias, dbias (summed over its broadcast dims in float32,
    then rounded to its dtype).

    "In that dtype" means what a framework's float16 ops do: each matmul accumulates in float32 and rounds
    its result to the dtype, and softmax computes in float32 from dtype inputs and rounds its result. We
    emulate exactly that (compute in float32, round after every op), which also works for bfloat16, whose
    NumPy matmul would otherwise return float32. ``round_scaled_scores``: the product ``scale * (q k^T)`` is
    an op of its own, rounded to the dtype (the modifiers' tests); False folds the scale into the softmax's
    float32 input instead, as a fused ``softmax(scale * s)`` does (the plain tests' naive). The dropout mask
    (``dropout_p``, ``dropout_seed``) is the reference's.
    """
    xp = array_module(q)
    dtype = q.dtype

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    options = dict(options)
    dropout_p, dropout_seed = options.pop("dropout_p", 0.0), options.pop("dropout_seed", None)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    qf, kf, vf = (xp.broadcast_to(x, batch + x.shape[-2:]).astype(xp.float32) for x in (q, k, v))
    dout = dout.astype(xp.float32)
    s, tanh = _naive_scores(qf, kf, scale, causal, rounded, round_scaled_scores, options)
    p = rounded(_softmax(s))

    def drop(x):  # x * Z / (1 - p), in the dtype
        if not dropout_p:
            return x
        keep = xp.asarray(reference.dropout_mask(dropout_p, dropout_seed, x.shape))
        return rounded(xp.where(keep, x / xp.float32(1 - dropout_p), 0))

    out = rounded(drop(p) @ vf)
    dv = rounded(_transpose(drop(p)) @ dout)
    dp = drop(rounded(dout @ _transpose(vf)))
    ds = rounded(p * (dp - xp.sum(p * dp, axis=-1, keepdims=True)))
    ds_scaled = ds if tanh is None else rounded(ds * (1 - tanh * tanh))
    dq = rounded(scale * rounded(ds_scaled @ kf))
    dk = rounded(scale * rounded(_transpose(ds_scaled) @ qf))
    grads = [sum_to_shape(g.astype(dtype), x.shape) for g, x in ((dq, q), (dk, k), (dv, v))]
    bias = options.get("bias")
    if bias is not None:
        grads.append(sum_to_shape(ds, bias.shape).astype(bias.dtype))
    return (out.astype(dtype), *grads)


def _naive_scores(qf, kf, scale, causal, rounded, round_scaled_scores, options):
    """The modified, masked scores in the naive's precision, and tanh(x / softcap) or None."""
    xp = array_module(qf)
    s = scale * rounded(qf @ _transpose(kf))
    if round_scaled_scores:
        s = rounded(s)
    tanh = None
    softcap = options.get("softcap", 0.0)
    if softcap:
        tanh = rounded(xp.tanh(s / softcap))
        s = rounded(softcap * tanh)
    nq, nk = s.shape[-2:]
    distance = xp.abs(xp.arange(nk)[None, :] - xp.arange(nq)[:, None] - (nk - nq)).astype(xp.float32)
    if options.get("alibi_slopes") is not None:
        s = rounded(s - options["alibi_slopes"].astype(xp.float32)[..., None, None] * distance)
    if options.get("bias") is not None:
        s = rounded(s + options["bias"].astype(xp.float32))
    hidden = xp.asarray(hidden_keys(s.shape[:-2], nq, nk, causal, **{n: on_host(x) for n, x in options.items()}))
    return xp.where(hidden, -xp.inf, s), tanh


def hidden_keys(batch, nq, nk, causal, *, window=None, mask=None, block_mask=None, **_):
    """Bool NumPy (*batch, Nq, Nk): True where key j is hidden from query i (_modifiers' rules, written
    afresh)."""
    i = np.arange(nq)[:, None] + (nk - nq)  # the query's diagonal position among the keys
    j = np.arange(nk)[None, :]
    hidden = np.broadcast_to((j > i) if causal else np.zeros((nq, nk), bool), tuple(batch) + (nq, nk))
    left, right = (-1, -1) if window is None else window
    if left != -1:
        hidden = hidden | (j < i - left)
    if right != -1:
        hidden = hidden | (j > i + right)
    if mask is not None:
        hidden = hidden | ~mask
    if block_mask is not None:
        tiles = np.repeat(np.repeat(block_mask, BLOCK_MASK_TILE, axis=-2), BLOCK_MASK_TILE, axis=-1)
        hidden = hidden | ~tiles[..., :nq, :nk]
    return np.broadcast_to(hidden, tuple(batch) + (nq, nk))


def _softmax(s):
    xp = array_module(s)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -xp.inf, 0, m)  # rows that see no key: exp(-inf) = 0 everywhere, not NaN
    e = xp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    return e / xp.where(total > 0, total, 1)


def _transpose(x):
    return x.swapaxes(-1, -2)


def numerical_gradient(loss, x, step=1e-6):
    """Central differences of the scalar loss() with respect to every element of the float64 array x
    (perturbed in place and restored): truncation ~ step^2, rounding ~ 1e-16 / step."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        original = x[index]
        x[index] = original + step
        above = loss()
        x[index] = original - step
        below = loss()
        x[index] = original
        grad[index] = (above - below) / (2 * step)
    return grad


def assert_rows_without_keys_are_zero(out, lse, dq, dk, dv, blind_rows):
    """The first ``blind_rows`` query rows (dim 1) see no key: out and dq 0, lse -inf; every result finite
    elsewhere (NumPy or CuPy arrays)."""
    xp = array_module(out)
    blind = slice(0, blind_rows)
    assert not out[:, blind].any(), "out is not 0 on rows that see no key"
    assert xp.isneginf(lse[:, blind]).all(), "lse is not -inf on rows that see no key"
    assert not dq[:, blind].any(), "dq is not 0 on rows that see no key"
    assert xp.isfinite(lse[:, blind_rows:]).all(), "lse is not finite on rows that see keys"
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert xp.isfinite(x).all(), f"{name} is not finite"
