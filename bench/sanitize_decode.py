"""Decode calls for compute-sanitizer: the shipped decode tiles (16-bit D = 128 and 256 at two CTAs per SM,
D = 64, float32 D = 96), contiguous and paged caches in random page order, split and not, with a window and a
softcap; each call is checked against the float64 reference (cupyflash._kvcache.reference) and prints its error.
Then FP8 caches on the keys-as-rows kernel (attention_decode_fp8.cu: D = 32 to 256, contiguous and pages of 16 and
64, 1 to 8 packed rows, window, softcap, ALiBi), each checked against the library's float32 attention on the
dequantized cache (the float64 reference is too slow under the sanitizer).

    compute-sanitizer --tool memcheck python bench/sanitize_decode.py
    compute-sanitizer --tool racecheck python bench/sanitize_decode.py
"""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash._kvcache import reference  # noqa: E402

# (dtype, head dim, page size or None, window, softcap, longest sequence)
CASES = [
    (ml_dtypes.bfloat16, 128, None, None, 0.0, 3000),
    (np.float16, 128, 16, (256, 0), 0.0, 1500),
    (ml_dtypes.bfloat16, 256, 64, None, 30.0, 2100),
    (ml_dtypes.bfloat16, 64, None, None, 0.0, 700),
    (np.float32, 96, 16, None, 0.0, 900),
]


def main() -> int:
    rng = np.random.default_rng(1)
    bad = 0
    for dtype, d, page, window, softcap, nk in CASES:
        b, hq, hk, ncache = 3, 8, 2, 4096
        lens = np.array([nk, nk // 2, 1], np.int32)
        q = rng.standard_normal((b, hq, 1, d)).astype(dtype)
        if page:
            pages = b * ncache // page
            k_cache, v_cache = (rng.standard_normal((pages, hk, page, d)).astype(dtype) for _ in range(2))
            table = rng.permutation(pages).reshape(b, -1).astype(np.int32)
        else:
            k_cache, v_cache = (rng.standard_normal((b, hk, ncache, d)).astype(dtype) for _ in range(2))
            table = None
        options = dict(cache_seqlens=lens, window=window, softcap=softcap, block_table=table)
        on_gpu = dict(
            options, cache_seqlens=cupy.asarray(lens), block_table=None if table is None else cupy.asarray(table)
        )
        out = cupyflash.attention_with_kvcache(cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), **on_gpu)
        expected = reference.attention_with_kvcache(*(x.astype(np.float64) for x in (q, k_cache, v_cache)), **options)
        error = np.abs(cupy.asnumpy(out).astype(np.float64) - expected).max() / np.abs(expected).max()
        ok = error < 2e-2
        bad += not ok
        print(
            f"{np.dtype(dtype).name} D{d} page {page} window {window} softcap {softcap}: rel error {error:.2e}",
            "OK" if ok else "BAD",
            flush=True,
        )
    return bad + fp8_calls()


# (q dtype, head dim, page size or None, window, softcap, ALiBi, longest sequence, Hq, Hk, Nq)
FP8_CASES = [
    (ml_dtypes.bfloat16, 128, None, None, 0.0, False, 3000, 8, 2, 1),
    (np.float16, 128, 16, (256, 0), 0.0, False, 1500, 16, 2, 1),
    (ml_dtypes.bfloat16, 256, 64, None, 30.0, False, 2100, 8, 2, 2),
    (ml_dtypes.bfloat16, 64, None, None, 0.0, True, 700, 4, 1, 2),
    (np.float16, 32, 16, (100, 0), 0.0, False, 900, 8, 8, 1),
]


def fp8_calls() -> int:
    """The FP8 cases; returns how many were off."""
    rng = np.random.default_rng(2)
    bad = 0
    for dtype, d, page, window, softcap, alibi, nk, hq, hk, nq in FP8_CASES:
        b, ncache = 3, 4096
        lens = cupy.asarray(np.array([nk, nk // 2, 1], np.int32))
        q = cupy.asarray(rng.standard_normal((b, hq, nq, d)).astype(dtype))
        shape = (b * ncache // page, hk, page, d) if page else (b, hk, ncache, d)
        k_cache, v_cache = (cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(2))
        table = cupy.asarray(rng.permutation(shape[0]).reshape(b, -1).astype(np.int32)) if page else None
        k8, v8 = cupyflash.quantize_kvcache(k_cache), cupyflash.quantize_kvcache(v_cache)
        slopes = cupy.asarray(rng.uniform(0.01, 0.1, (b, hq)).astype(np.float32)) if alibi else None
        options = dict(
            cache_seqlens=lens, window=window, softcap=softcap, block_table=table, alibi_slopes=slopes, causal=True
        )
        out = cupyflash.attention_with_kvcache(q, k8, v8, **options).astype(np.float32)
        expected = cupyflash.attention_with_kvcache(
            q.astype(np.float32), k8.dequantize(np.float32), v8.dequantize(np.float32), **options
        )
        error = float(cupy.abs(out - expected).max() / cupy.abs(expected).max())
        ok = error < 2e-2
        bad += not ok
        print(
            f"FP8 {np.dtype(dtype).name} D{d} page {page} window {window} softcap {softcap} ALiBi {alibi} rows "
            f"{hq // hk * nq}: rel error {error:.2e}",
            "OK" if ok else "BAD",
            flush=True,
        )
    return bad


if __name__ == "__main__":
    sys.exit(main())
