"""Variable-length packed batches in the CUDA kernels. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_varlen.py

Held to the accuracy rule (tests/helpers/checks.py) against the float64 reference
(``reference.attention_varlen``: the dense reference per sequence), the naive same-dtype implementation run
per sequence; and bit for bit against our own dense kernels run on each sequence alone. Every allocation is
poisoned with NaN (helpers.gpu).
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_close, assert_lse_close, lse_atol, naive_attention, same_bits, to_host
from helpers.gpu import nan_filled_allocations

import cupyflash
from cupyflash import reference
from cupyflash._cuda import dense, plans

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# Empty sequences, a single row, tile-straddling and multi-tile lengths; sequence 2 has queries but no key.
# (No sequence has exactly one key: its dK is 0 in exact arithmetic and float32 noise there, ~1e-5 of the
# other sequences' dK, would be judged against them; tests/gpu/test_gpu.py checks Nk = 1 on its own.)
LENGTHS_Q = [130, 0, 7, 1, 300, 64, 257]
LENGTHS_K = [129, 5, 0, 40, 300, 200, 3]


def _offsets(lengths):
    return cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _problem(rng, dtype, heads, kv_heads, d, dv, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    total_q, total_k = sum(lengths_q), sum(lengths_k)

    def draw(shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))

    return (
        draw((total_q, heads, d)),
        draw((total_k, kv_heads, d)),
        draw((total_k, kv_heads, dv)),
        draw((total_q, heads, dv)),
        cu_q,
        cu_k,
    )


def _run(q, k, v, dout, cu_q, cu_k, **options):
    with nan_filled_allocations():
        out, lse = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, **options)
        grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options)
    return (out, lse, *grads)


def _sequence(x, r0, r1, kv_heads):
    return x[r0:r1].transpose(1, 0, 2).reshape(kv_heads, x.shape[1] // kv_heads, r1 - r0, x.shape[2])


def _check(q, k, v, dout, cu_q, cu_k, results, *, causal, **options):
    """The accuracy rule: float64 reference; the naive same-dtype implementation per sequence."""
    out, lse, dq, dk, dv = results
    for name, x, like in (("out", out, dout), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert (x.shape, x.dtype) == (like.shape, q.dtype), f"{name}: {x.shape} {x.dtype}"
    host = [to_host(x) for x in (q, k, v, dout)]
    host_cu = [x.get() for x in (cu_q, cu_k)]
    host_options = {name: (x.get() if isinstance(x, cupy.ndarray) else x) for name, x in options.items()}
    ref_out, ref_lse = reference.attention_varlen(*host[:3], *host_cu, causal=causal, return_lse=True, **host_options)
    ref_grads = reference.attention_varlen_backward(host[3], *host[:3], *host_cu, causal=causal, **host_options)
    assert_lse_close(to_host(lse), ref_lse, lse_atol(q.dtype, options.get("softcap")))
    naive = [np.zeros(x.shape) for x in (ref_out, *ref_grads)]
    cq, ck, hk = host_cu[0], host_cu[1], k.shape[1]
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        parts = naive_attention(
            _sequence(q, q0, q1, hk),
            _sequence(k, k0, k1, hk),
            _sequence(v, k0, k1, hk),
            _sequence(dout, q0, q1, hk),
            causal=causal,
            **_sequence_options(options, s, len(cq) - 1, q.shape[1], hk),
        )
        n_out, n_dq, n_dk, n_dv = (to_host(x) for x in parts)
        naive[0][q0:q1] = n_out.reshape(q.shape[1], q1 - q0, -1).transpose(1, 0, 2)
        naive[1][q0:q1] = n_dq.reshape(q.shape[1], q1 - q0, -1).transpose(1, 0, 2)
        naive[2][k0:k1] = n_dk[:, 0].transpose(1, 0, 2)
        naive[3][k0:k1] = n_dv[:, 0].transpose(1, 0, 2)
    for name, x, ref, naive_x in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads), naive):
        assert_close(name, to_host(x), ref, naive_x, q.dtype)


def _sequence_options(options, s, batch, heads, kv_heads):
    """The options of sequence s alone: its slopes (broadcast to (batch, H)) as (Hk, G)."""
    options = dict(options)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = cupy.broadcast_to(options["alibi_slopes"], (batch, heads))[s].reshape(kv_heads, -1)
    return options


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", (40, 64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, dtype, head_dim, causal):
    problem = _problem(rng, dtype, 4, 2, head_dim, head_dim)
    _check(*problem, _run(*problem, causal=causal), causal=causal)


@pytest.mark.parametrize("form", ["int64", "list"])
def test_offsets_by_one_rule(rng, form):
    """cu_seqlens as int64 CuPy arrays or Python lists: the results of int32 arrays, bit for bit."""
    q, k, v, dout, cu_q, cu_k = _problem(rng, np.float16, 4, 2, 64, 64)
    given = [x.astype(cupy.int64) if form == "int64" else x.get().tolist() for x in (cu_q, cu_k)]
    for name, x, y in zip(
        ("out", "lse", "dq", "dk", "dv"),
        _run(q, k, v, dout, *given, causal=True),
        _run(q, k, v, dout, cu_q, cu_k, causal=True),
    ):
        assert same_bits(x, y), f"{name} differs with {form} offsets"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_mma_sync_path(rng, monkeypatch, dtype, causal):
    monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    problem = _problem(rng, dtype, 3, 3, 96, 64)
    _check(*problem, _run(*problem, causal=causal), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_with_window_softcap_and_alibi(rng, dtype):
    problem = _problem(rng, dtype, 4, 1, 64, 64)
    slopes = cupy.asarray(np.linspace(0.05, 0.4, 4, dtype=np.float32))
    options = dict(window=(50, 3), softcap=2.0, alibi_slopes=slopes)
    _check(*problem, _run(*problem, causal=True, **options), causal=True, **options)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_with_dropout_against_reference(rng, dtype):
    """The same mask as the reference's (flat index s * H + h); out and gradients within the float tolerance
    the naive gets without dropout (it has no mask of its own)."""
    q, k, v, dout, cu_q, cu_k = _problem(rng, dtype, 4, 2, 64, 64)
    options = dict(dropout_p=0.2, dropout_seed=123)
    out, lse, *grads = _run(q, k, v, dout, cu_q, cu_k, causal=True, **options)
    host = [to_host(x) for x in (q, k, v, dout)]
    cu = [x.get() for x in (cu_q, cu_k)]
    ref_out = reference.attention_varlen(*host[:3], *cu, causal=True, **options)
    ref_grads = reference.attention_varlen_backward(host[3], *host[:3], *cu, causal=True, **options)
    rtol = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3, np.dtype(ml_dtypes.bfloat16): 3e-2}[np.dtype(dtype)]
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        error = np.abs(to_host(x) - ref).max() / np.abs(ref).max()
        assert error <= 2 * rtol, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_bitwise_equal_to_the_dense_kernels_per_sequence(rng, dtype, monkeypatch):
    """Each sequence's rows are exactly what the dense kernels give for that sequence alone: the dense kernels
    packed batches share (float32: the mma.sync path, which packed batches take on every GPU; on Hopper dense
    float32 batches run on float16 pieces instead, equal to rounding. 16-bit on Hopper: the wgmma forward, where
    dense calls tensor maps can read take the warp-specialized one, which divides by other row sums)."""
    q, k, v, dout, cu_q, cu_k = _problem(rng, dtype, 4, 2, 64, 64)
    out, lse, dq, dk, dv = _run(q, k, v, dout, cu_q, cu_k, causal=True)
    if dtype == np.float32:
        monkeypatch.setenv("CUPYFLASH_NO_WGMMA", "1")
    monkeypatch.setattr(dense, "_tma_reads", lambda *args: False)
    plans.clear()
    cq, ck = cu_q.get(), cu_k.get()
    for s in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs, douts = (
            _sequence(q, q0, q1, 2),
            _sequence(k, k0, k1, 2),
            _sequence(v, k0, k1, 2),
            _sequence(dout, q0, q1, 2),
        )
        out_s, lse_s = cupyflash.attention_forward(qs, ks, vs, causal=True)
        dq_s, dk_s, dv_s = cupyflash.attention_backward(douts, qs, ks, vs, out_s, lse_s, causal=True)
        assert same_bits(out[q0:q1], out_s.reshape(4, q1 - q0, 64).transpose(1, 0, 2))
        assert same_bits(lse[:, q0:q1], lse_s.reshape(4, q1 - q0))
        assert same_bits(dq[q0:q1], dq_s.reshape(4, q1 - q0, 64).transpose(1, 0, 2))
        assert same_bits(dk[k0:k1], dk_s[:, 0].transpose(1, 0, 2))
        assert same_bits(dv[k0:k1], dv_s[:, 0].transpose(1, 0, 2))


def test_rows_of_a_sequence_without_keys_are_zero(rng):
    q, k, v, dout, cu_q, cu_k = _problem(rng, np.float16, 2, 2, 32, 32)
    out, lse, dq, dk, dv = _run(q, k, v, dout, cu_q, cu_k)
    q0, q1 = int(cu_q[2]), int(cu_q[3])  # sequence 2: 7 queries, 0 keys
    assert not out[q0:q1].any() and bool(cupy.isneginf(lse[:, q0:q1]).all()) and not dq[q0:q1].any()


def test_padded_q_and_odd_strides(rng):
    """q as a column slice of a wider array (row stride != H * D), D not a multiple of 8."""
    wide = cupy.asarray(rng.standard_normal((sum(LENGTHS_Q), 3, 50), dtype=np.float32).astype(np.float16))
    _, k, v, dout, cu_q, cu_k = _problem(rng, np.float16, 3, 3, 36, 20)
    q = wide[:, :, 7:43]
    _check(q, k, v, dout, cu_q, cu_k, _run(q, k, v, dout, cu_q, cu_k, causal=True), causal=True)
