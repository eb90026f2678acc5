"""Tensors of more than 2^31 elements, where 32-bit index math would overflow. Needs a GPU with >= 40 GiB free:

    python -m pytest -m huge tests/gpu/test_huge.py        # ~1 minute on an H200

Two problems, each cheap in FLOPs and a few GB per tensor:

- ``rows``: q of shape (1, 1, 2^24 + 2^16 + 3, 128) float16, 2^31 + 2^23 + 384 elements, against 200 keys.
  Rows from 2^23 on lie past 2^31 bytes, rows from 2^24 on past 2^31 elements. Checked two ways:
  (1) a few hundred rows (the first, random ones, those around 2^23 and 2^24, the last 300) against the
  float64 NumPy reference under the project's rule (tests/helpers/checks.py): out, lse and dq of a row depend only on
  that row of q and dout, so the reference on the row subset is exact for them;
  (2) every row, in chunks of 2^19 rows, against float64 CuPy on the GPU: out, lse and dq row by row, and
  dk, dv as the full sums over all 16.8M rows, which no row subset gives. A float64 sum of that length is
  exact to ~1e-13 relative, far below what is checked: every element of out, dq, dk, dv within
  ``COARSE`` units of float16 roundoff of that tensor's largest magnitude (plus dk's and dv's own rounding),
  lse within the rule's LSE_RTOL. The kernels round P and dS to float16 for their tensor-core products and
  accumulate dk, dv over 2^19 query blocks in float32; the expected errors are ~10x below that bound, while
  any row read from or written to the wrong place is off by O(1) of the largest magnitude.
- ``batch``: q (2049, 16, 520, 128) and k, v (2049, 16, 600, 128) bfloat16, causal: 2.18e9 and 2.52e9
  elements, 32,784 batch entries. The entries around each 2^31-byte and 2^31-element boundary of q and of
  k/v, the first, the last and random ones are checked against the NumPy reference under the project's rule
  (each entry is independent: all of its results are exact on the subset).

Every output is allocated filled with NaN (helpers.gpu), and each test counts the NaN left anywhere.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import LSE_RTOL, assert_close, assert_lse_close, naive_attention, to_host
from helpers.gpu import nan_filled_allocations

import cupyflash
from cupyflash import reference

cupy = pytest.importorskip("cupy")

pytestmark = [pytest.mark.gpu, pytest.mark.huge]

GIB = 2**30
MIN_FREE_BYTES = 40 * GIB
INT32_LIMIT = 2**31
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
COARSE = 16  # units of roundoff of the largest magnitude: the every-row bound (module docstring)
CHUNK_ROWS = 2**19  # float64 reference chunk: ~10 GB of temporaries with 200 keys
FILL_CHUNK = 2**26  # elements drawn at a time when filling a huge tensor


# ----------------------------------------------------------------------------- helpers
def _require_free_memory(nbytes):
    """Skip unless max(40 GiB, nbytes) is free on the current GPU (after emptying CuPy's pool)."""
    cupy.get_default_memory_pool().free_all_blocks()
    free, _ = cupy.cuda.runtime.memGetInfo()
    need = max(MIN_FREE_BYTES, nbytes)
    if free < need:
        pytest.skip(f"needs {need / GIB:.1f} GiB of free GPU memory; {free / GIB:.1f} GiB are free")


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    cupy.get_default_memory_pool().free_all_blocks()


def _bf16_bits(values):
    """float32 -> bfloat16 bit patterns, round to nearest even (finite values), with integer ops only."""
    u = values.view(cupy.uint32)
    return ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)


def _fill_normal(x, seed):
    """Fill the contiguous float16/bfloat16 array x with standard-normal values, FILL_CHUNK at a time."""
    state = cupy.random.RandomState(seed)
    flat = x.reshape(-1)
    bits = flat.view(cupy.uint16)
    for start in range(0, flat.size, FILL_CHUNK):
        stop = min(flat.size, start + FILL_CHUNK)
        values = state.standard_normal(stop - start, dtype=cupy.float32)
        if x.dtype == np.float16:
            flat[start:stop] = values.astype(cupy.float16)
        else:
            bits[start:stop] = _bf16_bits(values)
    return x


def _huge(shape, dtype, seed):
    return _fill_normal(cupy.empty(shape, dtype=dtype), seed)


def _small(rng, shape, dtype):
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def _nan_count(x):
    """NaN elements of a float16/bfloat16/float32 CuPy array, by bit pattern (no bfloat16 arithmetic)."""
    if x.dtype == np.float32:
        return int(cupy.isnan(x).sum())
    bits = x.view(cupy.uint16) & cupy.uint16(0x7FFF)
    infinity = 0x7C00 if x.dtype == np.float16 else 0x7F80
    return int((bits > infinity).sum())


def _max_or_inf(x):
    """max of a CuPy array as a float; inf if it holds NaN (Python's max() would drop a NaN)."""
    value = float(x.max())
    return math.inf if math.isnan(value) else value


