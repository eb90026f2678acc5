"""Variable-length packed batches without a GPU: the reference is the dense reference run per sequence,
the CPU path matches the reference (options and dropout included), and bad offsets are clear errors.
The kernels' side is tests/gpu/test_gpu_varlen.py.
"""

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

LENGTHS_Q = [5, 0, 37, 70, 1, 20]
LENGTHS_K = [9, 3, 37, 2, 0, 64]  # sequence 1 has keys but no query, sequence 4 queries but no key


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_problem(rng, lengths_q, lengths_k, heads, kv_heads, d, dv, dtype=np.float32):
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = rng.standard_normal((cu_q[-1], heads, d), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((cu_k[-1], kv_heads, d), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((cu_k[-1], kv_heads, dv), dtype=np.float32).astype(dtype)
    dout = rng.standard_normal((cu_q[-1], heads, dv), dtype=np.float32).astype(dtype)
    return q, k, v, dout, cu_q, cu_k


def alone(x, r0, r1, kv_heads):
    """Rows r0:r1 of a packed (total, H, D) array as a dense (Hk, G, n, D) problem."""
    return x[r0:r1].transpose(1, 0, 2).reshape(kv_heads, x.shape[1] // kv_heads, r1 - r0, x.shape[2])


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_each_sequence_alone(rng, causal):
    q, k, v, dout, cu_q, cu_k = packed_problem(rng, LENGTHS_Q, LENGTHS_K, 6, 2, 16, 8)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal)
    assert out.shape == (cu_q[-1], 6, 8) and lse.shape == (6, cu_q[-1])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for s in range(len(LENGTHS_Q)):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        qs, ks, vs, douts = alone(q, q0, q1, 2), alone(k, k0, k1, 2), alone(v, k0, k1, 2), alone(dout, q0, q1, 2)
        out_s, lse_s = reference.attention(qs, ks, vs, causal=causal, return_lse=True)
        np.testing.assert_array_equal(out[q0:q1], out_s.reshape(6, q1 - q0, 8).transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, q0:q1], lse_s.reshape(6, q1 - q0))
        if q1 > q0 and k1 > k0:
            dq_s, dk_s, dv_s = reference.attention_backward(douts, qs, ks, vs, causal=causal)
            np.testing.assert_allclose(dq[q0:q1], dq_s.reshape(6, q1 - q0, 16).transpose(1, 0, 2), atol=1e-12)
            np.testing.assert_allclose(dk[k0:k1], dk_s[:, 0].transpose(1, 0, 2), atol=1e-12)
            np.testing.assert_allclose(dv[k0:k1], dv_s[:, 0].transpose(1, 0, 2), atol=1e-12)
        else:  # no query or no key: nothing flows back
            assert not dq[q0:q1].any() and not dk[k0:k1].any() and not dv[k0:k1].any()
    assert np.all(np.isneginf(lse[:, cu_q[4] : cu_q[5]])), "a sequence with no key has lse = -inf"


OPTIONS = {
    "plain": {},
    "window-softcap-alibi": dict(window=(6, 2), softcap=3.0, alibi_slopes=np.linspace(0.05, 0.5, 6, dtype=np.float32)),
    "dropout": dict(dropout_p=0.25, dropout_seed=77),
    "all": dict(
        window=(20, 0),
        softcap=2.0,
        alibi_slopes=np.full((len(LENGTHS_Q), 6), 0.1, np.float32),
        dropout_p=0.1,
        dropout_seed=2**40,
    ),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", OPTIONS)
def test_cpu_path_matches_reference(rng, causal, which):
    q, k, v, dout, cu_q, cu_k = packed_problem(rng, LENGTHS_Q, LENGTHS_K, 6, 3, 24, 16)
    options = OPTIONS[which]
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **options)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, **options)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **options)
    ref_grads = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal, **options)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    assert np.abs(lse[seen] - ref_lse[seen]).max() <= 1e-5 * max(1, np.abs(ref_lse[seen]).max())
    for x, ref in zip((out, *grads), (ref_out, *ref_grads)):
        assert x.shape == ref.shape
        assert np.abs(x - ref).max() <= 1e-5 * np.abs(ref).max()


def test_dropout_follows_the_flat_sequence_head_index(rng):
    """Sequence s, head h uses the mask of flat batch entry s * H + h: the same as a dense batch of
    equal-length sequences."""
    q, k, v, _, cu_q, cu_k = packed_problem(rng, [40, 40, 40], [50, 50, 50], 4, 4, 16, 16)
    options = dict(dropout_p=0.3, dropout_seed=9)
    packed = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, **options)
    dense = [x.reshape(3, -1, 4, 16).transpose(0, 2, 1, 3) for x in (q, k, v)]  # (B, H, N, D)
    out = cupyflash.attention(*dense, causal=True, **options)
    np.testing.assert_allclose(packed, out.transpose(0, 2, 1, 3).reshape(120, 4, 16), rtol=1e-6, atol=1e-6)


