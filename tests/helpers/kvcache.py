"""attention_with_kvcache test machinery shared by the CPU (NumPy) and GPU (CuPy) tests: random problems, the
call, and the check of one call against the float64 reference.

Problems are built in NumPy (``make_problem``); ``to_device`` gives CuPy copies of one, each array with its
dims in the same memory order. ``check`` runs a problem of either module and holds, on the host:

- out and lse to the accuracy rule of helpers/checks.py (float64 inputs: to float64 rounding);
- the caches after the append to the reference's: the new keys to one rounding of the rotation, the new
  values bit for bit;
- every other position of the caches untouched, bit for bit.

The caches are random everywhere, so a read beyond L_b or a stray write shows.
"""

import math
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import reference
from cupyflash._arrays import cupy, is_cupy
from cupyflash._kvcache import checks as _kvcache_args
from helpers.checks import assert_close, assert_lse_close, bits, lse_atol, max_abs, naive_attention, to_host
from helpers.problems import random_array

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
FLOAT64_RTOL = 1e-12  # float64 throughout: any float32 step would leave ~1e-7
# One rounding of a rotated key to the cache's dtype, computed in float32 (float64 for float64 caches) by
# the implementation and in float64 by the reference: at most one unit in the last place apart (relative
# to the key's largest element).
ROUNDING_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-22, "float64": 1e-15}
HQ, HK, D, DV = 8, 2, 40, 24
CAPACITY = 48  # positions per sequence: 3 pages of 16, 16 of 3, 48 of 1
SPARE_PAGES = 2  # pages of a paged cache that no sequence's block table names
ARRAYS = ("q", "k_cache", "v_cache", "k", "v")
REFERENCE_IGNORES = ("num_splits",)  # options that change how, not what, attention_with_kvcache computes