def _check_subset(name_of_problem, dtype, q, k, v, dout, ours, *, causal):
    """Results ``ours`` = (out, lse, dq, dk, dv) on a subset of independent rows or entries, against the NumPy
    float64 reference and the accuracy rule (a naive same-dtype implementation on the same subset)."""
    host = [to_host(x) for x in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention(*host[:3], causal=causal, return_lse=True)
    ref_grads = reference.attention_backward(host[3], *host[:3], causal=causal)
    naive = naive_attention(q, k, v, dout, causal=causal, round_scaled_scores=False)
    out, lse, dq, dk, dv = ours
    assert_lse_close(to_host(lse), ref_lse)
    named = zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads), naive)
    for name, x, ref, naive_x in named:
        if x is None:
            continue
        assert_close(f"{name_of_problem}: {name}", to_host(x), ref, to_host(naive_x), dtype)


# ----------------------------------------------------------------------------- huge row count
ROWS_NQ, ROWS_NK, ROWS_D = 2**24 + 2**16 + 3, 200, 128


def _sampled_rows(rng, nq, d, itemsize):
    """The first rows, random ones, those around the 2^31-byte and 2^31-element boundaries, the last 300."""
    byte_row, element_row = INT32_LIMIT // (d * itemsize), INT32_LIMIT // d
    rows = np.concatenate(
        [
            np.arange(64),
            rng.choice(nq, 256, replace=False),
            np.arange(byte_row - 3, byte_row + 3),
            np.arange(element_row - 3, element_row + 3),
            np.arange(nq - 300, nq),
        ]
    )
    return np.unique(rows)


def _all_rows_errors(q, k, v, dout, out, lse, dq):
    """Every row against float64 CuPy, chunk by chunk; dk and dv as float64 sums over all rows.
    Returns {name: (max error, max |reference|)} for out, lse, dq and the float64 dk, dv."""
    nq, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d)
    k64, v64 = k[0, 0].astype(cupy.float64), v[0, 0].astype(cupy.float64)
    dk64 = cupy.zeros(k64.shape, dtype=cupy.float64)
    dv64 = cupy.zeros(v64.shape, dtype=cupy.float64)
    stats = {name: [0.0, 0.0] for name in ("out", "lse", "dq")}
    for start in range(0, nq, CHUNK_ROWS):
        rows = slice(start, min(nq, start + CHUNK_ROWS))
        qc, doc = q[0, 0, rows].astype(cupy.float64), dout[0, 0, rows].astype(cupy.float64)
        s = (qc @ k64.T) * scale
        m = s.max(axis=1, keepdims=True)
        e = cupy.exp(s - m)
        del s
        total = e.sum(axis=1, keepdims=True)
        p = e / total
        del e
        lse_ref = (m + cupy.log(total))[:, 0]
        out_ref = p @ v64
        dp = doc @ v64.T
        ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
        del dp
        dq_ref = (ds @ k64) * scale
        dk64 += (ds.T @ qc) * scale
        dv64 += p.T @ doc
        del p, ds
        for name, x, ref in (
            ("out", out[0, 0, rows], out_ref),
            ("lse", lse[0, 0, rows], lse_ref),
            ("dq", dq[0, 0, rows], dq_ref),
        ):
            error = _max_or_inf(cupy.abs(x.astype(cupy.float64) - ref))
            stats[name][0] = max(stats[name][0], error)
            stats[name][1] = max(stats[name][1], float(cupy.abs(ref).max()))
    return {name: tuple(value) for name, value in stats.items()}, dk64, dv64


def _rows_problem():
    """Run the huge-row problem; return only small host-side results (so a failure frees the GPU)."""
    rng = np.random.default_rng(6)
    dtype = np.float16
    q = _huge((1, 1, ROWS_NQ, ROWS_D), dtype, seed=1)
    dout = _huge((1, 1, ROWS_NQ, ROWS_D), dtype, seed=2)
    k, v = (_small(rng, (1, 1, ROWS_NK, ROWS_D), dtype) for _ in range(2))
    with nan_filled_allocations():
        out, lse = cupyflash.attention_forward(q, k, v)
        dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse)
    cupy.cuda.Device().synchronize()
    nans = {name: _nan_count(x) for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}

    rows = cupy.asarray(_sampled_rows(rng, ROWS_NQ, ROWS_D, np.dtype(dtype).itemsize))
    # (q, k, v, dout) and our (out, lse, dq) of the sampled rows, on the host
    sampled = (
        [x.get() for x in (q[0, 0, rows], k[0, 0], v[0, 0], dout[0, 0, rows])],
        [x[0, 0, rows].get() for x in (out, lse, dq)],
    )

    stats, dk64, dv64 = _all_rows_errors(q, k, v, dout, out, lse, dq)
    sums = {name: (x[0, 0].get(), ref.get()) for name, x, ref in (("dk", dk, dk64), ("dv", dv, dv64))}
    return nans, sampled, stats, sums


