"""The float64 KV-cache reference against first principles: rotations as complex products, caches as lists of
positions, and scores one query and one key at a time with every rule of attention_with_kvcache written out.
"""

import math

import numpy as np
import pytest

from cupyflash import reference

ATOL = 1e-12  # float64 sums of a few dozen O(1) terms, computed in two orders


def _rotary_tables(rng, max_pos, rotary_dim):
    """cos, sin (max_pos, rotary_dim / 2) of random angles: no structure a bug could hide behind."""
    angles = rng.uniform(-np.pi, np.pi, (max_pos, rotary_dim // 2))
    return np.cos(angles), np.sin(angles)


def _rotate_complex(x, cos, sin, position, interleaved):
    """One vector x (D,) rotated: its pairs as complex numbers times exp(i angle) = cos + i sin."""
    half = cos.shape[1]
    r = 2 * half
    real, imag = (x[0:r:2], x[1:r:2]) if interleaved else (x[:half], x[half:r])
    z = (real + 1j * imag) * (cos[position] + 1j * sin[position])
    rotated = x.copy()
    if interleaved:
        rotated[0:r:2], rotated[1:r:2] = z.real, z.imag
    else:
        rotated[:half], rotated[half:r] = z.real, z.imag
    return rotated


def _brute_force(q, k_cache, v_cache, k, v, seqlens, block_table, rotary, causal, scale, window, softcap, slopes):
    """attention_with_kvcache from its docstring, one score at a time: out (B, Hq, Nq, Dv), lse (B, Hq, Nq).
    ``rotary`` is None or (cos, sin, interleaved)."""
    batch, hq, nq, _ = q.shape
    hk, nnew, dv = k_cache.shape[1], k.shape[2], v_cache.shape[3]
    page_size = k_cache.shape[2]
    out, lse = np.zeros((batch, hq, nq, dv)), np.full((batch, hq, nq), -np.inf)
    for b in range(batch):
        start = int(seqlens[b])
        length = start + nnew

        def cached(cache, pos, h):
            if block_table is None:
                return cache[b, h, pos]
            return cache[block_table[b][pos // page_size], h, pos % page_size]

        for h in range(hq):
            kv_head = h // (hq // hk)
            keys, values = [], []
            for pos in range(length):
                if pos < start:
                    keys.append(cached(k_cache, pos, kv_head))
                    values.append(cached(v_cache, pos, kv_head))
                else:
                    key = k[b, kv_head, pos - start]
                    keys.append(key if rotary is None else _rotate_complex(key, *rotary[:2], pos, rotary[2]))
                    values.append(v[b, kv_head, pos - start])
            for i in range(nq):
                query = q[b, h, i]
                if rotary is not None:
                    advance = causal or window != (-1, -1)
                    query = _rotate_complex(query, *rotary[:2], start + (i if advance else 0), rotary[2])
                at = length - nq + i
                scores = []
                for j in range(length):
                    left, right = window
                    if (causal and j > at) or (left != -1 and j < at - left) or (right != -1 and j > at + right):
                        continue
                    s = scale * float(np.dot(query, keys[j]))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[b, h]) * abs(at - j)  # float(): NumPy keeps float32 products float32
                    scores.append((s, j))
                if scores:
                    top = max(s for s, _ in scores)
                    total = sum(math.exp(s - top) for s, _ in scores)
                    lse[b, h, i] = top + math.log(total)
                    out[b, h, i] = sum(math.exp(s - lse[b, h, i]) * values[j] for s, j in scores)
    return out, lse


CASES = {
    "contiguous": dict(),
    "paged-causal": dict(page_size=3, causal=True),
    "rotary-neox-window": dict(rotary_dim=4, window=(3, 1)),
    "rotary-gptj-causal": dict(rotary_dim=6, interleaved=True, causal=True, page_size=2),
    "rotary-no-mask": dict(rotary_dim=6, nq=3, nnew=1),
    "softcap-alibi": dict(softcap=1.5, alibi=True, causal=True, page_size=4),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_brute_force(rng, case):
    c = dict(
        dict(
            nq=2,
            nnew=2,
            page_size=None,
            rotary_dim=0,
            interleaved=False,
            causal=False,
            window=(-1, -1),
            softcap=0.0,
            alibi=False,
        ),
        **CASES[case],
    )
    batch, hq, hk, d, dv, capacity = 3, 4, 2, 6, 5, 12
    seqlens = np.array([0, 4, capacity - c["nnew"]], dtype=np.int32)
    q = rng.standard_normal((batch, hq, c["nq"], d))
    k, v = rng.standard_normal((batch, hk, c["nnew"], d)), rng.standard_normal((batch, hk, c["nnew"], dv))
    block_table = None
    if c["page_size"]:
        pages = capacity // c["page_size"]
        block_table = rng.permutation(batch * pages + 2)[: batch * pages].reshape(batch, pages).astype(np.int32)
        cache_shape = (batch * pages + 2, hk, c["page_size"])
    else:
        cache_shape = (batch, hk, capacity)
    k_cache, v_cache = rng.standard_normal(cache_shape + (d,)), rng.standard_normal(cache_shape + (dv,))
    rotary = _rotary_tables(rng, capacity + 3, c["rotary_dim"]) if c["rotary_dim"] else None
    slopes = rng.uniform(0.1, 1.0, (batch, hq)).astype(np.float32) if c["alibi"] else None
    out, lse = reference.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=seqlens,
        block_table=block_table,
        rotary_cos=None if rotary is None else rotary[0],
        rotary_sin=None if rotary is None else rotary[1],
        rotary_interleaved=c["interleaved"],
        causal=c["causal"],
        scale=0.45,
        window=c["window"],
        softcap=c["softcap"],
        alibi_slopes=slopes,
        return_lse=True,
    )
    expected_out, expected_lse = _brute_force(
        q,
        k_cache,
        v_cache,
        k,
        v,
        seqlens,
        block_table,
        None if rotary is None else (*rotary, c["interleaved"]),
        c["causal"],
        0.45,
        c["window"],
        c["softcap"],
        slopes,
    )
    np.testing.assert_allclose(out, expected_out, atol=ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse, expected_lse, atol=ATOL)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [2, 6, 10])
def test_rotary_is_a_complex_product(rng, interleaved, rotary_dim):
    x = rng.standard_normal((2, 7, 10))
    cos, sin = _rotary_tables(rng, 20, rotary_dim)
    positions = rng.integers(0, 20, 7)
    rotated = reference.rotary(x, cos, sin, positions, interleaved)
    for index in np.ndindex(2, 7):
        expected = _rotate_complex(x[index], cos, sin, positions[index[1]], interleaved)
        np.testing.assert_allclose(rotated[index], expected, atol=ATOL)
    np.testing.assert_array_equal(rotated[..., rotary_dim:], x[..., rotary_dim:])


def test_rotary_styles_pair_different_dims():
    """A quarter turn of the first pair: GPT-NeoX pairs dims 0 and 2, GPT-J dims 0 and 1 (rotary_dim 4)."""
    cos, sin = np.array([[0.0, 1.0]]), np.array([[1.0, 0.0]])  # pair 0 a quarter turn, pair 1 unchanged
    x = np.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    np.testing.assert_allclose(reference.rotary(x, cos, sin, [0], interleaved=False), [[-3.0, 2.0, 1.0, 4.0, 5.0]])
    np.testing.assert_allclose(reference.rotary(x, cos, sin, [0], interleaved=True), [[-2.0, 1.0, 3.0, 4.0, 5.0]])


@pytest.mark.parametrize("causal", [False, True])
def test_is_dense_attention_over_the_updated_cache(rng, causal):
    """Without rotary, sequence b is reference.attention of its queries over positions 0 .. L_b - 1 of the
    returned caches (bottom-right aligned, every modifier), with key/value head h // G for query head h;
    and the caches are the inputs with the new keys at cache_seqlens[b] + j, nothing else changed."""
    batch, hq, hk, nq, nnew, capacity = 2, 6, 3, 4, 3, 20
    q = rng.standard_normal((batch, hq, nq, 8))
    k_cache, v_cache = rng.standard_normal((batch, hk, capacity, 8)), rng.standard_normal((batch, hk, capacity, 4))
    k, v = rng.standard_normal((batch, hk, nnew, 8)), rng.standard_normal((batch, hk, nnew, 4))
    seqlens = np.array([2, capacity - nnew])
    options = dict(causal=causal, window=(5, 1), softcap=2.0, alibi_slopes=rng.uniform(0.1, 0.5, hq).astype(np.float32))
    originals = [x.copy() for x in (q, k_cache, v_cache, k, v)]
    out, lse, new_k_cache, new_v_cache = reference.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, return_lse=True, return_caches=True, **options
    )
    for x, original in zip((q, k_cache, v_cache, k, v), originals):
        np.testing.assert_array_equal(x, original)  # inputs never modified
    for b in range(batch):
        start, length = seqlens[b], seqlens[b] + nnew
        for cache, new_cache, appended in ((k_cache, new_k_cache, k), (v_cache, new_v_cache, v)):
            np.testing.assert_array_equal(new_cache[b, :, start:length], appended[b])
            np.testing.assert_array_equal(
                np.delete(new_cache[b], np.s_[start:length], axis=1), np.delete(cache[b], np.s_[start:length], axis=1)
            )
        keys, values = (np.repeat(c[b, :, :length], hq // hk, axis=0) for c in (new_k_cache, new_v_cache))
        expected_out, expected_lse = reference.attention(q[b], keys, values, return_lse=True, **options)
        np.testing.assert_allclose(out[b], expected_out, atol=ATOL)
        np.testing.assert_allclose(lse[b], expected_lse, atol=ATOL)


def test_returns_what_is_asked(rng):
    q = rng.standard_normal((1, 2, 1, 4))
    k_cache, v_cache = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 3))
    call = dict(cache_seqlens=3)
    out = reference.attention_with_kvcache(q, k_cache, v_cache, **call)
    assert isinstance(out, np.ndarray) and out.shape == (1, 2, 1, 3) and out.dtype == np.float64
    with_lse = reference.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **call)
    with_caches = reference.attention_with_kvcache(q, k_cache, v_cache, return_caches=True, **call)
    everything = reference.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, return_caches=True, **call)
    assert [len(x) for x in (with_lse, with_caches, everything)] == [2, 3, 4]
    np.testing.assert_array_equal(everything[1], with_lse[1])
    np.testing.assert_array_equal(everything[3], v_cache)


def test_sequences_without_keys(rng):
    """L_b = 0 (nothing cached, nothing appended): out 0 and lse -inf, never NaN."""
    q = rng.standard_normal((2, 2, 3, 4))
    k_cache, v_cache = rng.standard_normal((2, 1, 6, 4)), rng.standard_normal((2, 1, 6, 4))
    out, lse = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([0, 2]), return_lse=True)
    assert not out[0].any() and np.isneginf(lse[0]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[1]).all()
