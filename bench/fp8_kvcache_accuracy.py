"""What an FP8 (e4m3) key/value cache costs in accuracy, measured on the CPU with NumPy, for each scale layout
(docs/design/fp8_kvcache.md holds the table and the decisions it supports).

Data: the cache's original values are bfloat16: k, v ~ N(0, 1), or k with outlier channels (key dims 0, 1, 2, 3
of every position 10x larger, as trained models' keys have); q ~ N(0, 1), bfloat16. D = 128, Hq = 8 query heads
over Hk = 2 key/value heads, Nq = 16 queries per sequence that see every key (a decoding step's row, 16 of them
per sequence for the statistics), at (B, Nk) = (8, 512), (4, 4096) and (1, 32768).

Errors are relative Frobenius norms, ||out - ref|| / ||ref|| over all rows:

- (a) cupyflash.attention_with_kvcache on the FP8 cache (the CPU path) against float64 attention of the
  *dequantized* cache: the implementation's own error, which the issue bounds by 5e-3;
- (b) the same out against float64 attention of the original bfloat16 values: the format's own cost;
- three emulations of a GPU kernel against the dequantized cache (a) (float64 arithmetic with the kernel's
  roundings): "K/V to bf16" converts the e4m3 codes to bfloat16 (exactly) and multiplies by the scales in float32,
  P rounded to bfloat16 for the P V product; "q to e4m3" rounds each query row to e4m3 (its own amax / 448 scale)
  for FP8 tensor cores in Q K^T, P still bfloat16; "q, P to e4m3" also rounds P to e4m3 (x 2^8) for the P V
  product on FP8 tensor cores, as the FP8 forward does.

Caches: each layout by ``quantize_kvcache``; "block, by appends": the cache built by decoding, one position per
call (``attention_with_kvcache`` with Nq = 0), each block's scale set by its first position's row at amax / 28 (a
headroom of 16); "... headroom 4" and "... headroom 1": the same with the scales at amax / 112 and amax / 448 (an
experiment: the library's constant patched); "bf16": the bfloat16 cache itself, through the same CPU path. The
column "saturated" counts the codes of k and v at +-448 (values cut to 448 times their scale), "k's rounding" is
the relative error of the dequantized k against the original.

The caches with less headroom are built up to Nk = 4096 only, and the kernels emulated on the library's caches
only (time).

A second table: the outlier-channel data at (4, 4096), quantized with every scale multiplied by a factor that is
not a power of two (the divisor 28 replaced), which moves where each block's largest value lands (28 is an e4m3
value; 28.4, 25.1 and 31.3 round to 28, 26 and 32). A third: (b) on outlier-channel data at (4, 2048), eight
draws, for each layout quantized at once and for block scales built by appends.

    python bench/fp8_kvcache_accuracy.py          # about 2.5 minutes on 2 cores
"""

# %%
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash._fp8.tensor import decode_e4m3, encode_e4m3  # noqa: E402
from cupyflash._kvcache import fp8 as kvcache_fp8  # noqa: E402

BF16 = ml_dtypes.bfloat16
HQ, HK, D, NQ = 8, 2, 128, 16
CASES = [(8, 512), (4, 4096), (1, 32768)]
HEADROOM_EXPERIMENT_NK = 4096  # the caches built with less headroom: up to this Nk (time)
OUTLIER_DIMS, OUTLIER_FACTOR = [0, 1, 2, 3], 10.0
SCALE = 1 / np.sqrt(D)


# %% data
def draw(rng, batch, nk, outliers):
    """q, k, v as bfloat16: q (B, Hq, Nq, D), k and v (B, Hk, Nk, D)."""
    q = rng.standard_normal((batch, HQ, NQ, D), dtype=np.float32).astype(BF16)
    k = rng.standard_normal((batch, HK, nk, D), dtype=np.float32)
    if outliers:
        k[..., OUTLIER_DIMS] *= OUTLIER_FACTOR
    v = rng.standard_normal((batch, HK, nk, D), dtype=np.float32)
    return q, k.astype(BF16), v.astype(BF16)