def test_huge_row_count():
    """q (1, 1, 2^24 + 2^16 + 3, 128) float16: > 2^31 elements in one batch entry (module docstring)."""
    element_bytes = ROWS_NQ * ROWS_D * 2
    _require_free_memory(4 * element_bytes + 12 * GIB)  # q, dout, out, dq + the float64 chunks
    assert ROWS_NQ * ROWS_D > INT32_LIMIT
    nans, sampled, stats, sums = _rows_problem()

    assert not any(nans.values()), f"NaN left in the results (never written, or computed): {nans}"
    dtype = np.float16
    inputs, (out_s, lse_s, dq_s) = sampled
    q, k, v, dout = (cupy.asarray(x) for x in inputs)  # naive_attention runs on the GPU
    _check_subset("sampled rows", dtype, q, k, v, dout, (out_s, lse_s, dq_s, None, None), causal=False)

    unit = UNIT_ROUNDOFF["float16"]
    for name in ("out", "dq"):
        error, size = stats[name]
        bound = COARSE * unit * size
        assert error <= bound, f"every row: {name} max error {error:.3g} > {bound:.3g} (max|ref| {size:.3g})"
    error, size = stats["lse"]
    bound = LSE_RTOL * max(1.0, size)
    assert error <= bound, f"every row: lse max error {error:.3g} > {bound:.3g}"
    for name, (ours, ref) in sums.items():
        size = float(np.abs(ref).max())
        rounding = float(np.abs(ref.astype(dtype).astype(np.float64) - ref).max())
        bound = rounding + COARSE * unit * size
        error = float(np.abs(ours.astype(np.float64) - ref).max())
        assert error <= bound, (
            f"{name} (sum over {ROWS_NQ} rows): max error {error:.3g} > {bound:.3g} "
            f"(max|ref| {size:.3g}, rounding {rounding:.3g})"
        )


# ----------------------------------------------------------------------------- huge batch count
BATCH_SHAPE, BATCH_NQ, BATCH_NK, BATCH_D = (2049, 16), 520, 600, 128


def _sampled_entries(rng, entries):
    """Flat batch entries: around each 2^31-byte and 2^31-element boundary of q and of k/v, first, last,
    and random ones."""
    picks = [0, 1, entries - 3, entries - 2, entries - 1, *rng.choice(entries, 6, replace=False)]
    for n in (BATCH_NQ, BATCH_NK):
        for unit_bytes in (2, 1):  # bytes (bfloat16) and elements
            boundary = INT32_LIMIT // (n * BATCH_D * unit_bytes)
            picks += [boundary - 1, boundary, boundary + 1]
    return np.unique(np.clip(picks, 0, entries - 1))


def _entries(x, idx, row_dims=2):
    """The flat batch entries ``idx`` of x (batch..., then ``row_dims`` dims: (N, D), or (N,) for lse),
    gathered as raw words, so that no bfloat16 arithmetic is needed."""
    words = x.view(cupy.uint16) if x.dtype.itemsize == 2 else x
    return words.reshape((-1,) + x.shape[x.ndim - row_dims :])[idx].view(x.dtype)


def _batch_problem():
    rng = np.random.default_rng(7)
    dtype = ml_dtypes.bfloat16
    q = _huge(BATCH_SHAPE + (BATCH_NQ, BATCH_D), dtype, seed=3)
    k = _huge(BATCH_SHAPE + (BATCH_NK, BATCH_D), dtype, seed=4)
    v = _huge(BATCH_SHAPE + (BATCH_NK, BATCH_D), dtype, seed=5)
    dout = _huge(BATCH_SHAPE + (BATCH_NQ, BATCH_D), dtype, seed=6)
    with nan_filled_allocations():
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
        dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    nans = {name: _nan_count(x) for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}
    idx = cupy.asarray(_sampled_entries(rng, math.prod(BATCH_SHAPE)))
    inputs = [_entries(x, idx).get() for x in (q, k, v, dout)]
    ours = [_entries(x, idx, 1 if x is lse else 2).get() for x in (out, lse, dq, dk, dv)]
    return nans, idx.get(), inputs, ours


def test_huge_batch_count():
    """32,784 batch entries of (520 x 600) causal bfloat16: q, k, v, out and the gradients all exceed 2^31
    elements; sampled entries (module docstring) against the reference."""
    entries = math.prod(BATCH_SHAPE)
    q_bytes, kv_bytes = entries * BATCH_NQ * BATCH_D * 2, entries * BATCH_NK * BATCH_D * 2
    _require_free_memory(4 * q_bytes + 4 * kv_bytes + 8 * GIB)  # + the NaN scan's temporaries
    assert entries * BATCH_NQ * BATCH_D > INT32_LIMIT and entries * BATCH_NK * BATCH_D > INT32_LIMIT
    nans, idx, inputs, ours = _batch_problem()

    assert not any(nans.values()), f"NaN left in the results (never written, or computed): {nans}"
    q, k, v, dout = (cupy.asarray(x) for x in inputs)
    out, lse, dq, dk, dv = ours
    _check_subset(f"entries {idx.tolist()}", ml_dtypes.bfloat16, q, k, v, dout, (out, lse, dq, dk, dv), causal=True)