@dataclass
class Problem:
    """One call's arrays: q, the caches (to be appended to in place), the new k, v and the keyword options."""

    q: object
    k_cache: object
    v_cache: object
    k: object = None
    v: object = None
    options: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def nnew(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def seqlens(self) -> np.ndarray:
        """cache_seqlens on the host as (B,) integers (also when given as one int)."""
        return np.broadcast_to(on_host(self.options["cache_seqlens"]), (self.batch,)).astype(np.int64)


def make_problem(
    rng,
    dtype,
    seqlens,
    *,
    nq=1,
    nnew=1,
    page_size=None,
    hq=HQ,
    hk=HK,
    d=D,
    dv=DV,
    capacity=CAPACITY,
    rotary_dim=0,
    **options,
) -> Problem:
    """Random NumPy q, caches and new k, v; paged caches (``page_size``) get a random page permutation and
    SPARE_PAGES pages no sequence uses; ``rotary_dim`` > 0 adds RoPE tables for every position a call can
    use. ``options`` go to the call as they are (cache_seqlens becomes an int32 array of ``seqlens``)."""
    batch = len(seqlens)
    if page_size is None:
        cache_shape = (batch, hk, capacity)
    else:
        pages = math.ceil(capacity / page_size)
        table = rng.permutation(batch * pages + SPARE_PAGES)[: batch * pages].reshape(batch, pages)
        options["block_table"] = table.astype(np.int32)
        cache_shape = (batch * pages + SPARE_PAGES, hk, page_size)
    if rotary_dim:
        options["rotary_cos"], options["rotary_sin"] = rope_tables(capacity + nq, rotary_dim)
    q = random_array(rng, (batch, hq, nq, d), dtype)
    k_cache, v_cache = random_array(rng, cache_shape + (d,), dtype), random_array(rng, cache_shape + (dv,), dtype)
    k, v = (random_array(rng, (batch, hk, nnew, n), dtype) for n in (d, dv)) if nnew else (None, None)
    return Problem(q, k_cache, v_cache, k, v, dict(options, cache_seqlens=np.array(seqlens, dtype=np.int32)))


def rope_tables(max_pos, rotary_dim, base=10000.0):
    """RoPE's cos, sin (max_pos, rotary_dim / 2) as float32: angle p * base^(-2i / rotary_dim)."""
    angles = np.arange(max_pos)[:, None] * base ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def flash_layout(p: Problem) -> tuple:
    """Make p's caches FlashAttention's layout: (B, S, Hk, D) storage (paged: (num_pages, page_size, Hk, D))
    seen through ``.transpose(0, 2, 1, 3)`` views, with the same values. Returns the two storages."""
    xp = np if isinstance(p.k_cache, np.ndarray) else cupy
    storage = [xp.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (p.k_cache, p.v_cache)]
    p.k_cache, p.v_cache = (x.transpose(0, 2, 1, 3) for x in storage)
    return tuple(storage)


# ------------------------------------------------------------------------------------ between host and device
def to_device(p: Problem) -> Problem:
    """CuPy copies of p's arrays (options too), each with its dims in the same memory order as on the host
    (a transposed view stays a transposed view of a contiguous array); ints and floats as they are."""
    if cupy is None:
        raise RuntimeError("to_device needs CuPy")
    arrays = {name: _device_copy(getattr(p, name)) for name in ARRAYS}
    return Problem(**arrays, options={name: _device_copy(x) for name, x in p.options.items()})


def _device_copy(x):
    if not isinstance(x, np.ndarray):
        return x
    order = sorted(range(x.ndim), key=lambda i: -abs(x.strides[i]))  # dims from the outermost in memory
    inverse = np.argsort(order)
    return cupy.asarray(np.ascontiguousarray(x.transpose(order))).transpose(tuple(int(i) for i in inverse))


def host_copy(x):
    """A NumPy copy of a NumPy or CuPy array of any strides, in its own dtype (moved as raw bits: no device
    arithmetic on bfloat16 needed); anything else (None, ints, tuples) as it is."""
    if is_cupy(x):
        return bits(x).get().view(x.dtype)
    return np.array(x, copy=True) if isinstance(x, np.ndarray) else x


def on_host(x):
    """A NumPy snapshot: of one array (or a scalar, as it is), or of a whole Problem."""
    if isinstance(x, Problem):
        return Problem(
            *(host_copy(getattr(x, name)) for name in ARRAYS),
            options={name: host_copy(value) for name, value in x.options.items()},
        )
    return host_copy(x)


def subset(p: Problem, rows) -> Problem:
    """The problem of sequences ``rows`` only (host or device): q, k, v, cache_seqlens, block_table and
    per-sequence alibi slopes sliced; paged caches, shared by every sequence, are kept whole (contiguous
    ones sliced)."""
    rows = list(rows)
    options = dict(p.options)
    for name in ("cache_seqlens", "block_table"):
        if hasattr(options.get(name), "shape"):
            options[name] = options[name][rows]
    slopes = options.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        options["alibi_slopes"] = slopes[rows]
    paged = "block_table" in options
    pick = {
        name: (None if getattr(p, name) is None else getattr(p, name)[rows])
        for name in ("q", "k", "v") + (() if paged else ("k_cache", "v_cache"))
    }
    return replace(p, **pick, options=options)


# ------------------------------------------------------------------------------------ the call and its check
def counting_resolve(monkeypatch) -> list:
    """Count the calls that take the checked path (cupyflash._kvcache.checks.resolve): a list that grows by one
    per such call."""
    calls = []
    resolve = _kvcache_args.resolve

    def counted(*args, **kwargs):
        calls.append(1)
        return resolve(*args, **kwargs)

    monkeypatch.setattr(_kvcache_args, "resolve", counted)
    return calls


def run(p: Problem, **changes):
    """attention_with_kvcache on problem p (options updated by ``changes``) with return_lse: out, lse."""
    options = dict(p.options, **changes)
    return cupyflash.attention_with_kvcache(p.q, p.k_cache, p.v_cache, p.k, p.v, return_lse=True, **options)


def check(p: Problem, call=run):
    """``call(p)`` (it returns out and lse) held to the reference (module docstring); returns out, lse."""
    before = on_host(p)
    out, lse = call(p)
    compare(before, p, out, lse)
    return out, lse


def reference_results(h: Problem):
    """The reference's out, lse and caches after the append for the host problem h."""
    options = {name: x for name, x in h.options.items() if name not in REFERENCE_IGNORES}
    return reference.attention_with_kvcache(
        h.q, h.k_cache, h.v_cache, h.k, h.v, return_lse=True, return_caches=True, **options
    )


def compare(h: Problem, p: Problem, out, lse):
    """Hold out, lse and p's caches (after the call) to the reference of h, p's host snapshot from before the
    call (the module docstring's three checks)."""
    ref_out, ref_lse, ref_k_cache, ref_v_cache = reference_results(h)
    dtype = h.q.dtype
    xp = cupy if is_cupy(p.q) else np
    for name, x in (("out", out), ("lse", lse)):
        assert isinstance(x, xp.ndarray), f"{name} is a {type(x).__qualname__}, expected {xp.__name__}.ndarray"
    assert (out.shape, out.dtype) == (ref_out.shape, dtype), f"out: {out.shape} {out.dtype}"
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    assert (lse.shape, lse.dtype) == (ref_lse.shape, lse_dtype), f"lse: {lse.shape} {lse.dtype}"
    mask = written(h)
    for name, original, ref in (("k_cache", h.k_cache, ref_k_cache), ("v_cache", h.v_cache, ref_v_cache)):
        cache = host_copy(getattr(p, name))
        np.testing.assert_array_equal(
            bits(cache)[~mask], bits(original)[~mask], err_msg=f"{name} changed outside the new positions"
        )
        new, expected = to_host(cache[mask]), ref[mask]
        if name == "v_cache" or "rotary_cos" not in h.options:
            np.testing.assert_array_equal(new, expected, err_msg=f"{name}: the appended values differ")
        else:
            bound = ROUNDING_RTOL[np.dtype(dtype).name] * max_abs(expected)
            error = max_abs(new - expected)
            assert error <= bound, f"{name}: the rotated new keys differ by {error:.3g} > one rounding {bound:.3g}"
    out, lse = to_host(out), to_host(lse)
    if dtype == np.float64:
        error, size = max_abs(out - ref_out), max_abs(ref_out)
        assert not np.isnan(out).any(), "out has NaN"
        assert error <= FLOAT64_RTOL * size, f"out differs by {error:.3g} (max|ref| {size:.3g}) beyond float64 rounding"
        seen = np.isfinite(ref_lse)
        np.testing.assert_array_equal(np.isneginf(lse), ~seen, err_msg="lse is -inf for other rows than the reference")
        bound = FLOAT64_RTOL * max(1.0, max_abs(ref_lse[seen]))
        assert max_abs(lse[seen] - ref_lse[seen]) <= bound, "lse differs beyond float64 rounding"
    else:
        naive_out, rounded_lse = naive(h, ref_k_cache, ref_v_cache)
        # Rotated q and k are rounded to the dtype (by us and by the naive alike): lse moves by what that
        # rounding moves the exact lse, which the reference of the rounded inputs measures.
        seen = np.isfinite(ref_lse)
        rounding = 2 * max_abs(rounded_lse[seen] - ref_lse[seen])
        assert_lse_close(lse, ref_lse, lse_atol(dtype, h.options.get("softcap")) + rounding)
        assert_close("out", out, ref_out, naive_out, dtype)


def written(h: Problem) -> np.ndarray:
    """Bool (cache.shape[:3]): the positions (dim 0, head, dim 2) of the caches that this call appends to
    (h: a host problem)."""
    mask = np.zeros(h.k_cache.shape[:3], dtype=bool)
    table, page_size = h.options.get("block_table"), h.k_cache.shape[2]
    table = None if table is None else np.asarray(table)  # (a block table may be given as nested lists)
    for b, start in enumerate(h.seqlens()):
        for pos in range(start, start + h.nnew):
            if table is None:
                mask[b, :, pos] = True
            else:
                mask[table[b, pos // page_size], :, pos % page_size] = True
    return mask


def naive(h: Problem, ref_k_cache, ref_v_cache):
    """out the naive way in the inputs' dtype (helpers.checks.naive_attention), sequence by sequence, from
    the rotated q and keys rounded to the dtype as a framework holding them in that dtype would; and the
    float64 reference lse of those rounded inputs (h: a host problem)."""
    o = h.options
    dtype, (batch, hq, nq, d), hk = h.q.dtype, h.q.shape, h.k_cache.shape[1]
    out = np.zeros((batch, hq, nq, h.v_cache.shape[3]), dtype=dtype)
    lse = np.full((batch, hq, nq), -np.inf)
    window, causal = o.get("window"), o.get("causal", False)
    slopes = o.get("alibi_slopes")
    for b, start in enumerate(h.seqlens()):
        length = int(start) + h.nnew
        if length == 0:
            continue
        q = h.q[b]
        if "rotary_cos" in o:
            advance = causal or window not in (None, (-1, -1))
            positions = start + (np.arange(nq) if advance else np.zeros(nq, dtype=int))
            q = reference.rotary(
                q, o["rotary_cos"], o["rotary_sin"], positions, o.get("rotary_interleaved", False)
            ).astype(dtype)
        keys, values = (sequence(h, cache, b, length).astype(dtype) for cache in (ref_k_cache, ref_v_cache))
        options = dict(window=window, softcap=o.get("softcap", 0.0))
        if slopes is not None:
            options["alibi_slopes"] = np.broadcast_to(slopes, (batch, hq))[b].reshape(hk, hq // hk)
        q, keys, values = q.reshape(hk, hq // hk, nq, d), keys[:, None], values[:, None]
        dout = np.zeros((hk, hq // hk, nq, values.shape[-1]), dtype=dtype)
        # As the modifiers' tests do: scale * q k^T is an op of its own (rounded) when more ops follow it.
        out_b, *_ = naive_attention(
            q,
            keys,
            values,
            dout,
            causal=causal,
            scale=o.get("scale"),
            round_scaled_scores=bool(options["softcap"] or slopes is not None),
            **options,
        )
        _, lse_b = reference.attention(q, keys, values, causal=causal, scale=o.get("scale"), return_lse=True, **options)
        out[b], lse[b] = out_b.reshape(out.shape[1:]), lse_b.reshape(hq, nq)
    return to_host(out), lse


def sequence(h: Problem, cache, b, length):
    """Positions 0 .. length - 1 of sequence b in a (host) cache of h's layout: (Hk, length, D)."""
    table = h.options.get("block_table")
    if table is None:
        return cache[b, :, :length]
    table = np.asarray(table)  # (nested lists too)
    positions = np.arange(length)
    page_size = cache.shape[2]
    return cache[table[b, positions // page_size], :, positions % page_size].transpose(1, 0, 2)
