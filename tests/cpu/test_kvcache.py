"""attention_with_kvcache on the CPU path (NumPy) against the float64 reference: appends, contiguous and paged
caches, rotary embeddings, grouped heads, every score modifier, every dtype, and the argument errors.

Every call is checked three ways (helpers/kvcache.py, ``check``): out and lse by the accuracy rule of
helpers/checks.py (float64 inputs: to float64 rounding), the caches after the append against the
reference's (the new keys to one rounding of the rotation, the new values bit for bit), and every other
position of the caches untouched, bit for bit. The caches are random everywhere, so a read beyond L_b or a
stray write shows.
"""

import tracemalloc

import numpy as np
import pytest
from helpers.checks import max_abs
from helpers.kvcache import CAPACITY, DTYPES, DV, HK, HQ, D, Problem, check, flash_layout, make_problem, run
from helpers.modifiers import alibi_slopes


# ------------------------------------------------------------------------------------ layouts and lengths
@pytest.mark.parametrize("nq", [1, 5])
@pytest.mark.parametrize("nnew", [0, 2])
@pytest.mark.parametrize("page_size", [None, 1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(rng, dtype, page_size, nnew, nq):
    """Grouped heads (8 over 2), D = 40 and Dv = 24, causal; L_b of 0 (without an append) or nnew, a page
    boundary crossed by the append, L_b ending on a page boundary, and the full capacity."""
    page = page_size or 16
    # L_b: 0 or nnew; 1 + nnew; an append across a page boundary; ending on a page boundary; the capacity.
    seqlens = [0, 1, 2 * page - 1, page * max(1, CAPACITY // page // 2) - nnew, CAPACITY - nnew]
    check(make_problem(rng, dtype, seqlens, nq=nq, nnew=nnew, page_size=page_size, causal=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [None, 3])
def test_append_without_queries_writes_the_caches(rng, page_size, causal):
    """Nq = 0: nothing to attend, the new keys and values are still appended."""
    p = make_problem(
        rng, np.float16, [0, 5, CAPACITY - 3], nq=0, nnew=3, page_size=page_size, causal=causal, rotary_dim=D
    )
    out, lse = check(p)
    assert out.shape == (3, HQ, 0, DV) and lse.shape == (3, HQ, 0)


def test_sequences_without_keys_give_zeros(rng):
    """L_b = 0: out 0 and lse -inf for that sequence only, never NaN."""
    p = make_problem(rng, np.float32, [0, 7, 0], nq=3, nnew=0, page_size=4)
    out, lse = check(p)
    assert not out[[0, 2]].any() and np.isneginf(lse[[0, 2]]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[1]).all()


def test_one_int_for_every_sequence(rng):
    p = make_problem(rng, np.float16, [9, 9, 9], nq=2, nnew=2, page_size=5)
    results = []
    for seqlens in (9, np.full(3, 9, dtype=np.int32)):
        each = Problem(p.q, p.k_cache.copy(), p.v_cache.copy(), p.k, p.v, dict(p.options, cache_seqlens=seqlens))
        results.append((*run(each), each.k_cache, each.v_cache))
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)
    check(p)


@pytest.mark.parametrize("form", ["int64", "list", "tuple", "strided int32"])
@pytest.mark.parametrize("page_size", [None, 4])
def test_index_arguments_by_one_rule(rng, page_size, form):
    """cache_seqlens and block_table as int64 arrays, lists, tuples or strided int32 views: the results of
    contiguous int32 arrays, bit for bit, with the same appends."""
    p = make_problem(rng, np.float16, [3, 9, 17], nq=2, nnew=2, page_size=page_size, causal=True)
    convert = {
        "int64": lambda x: x.astype(np.int64),
        "list": lambda x: x.tolist(),
        "tuple": lambda x: tuple(map(tuple, x)) if x.ndim == 2 else tuple(x.tolist()),
        "strided int32": lambda x: np.repeat(x, 2, axis=-1)[..., ::2],
    }[form]
    options = {
        name: convert(p.options[name]) if name in ("cache_seqlens", "block_table") else value
        for name, value in p.options.items()
        if value is not None
    }
    given = Problem(p.q, p.k_cache.copy(), p.v_cache.copy(), p.k, p.v, options)
    for x, y in zip((*run(given), given.k_cache, given.v_cache), (*check(p), p.k_cache, p.v_cache)):
        np.testing.assert_array_equal(x, y)


def test_pages_shared_to_be_read_are_fine(rng):
    """A common prefix: two sequences list the same pages below both their cache_seqlens and append each into
    its own pages; the results are those of private copies of the prefix."""
    p = make_problem(rng, np.float32, [9, 13], nq=1, nnew=2, page_size=4)
    table = p.options["block_table"].copy()
    shared = Problem(p.q, p.k_cache.copy(), p.v_cache.copy(), p.k, p.v, dict(p.options, block_table=table))
    for cache in (p.k_cache, p.v_cache, shared.k_cache, shared.v_cache):
        cache[table[1, :2]] = cache[table[0, :2]]  # sequence 1's first 8 positions are sequence 0's
    table[1, :2] = table[0, :2]  # ... and are read from sequence 0's pages
    for x, y in zip(run(shared), check(p)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("page_size", [None, 4])
def test_flash_attention_layout_is_written_in_place(rng, page_size):
    """(B, S, Hk, D) caches (paged: (num_pages, page_size, Hk, D)) passed as .transpose(0, 2, 1, 3) views
    give the results of contiguous copies, and the appended keys land in the caller's arrays."""
    p = make_problem(rng, np.float16, [3, 20, 31], nq=2, nnew=3, page_size=page_size, causal=True, rotary_dim=16)
    contiguous = Problem(p.q, p.k_cache.copy(), p.v_cache.copy(), p.k, p.v, p.options)
    storage = flash_layout(p)
    for x, y in zip(check(p), run(contiguous)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(storage, (contiguous.k_cache, contiguous.v_cache)):
        np.testing.assert_array_equal(x, y.transpose(0, 2, 1, 3))


@pytest.mark.parametrize(
    "options", [dict(causal=True), dict(window=(70, 3), alibi_slopes=alibi_slopes(HQ))], ids=["causal", "window-alibi"]
)
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_long_caches_cross_the_forward_tiles(rng, dtype, page_size, options):
    """Caches of up to 300 positions: several of the CPU forward's 64-key tiles, some skipped by the window."""
    p = make_problem(
        rng, dtype, [0, 63, 130, 297], nq=5, nnew=3, page_size=page_size, capacity=300, rotary_dim=D, **options
    )
    check(p)


# ------------------------------------------------------------------------------------ rotary embeddings
@pytest.mark.parametrize("nq", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rotary(rng, dtype, interleaved, causal, nq):
    """Both styles, on all of D and on 16 of its 40 dims; without causal every query is rotated at
    cache_seqlens, with it query i at cache_seqlens + i."""
    for rotary_dim, page_size in ((D, 3), (16, None)):
        p = make_problem(
            rng,
            dtype,
            [0, 6, 17, CAPACITY - nq],
            nq=nq,
            nnew=nq,
            page_size=page_size,
            causal=causal,
            rotary_dim=rotary_dim,
            rotary_interleaved=interleaved,
        )
        check(p)


@pytest.mark.parametrize("window, advance", [(None, False), ((-1, -1), False), ((CAPACITY, CAPACITY), True)])
def test_rotary_query_positions(rng, window, advance):
    """Identical queries without a mask: rotated at one position, their outputs are identical; with a
    window (even one that hides nothing) query i is rotated at cache_seqlens + i and they differ."""
    p = make_problem(rng, np.float32, [4, 30], nq=4, nnew=4, rotary_dim=D, window=window)
    p.q[...] = p.q[:, :, :1]
    out, _ = check(p)
    spread = max(max_abs(out[:, :, i] - out[:, :, 0]) for i in range(1, 4)) / max_abs(out)
    assert spread > 1e-2 if advance else spread < 1e-6, f"query rows differ by {spread:.3g} of max|out|"


# ------------------------------------------------------------------------------------ score modifiers
OPTIONS = {
    "window": dict(window=(6, 2)),
    "causal-window": dict(causal=True, window=(10, -1)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(causal=True, alibi_slopes=alibi_slopes(HQ)),
    "alibi-per-sequence": dict(alibi_slopes=np.linspace(0.01, 0.5, 4 * HQ, dtype=np.float32).reshape(4, HQ)),
    "scale": dict(scale=0.3),
    "everything": dict(
        causal=True, window=(12, 0), softcap=3.0, alibi_slopes=alibi_slopes(HQ), rotary_dim=24, rotary_interleaved=True
    ),
}


@pytest.mark.parametrize("nq", [1, 5])
@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_score_modifiers(rng, dtype, name, nq):
    p = make_problem(rng, dtype, [0, 5, 23, CAPACITY - 2], nq=nq, nnew=2, page_size=3, **OPTIONS[name])
    check(p)


# ------------------------------------------------------------------------------------ memory
def test_memory_stays_linear_in_cache_length(rng):
    """No Nq x L_b score matrix: a long paged sequence attended by 256 queries peaks far below one."""
    nq, length = 256, 4096
    p = make_problem(
        rng, np.float32, [length - 1], nq=nq, nnew=1, page_size=64, hq=1, hk=1, d=16, dv=16, capacity=length
    )
    tracemalloc.start()  # NumPy reports its data allocations to tracemalloc
    try:
        run(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    score_matrix_bytes = nq * length * 4
    assert peak < score_matrix_bytes / 4, f"peak {peak} bytes; one score matrix is {score_matrix_bytes}"


# ------------------------------------------------------------------------------------ argument errors
def _error_problem(rng, **changes):
    p = make_problem(rng, np.float16, [2, 5], nq=1, nnew=1, page_size=4, rotary_dim=8)
    for name, value in changes.items():
        if name in ("q", "k_cache", "v_cache", "k", "v"):
            setattr(p, name, value)
        else:
            p.options[name] = value
    return p


def _writable_broadcast(x, n):
    """x repeated n times along dim 0 by a stride of 0, writable (np.broadcast_to's views are read-only)."""
    return np.lib.stride_tricks.as_strided(x, (n,) + x.shape[1:], (0,) + x.strides[1:], writeable=True)


def _read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


ERRORS = {
    "heads": (
        lambda rng: dict(q=np.zeros((2, 3, 1, D), np.float16)),
        ValueError,
        r"q has 3 heads and k_cache 2; the query heads Hq must be a multiple",
    ),
    "k without v": (lambda rng: dict(v=None), ValueError, r"k and v must be given together"),
    "seqlen too long": (
        lambda rng: dict(cache_seqlens=np.array([2, CAPACITY], np.int32)),
        ValueError,
        r"cache_seqlens\[1\] = 48 is out of range",
    ),
    "seqlen negative": (
        lambda rng: dict(cache_seqlens=np.array([-1, 5], np.int32)),
        ValueError,
        r"cache_seqlens\[0\] = -1 is out of range",
    ),
    "seqlen float": (
        lambda rng: dict(cache_seqlens=np.array([2.0, 5.0])),
        TypeError,
        r"cache_seqlens must be an int, a sequence of ints or an int32 or int64 array, got dtype "
        r"float64",
    ),
    "seqlen uint32": (
        lambda rng: dict(cache_seqlens=np.array([2, 5], np.uint32)),
        TypeError,
        r"cache_seqlens must be .* got dtype uint32",
    ),
    "seqlen floats in a list": (
        lambda rng: dict(cache_seqlens=[2.0, 5.0]),
        TypeError,
        r"cache_seqlens must hold integers; got a sequence that NumPy reads as float64",
    ),
    "seqlen None": (
        lambda rng: dict(cache_seqlens=None),
        TypeError,
        r"cache_seqlens must be an int, a sequence of ints or an int32 or int64 array, got "
        r"builtins.NoneType",
    ),
    "seqlen list too long": (
        lambda rng: dict(cache_seqlens=[2, 5, 1]),
        ValueError,
        r"cache_seqlens must be an int or of shape \(B,\) = \(2,\), got shape \(3,\)",
    ),
    "page out of range": (
        lambda rng: dict(block_table=np.array([[0, 1, 2] * 4, [3, 99, 4] * 4], np.int32)),
        ValueError,
        r"block_table\[1, 1\] = 99 is not a page of k_cache",
    ),
    "block_table uint8": (
        lambda rng: dict(block_table=np.zeros((2, 12), np.uint8)),
        TypeError,
        r"block_table must be an int32 or int64 array or a sequence of ints, got dtype uint8",
    ),
    "block_table ragged": (
        lambda rng: dict(block_table=[[0, 1, 2], [3, 4]]),
        ValueError,
        r"block_table is a ragged sequence",
    ),
    "block_table page past int32": (
        lambda rng: dict(block_table=np.full((2, 12), 2**40, np.int64)),
        ValueError,
        r"block_table\[0, 0\] = 1099511627776 is not a page of k_cache",
    ),
    # Sequence 0 appends at position 2, into page 0, which sequence 1 reads (its positions 0 .. 3).
    "append into a shared page": (
        lambda rng: dict(block_table=np.array([[0] + list(range(1, 12)), [0] + list(range(12, 23))], np.int32)),
        ValueError,
        r"block_table\[0, 0\] = 0: k and v would be appended into page 0, "
        r"which block_table\[1, 0\] uses too",
    ),
    # Sequence 1 (5 keys) appends at position 5, into its page 1, which it also lists as its page 0.
    "append into its own page twice": (
        lambda rng: dict(block_table=np.array([list(range(12)), [13, 13] + list(range(14, 24))], np.int32)),
        ValueError,
        r"block_table\[1, 1\] = 13: .* which block_table\[1, 0\] uses",
    ),
    "read-only cache": (
        lambda rng: dict(k_cache=_read_only(np.zeros((26, HK, 4, D), np.float16))),
        ValueError,
        r"k_cache is read-only",
    ),
    "broadcast cache": (
        lambda rng: dict(v_cache=_writable_broadcast(np.zeros((1, HK, 4, DV), np.float16), 26)),
        ValueError,
        r"v_cache is a broadcast view",
    ),
    "rotary dim > D": (
        lambda rng: dict(rotary_cos=np.ones((60, 21), np.float32), rotary_sin=np.ones((60, 21), np.float32)),
        ValueError,
        r"rotary_dim = 2 \* rotary_cos.shape\[1\] = 42 must be in 2 .. D = 40",
    ),
    "rotary too short": (
        lambda rng: dict(rotary_cos=np.ones((5, 4), np.float32), rotary_sin=np.ones((5, 4), np.float32)),
        ValueError,
        r"rotary_cos has 5 positions but sequence 1 needs position 5",
    ),
    "rotary_sin missing": (
        lambda rng: dict(rotary_sin=None),
        ValueError,
        r"rotary_cos and rotary_sin must be given together",
    ),
    "num_splits 0": (lambda rng: dict(num_splits=0), ValueError, r"num_splits must be None .* got 0"),
    "num_splits float": (lambda rng: dict(num_splits=2.5), ValueError, r"num_splits must be None .* got 2.5"),
    "num_splits bool": (lambda rng: dict(num_splits=True), ValueError, r"num_splits must be None .* got True"),
    "alibi shape": (
        lambda rng: dict(alibi_slopes=np.ones(3, np.float32)),
        ValueError,
        r"alibi_slopes has shape \(3,\); expected \(Hq,\) = \(8,\)",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_argument(rng, case):
    make, error, message = ERRORS[case]
    p = _error_problem(rng, **make(rng))
    caches = [x.copy() for x in (p.k_cache, p.v_cache)]
    with pytest.raises(error, match=message):
        run(p)
    for x, before in zip((p.k_cache, p.v_cache), caches):
        np.testing.assert_array_equal(x, before)  # nothing written before the error


def test_read_only_caches_are_fine_without_new_keys(rng):
    """Without k and v nothing is written: read-only (or broadcast) caches are accepted."""
    p = make_problem(rng, np.float32, [3, 9], nq=2, nnew=0, page_size=4)
    p.k_cache, p.v_cache = _read_only(p.k_cache), _read_only(p.v_cache)
    check(p)