def test_attention_varlen_is_the_forward(rng):
    q, k, v, _, cu_q, cu_k = packed_problem(rng, LENGTHS_Q, LENGTHS_K, 4, 4, 16, 16)
    out, _ = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_array_equal(cupyflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True), out)


def test_empty_batch_and_empty_sequences(rng):
    q, k, v, dout, cu_q, cu_k = packed_problem(rng, [0, 0], [0, 4], 2, 1, 8, 8)
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    grads = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not grads[1].any()
    none = np.zeros(1, np.int32)
    out = cupyflash.attention_varlen(q[:0], k[:0], v[:0], none, none)
    assert out.shape == (0, 2, 8)


def _bad(rng, **changes):
    q, k, v, _, cu_q, cu_k = packed_problem(rng, [3, 4], [3, 4], 2, 1, 8, 8)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, text",
    [
        (
            dict(cu_seqlens_q=np.array([0, 3, 7], np.uint32)),
            TypeError,
            "cu_seqlens_q must be an int32 or int64 array or a sequence of ints, got dtype uint32",
        ),
        (dict(cu_seqlens_k=[0.0, 3.0, 7.0]), TypeError, "cu_seqlens_k must hold integers"),
        (
            dict(cu_seqlens_k=None),
            TypeError,
            "cu_seqlens_k must be an int32 or int64 array or a sequence of ints, got builtins.NoneType",
        ),
        (dict(cu_seqlens_k=np.array([0, 5, 3, 7], np.int32)), ValueError, "cu_seqlens_k must be non-decreasing"),
        (dict(cu_seqlens_q=np.array([0, 3, 6], np.int32)), ValueError, r"last entry of cu_seqlens_q is 6 but q has 7"),
        (
            dict(cu_seqlens_k=np.array([0, 7], np.int32)),
            ValueError,
            "cu_seqlens_q has 3 entries but cu_seqlens_k has 2",
        ),
        (dict(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_q=np.array([[0, 3, 7]], np.int32)), ValueError, "cu_seqlens_q must be 1-D"),
        (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is below the longest query sequence \(4\)"),
        (dict(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be an integer"),
    ],
)
def test_bad_offsets(rng, changes, error, text):
    args = _bad(rng, **changes)
    with pytest.raises(error, match=text):
        cupyflash.attention_varlen(**args)


@pytest.mark.parametrize("form", ["int64", "list", "tuple"])
def test_offsets_by_one_rule(rng, form):
    """cu_seqlens as int64 arrays, lists or tuples: the results of int32 arrays, bit for bit."""
    args = _bad(rng)
    convert = {
        "int64": lambda x: x.astype(np.int64),
        "list": lambda x: x.tolist(),
        "tuple": lambda x: tuple(x.tolist()),
    }[form]
    given = {**args, "cu_seqlens_q": convert(args["cu_seqlens_q"]), "cu_seqlens_k": convert(args["cu_seqlens_k"])}
    np.testing.assert_array_equal(cupyflash.attention_varlen(**given), cupyflash.attention_varlen(**args))
    expected = cupyflash.reference.attention_varlen(
        *(args[name].astype(np.float64) for name in "qkv"), args["cu_seqlens_q"], args["cu_seqlens_k"]
    )
    got = cupyflash.reference.attention_varlen(
        *(args[name].astype(np.float64) for name in "qkv"), given["cu_seqlens_q"], given["cu_seqlens_k"]
    )
    np.testing.assert_array_equal(got, expected)


def test_bad_shapes(rng):
    args = _bad(rng)
    q, k, v = args["q"], args["k"], args["v"]
    with pytest.raises(ValueError, match=r"q must be packed as \(total_q, H, D\)"):
        cupyflash.attention_varlen(**{**args, "q": q[None]})
    with pytest.raises(ValueError, match="must divide the query heads"):
        cupyflash.attention_varlen(
            **{
                **args,
                "q": np.concatenate([q, q[:, :1]], axis=1),  # H = 3, Hk = 2
                "k": np.concatenate([k, k], axis=1),
                "v": np.concatenate([v, v], axis=1),
            }
        )
    with pytest.raises(ValueError, match="k and v must have the same rows and heads"):
        cupyflash.attention_varlen(**{**args, "v": v[:-1]})
    with pytest.raises(ValueError, match="alibi_slopes has shape"):
        cupyflash.attention_varlen(**args, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias'"):
        cupyflash.attention_varlen(**args, bias=np.zeros((7, 7), np.float32))
    out, lse = cupyflash.attention_varlen_forward(**args)
    with pytest.raises(ValueError, match=r"lse has shape \(7, 2\); expected \(2, 7\)"):
        cupyflash.attention_varlen_backward(out, q, k, v, out, lse.T, args["cu_seqlens_q"], args["cu_seqlens_k"])