# %% float64 attention, and the kernels' emulations
def _grouped(q):
    """q (B, Hq, Nq, D) as (B, Hk, G Nq, D): the rows of the query heads that share a key/value head."""
    batch = q.shape[0]
    return q.astype(np.float64).reshape(batch, HK, (HQ // HK) * NQ, D)


def _ungrouped(out):
    return out.reshape(out.shape[0], HQ, NQ, out.shape[-1])


def attend64(q, k, v):
    """float64 attention of every query over every key (k, v float arrays (B, Hk, Nk, D))."""
    s = SCALE * (_grouped(q) @ k.astype(np.float64).swapaxes(-1, -2))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return _ungrouped((p @ v.astype(np.float64)) / p.sum(axis=-1, keepdims=True))


def _e4m3(x):
    return decode_e4m3(encode_e4m3(x), np.float64)


def emulate(q, k8, v8, *, q_e4m3, p_e4m3):
    """The kernel of the module docstring on the FP8 caches: S from the e4m3 codes of k (and of q, ``q_e4m3``)
    times the scales; P rounded to bfloat16, or to e4m3 at 2^8 (``p_e4m3``) for the P V product with v's codes,
    v's scales applied to the product; l summed before P's rounding; out rounded to bfloat16."""
    qg = _grouped(q)
    if q_e4m3:  # one scale per query row, its amax at 448
        sq = np.abs(qg).max(axis=-1, keepdims=True) / 448
        qg = _e4m3(qg / sq) * sq
    kd, vd = decode_e4m3(k8.data, np.float64), decode_e4m3(v8.data, np.float64)
    sk, sv = k8.position_scales(np.float64), v8.position_scales(np.float64)  # (B or 1, Hk or 1, Nk)
    s = SCALE * (qg @ kd.swapaxes(-1, -2)) * sk[:, :, None, :]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    rounded = _e4m3(p * 256) / 256 if p_e4m3 else p.astype(BF16).astype(np.float64)
    out = ((rounded * sv[:, :, None, :]) @ vd) / p.sum(axis=-1, keepdims=True)
    return _ungrouped(out).astype(BF16)


def relative_error(out, ref):
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


# %% caches built by decoding
def patched_divisor(divisor, make):
    """``make()`` with the library's scales at amax / ``divisor`` (an experiment; restored after)."""
    saved, kvcache_fp8.SCALE_DIVISOR = kvcache_fp8.SCALE_DIVISOR, np.float32(divisor)
    try:
        return make()
    finally:
        kvcache_fp8.SCALE_DIVISOR = saved


def by_appends(k, v, headroom=kvcache_fp8.HEADROOM):
    """Block-scaled FP8 caches filled one position per call, as decoding fills them (every block's scale from
    its first position's row), with scales at amax / (448 / ``headroom``)."""
    batch, _, nk, _ = k.shape
    empty = [
        cupyflash.FP8KVCache(np.zeros(x.shape, np.uint8), np.ones((batch, HK, -(-nk // 128)), np.float32), "block")
        for x in (k, v)
    ]
    q = np.zeros((batch, HQ, 0, D), BF16)

    def fill():
        for position in range(nk):
            step = slice(position, position + 1)
            cupyflash.attention_with_kvcache(q, *empty, k[:, :, step], v[:, :, step], cache_seqlens=position)
        return empty

    return patched_divisor(448 / headroom, fill)


def saturated(*caches):
    return sum(int(((x.data & 0x7F) == 0x7E).sum()) for x in caches)


# %% the table
def rows(cases=CASES, seed=0):
    """One dict per (data, case, cache): the errors of the module docstring."""
    rng = np.random.default_rng(seed)
    for outliers in (False, True):
        for batch, nk in cases:
            q, k, v = draw(rng, batch, nk, outliers)
            original = attend64(q, k, v)
            caches = {
                scaling: [cupyflash.quantize_kvcache(x, scaling) for x in (k, v)] for scaling in ("tensor", "head")
            }
            caches["block"] = [cupyflash.quantize_kvcache(x, "block") for x in (k, v)]
            caches["block, by appends"] = by_appends(k, v)
            if nk <= HEADROOM_EXPERIMENT_NK:
                caches["block, by appends, headroom 4"] = by_appends(k, v, headroom=4)
                caches["block, by appends, headroom 1"] = by_appends(k, v, headroom=1)
            common = dict(data="outlier channels" if outliers else "N(0, 1)", batch=batch, nk=nk)
            for name, (k8, v8) in caches.items():
                out = cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk)
                dequantized = attend64(q, k8.dequantize(np.float64), v8.dequantize(np.float64))
                emulated = {}
                if "headroom" not in name:
                    emulated = {
                        "K/V to bf16": emulate(q, k8, v8, q_e4m3=False, p_e4m3=False),
                        "q to e4m3": emulate(q, k8, v8, q_e4m3=True, p_e4m3=False),
                        "q, P to e4m3": emulate(q, k8, v8, q_e4m3=True, p_e4m3=True),
                    }
                yield dict(
                    common,
                    cache=name,
                    saturated=saturated(k8, v8),
                    rounding=relative_error(k8.dequantize(np.float64), k),
                    a=relative_error(out, dequantized),
                    b=relative_error(out, original),
                    **{key: relative_error(x, dequantized) for key, x in emulated.items()},
                )
            out = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=nk)
            yield dict(common, cache="bf16", a=relative_error(out, original), b=relative_error(out, original))


COLUMNS = ("saturated", "rounding", "a", "b", "K/V to bf16", "q to e4m3", "q, P to e4m3")


def markdown(found):
    """The rows as a Markdown table."""
    lines = [
        "| data | B x Nk | cache | saturated | k's rounding | (a) vs dequantized | (b) vs bf16 values | K/V to bf16 "
        "| q to e4m3 | q, P to e4m3 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        cells = [("" if c not in r else str(r[c]) if c == "saturated" else f"{r[c]:.1e}") for c in COLUMNS]
        lines.append(f"| {r['data']} | {r['batch']} x {r['nk']} | {r['cache']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds(batch=4, nk=2048, count=8):
    """The third table (module docstring), as Markdown: (b) on outlier-channel data for several draws."""
    found = {name: [] for name in ("tensor", "head", "block", "block, by appends")}
    worst = []  # the share of the squared error in the worst tenth of the rows (per-tensor scales)
    for seed in range(count):
        q, k, v = draw(np.random.default_rng(100 + seed), batch, nk, outliers=True)
        original = attend64(q, k, v)
        k8, v8 = [cupyflash.quantize_kvcache(x, "tensor") for x in (k, v)]
        rows_error = np.sum((cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk) - original) ** 2, axis=-1)
        ordered = np.sort(rows_error.ravel())[::-1]
        worst.append(ordered[: max(1, ordered.size // 10)].sum() / ordered.sum())
        for name in found:
            k8, v8 = (
                by_appends(k, v) if name.endswith("appends") else [cupyflash.quantize_kvcache(x, name) for x in (k, v)]
            )
            found[name].append(relative_error(cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk), original))
    lines = ["| cache | " + " | ".join(f"seed {100 + i}" for i in range(count)) + " | geometric mean |"]
    lines.append("|---" * (count + 2) + "|")
    for name, errors in found.items():
        cells = [f"{e:.3f}" for e in errors] + [f"{np.exp(np.mean(np.log(errors))):.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nThe worst tenth of the rows holds {min(worst):.0%} to {max(worst):.0%} of the squared error (tensor)."
    )
    return "\n".join(lines)


def spread(batch=4, nk=4096, divisors=(28, 28.4, 25.1, 31.3), seed=1):
    """The second table (module docstring), as Markdown: (b) per layout and divisor."""
    q, k, v = draw(np.random.default_rng(seed), batch, nk, outliers=True)
    original = attend64(q, k, v)
    lines = ["| scales at | tensor | head | block |", "|---|---|---|---|"]
    for divisor in divisors:
        cells = []
        for scaling in ("tensor", "head", "block"):
            k8, v8 = patched_divisor(divisor, lambda: [cupyflash.quantize_kvcache(x, scaling) for x in (k, v)])
            cells.append(
                f"{relative_error(cupyflash.attention_with_kvcache(q, k8, v8, cache_seqlens=nk), original):.1e}"
            )
        lines.append(f"| amax / {divisor} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# %%
if __name__ == "__main__":
    start = time.time()
    found = []
    for row in rows():
        found.append(row)
        print(f"  {row['data']}, {row['batch']} x {row['nk']}, {row['cache']}: done", file=sys.stderr, flush=True)
    print(markdown(found))
    print()
    print(spread())
    print()
    print(seeds())
    print(f"\n{time.time() - start:.0f} s", file=sys.stderr)
