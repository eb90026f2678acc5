"""Decoding from FP8 (e4m3) key/value caches: cupyflash.attention_with_kvcache on FP8KVCache holders against our
own bfloat16-cache decode and torch SDPA's cuDNN and flash (FlashAttention-2) back ends (bfloat16 caches) in the
same run, and the FP8 kernel's accuracy for each scale layout.

Speed rows (bf16 q, D = 128, 32/8 heads, Nq = 1, one sequence length for the batch): GPU time behind a spin
kernel and a user's loop's time per call, as bench_decode.py times them (its functions); caches under 256 MB
rotate among copies so that no row runs out of L2. The FP8 caches are the bf16 caches quantized (block scales
unless the row says otherwise), sequence by sequence to bound the memory a 16 GB cache needs on the way.
Paged rows put the same FP8 caches in pages of 16 or 64 in random order.

Accuracy rows (B = 2, every head): relative Frobenius error of out against float64 attention of (a) the
dequantized cache (the kernel's own error) and (b) the original bf16 values (the format's cost), for N(0, 1)
data and data whose key dims 0-3 are 10x larger (outlier channels).

    python bench/bench_decode_fp8.py [--only speed,paged,accuracy] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402
import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cupyflash  # noqa: E402

BF16 = ml_dtypes.bfloat16
HQ, HK, D = 32, 8, 128


def quantized(x, scaling):
    """quantize_kvcache of a CuPy cache, one sequence (or page group) at a time for "block" (the scales are per
    block, so slicing changes nothing); whole for "tensor" and "head"."""
    if scaling != "block":
        return cupyflash.quantize_kvcache(x, scaling)
    parts = [cupyflash.quantize_kvcache(x[i : i + 1], "block") for i in range(x.shape[0])]
    data = cupy.concatenate([p.data for p in parts])
    scale = cupy.concatenate([p.scale for p in parts])
    del parts
    return cupyflash.FP8KVCache(data, scale, "block")


def paginate(holders, page_size, rng):
    """The holders' sequences in pages of ``page_size`` in one random order: (holders, block table). Pages of up to
    128 positions lie inside one block of the contiguous scales: each page takes its block's scale."""
    batch, hk, nk, d = holders[0].shape
    pages = math.ceil(nk / page_size)
    order = cupy.asarray(rng.permutation(batch * pages))
    table = order.reshape(batch, pages).astype(np.int32)

    def spread(x, width):
        full = cupy.zeros((batch, hk, pages * page_size, width), dtype=x.dtype)
        full[:, :, : x.shape[2]] = x
        blocks = full.reshape(batch, hk, pages, page_size, width).transpose(0, 2, 1, 3, 4)
        out = cupy.empty((batch * pages, hk, page_size, width), dtype=x.dtype)
        out[order] = blocks.reshape(batch * pages, hk, page_size, width)
        return out

    paged = []
    for holder in holders:
        per_position = cupy.repeat(holder.scale, holder.block, axis=2)[:, :, :nk, None]
        scale = cupy.ascontiguousarray(spread(per_position, 1)[:, :, 0, 0][:, :, None])
        paged.append(cupyflash.FP8KVCache(spread(holder.data, d), scale, "block"))
    return paged, table


def speed_row(rng, batch, nk, page_size=None, scaling="block"):
    problem = bench_decode.Problem(rng, BF16, batch, HQ, HK, 1, nk, D, None)
    result = dict(B=batch, Nk=nk, page_size=page_size, scaling=scaling, kv_mb=problem.kv_bytes / 2**20)
    fp8_sets = {}
    for s in problem.sets:
        holders, table = [quantized(s["k"], scaling), quantized(s["v"], scaling)], None
        if page_size:
            holders, table = paginate(holders, page_size, rng)
        fp8_sets[id(s)] = (*holders, table)
    seqlens = problem.seqlens

    def fp8(s):
        k8, v8, table = fp8_sets[id(s)]
        return cupyflash.attention_with_kvcache(s["q"], k8, v8, cache_seqlens=seqlens, block_table=table, causal=True)

    runs = {"fp8": fp8, "bf16": bench_decode.ours(problem)}
    runs.update({peer: bench_decode.peer(problem, peer) for peer in ("cudnn", "flash")})
    # our bf16 step against float64, the peers against it (bench_decode.check raises on a gap), FP8 against it
    result["bf16_error"] = bench_decode.check(
        problem, rng, {"ours": runs["bf16"], "cudnn": runs["cudnn"], "flash": runs["flash"]}
    )
    s = problem.sets[0]
    got, want = fp8(s).astype(np.float32), runs["bf16"](s).astype(np.float32)
    result["fp8_vs_bf16"] = float(cupy.linalg.norm(got - want) / cupy.linalg.norm(want))
    if not result["fp8_vs_bf16"] < 0.1:
        raise AssertionError(f"FP8 decode off by {result['fp8_vs_bf16']:.3g} from the bf16 decode")
    for name, run in runs.items():
        fn = bench_decode.rotating(problem, run)
        result[f"{name}_gpu_us"] = bench_decode.gpu_time_us(fn)
        result[f"{name}_loop_us"] = bench_decode.loop_time_us(fn)
    result["fp8_tbps"] = problem.kv_bytes / 2 / (result["fp8_gpu_us"] * 1e-6) / 1e12
    fp8_sets.clear()
    del problem, runs
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def attention64(q, k, v):
    """float64 attention of one sequence, q (Hq, 1, D) over k, v (Hk, N, D), grouped heads (no copies of k, v)."""
    hk, group = k.shape[0], q.shape[0] // k.shape[0]
    qg = q.reshape(hk, group, q.shape[-1])
    s = np.matmul(qg, k.transpose(0, 2, 1)) / math.sqrt(q.shape[-1])  # (Hk, G, N)
    p = np.exp(s - s.max(-1, keepdims=True))
    out = np.matmul(p, v) / p.sum(-1, keepdims=True)
    return out.reshape(q.shape[0], 1, v.shape[-1])


def accuracy_row(rng, nk, scaling, outliers):
    batch = 2
    k = rng.standard_normal((batch, HK, nk, D), dtype=np.float32)
    if outliers:
        k[..., :4] *= 10.0
    k = k.astype(BF16)
    v = rng.standard_normal((batch, HK, nk, D), dtype=np.float32).astype(BF16)
    q = rng.standard_normal((batch, HQ, 1, D), dtype=np.float32).astype(BF16)
    k8, v8 = (cupyflash.quantize_kvcache(cupy.asarray(x), scaling) for x in (k, v))
    out = cupyflash.attention_with_kvcache(cupy.asarray(q), k8, v8, cache_seqlens=nk).view(np.uint16).get().view(BF16)
    kd, vd = k8.dequantize(np.float64).get(), v8.dequantize(np.float64).get()
    errors = {"vs dequantized": [], "vs bf16 values": []}
    for b in range(batch):
        got = out[b].astype(np.float64)
        qb = q[b].astype(np.float64)
        for name, (kk, vv) in (("vs dequantized", (kd[b], vd[b])), ("vs bf16 values", (k[b], v[b]))):
            ref = attention64(qb, kk.astype(np.float64), vv.astype(np.float64))
            errors[name].append((np.linalg.norm(got - ref) ** 2, np.linalg.norm(ref) ** 2))
    row = dict(Nk=nk, scaling=scaling, data="outlier channels" if outliers else "N(0, 1)")
    for name, parts in errors.items():
        row[name] = math.sqrt(sum(e for e, _ in parts) / sum(r for _, r in parts))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="speed,paged,accuracy")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    parts = set(args.only.split(","))
    rng = np.random.default_rng(0)
    results = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), speed=[], accuracy=[])
    rows = []
    if "speed" in parts:
        rows += [(b, n, None, "block") for b in (8, 64) for n in (32768, 131072)] + [(8, 32768, None, "head")]
    if "paged" in parts:
        rows += [(b, 32768, page, "block") for b in (8, 64) for page in (16, 64)]
    for batch, nk, page_size, scaling in rows:
        r = speed_row(rng, batch, nk, page_size, scaling)
        results["speed"].append(r)
        peers = ("bf16", "cudnn", "flash")
        print(
            f"B{batch:<3} Nk{nk // 1024:>4}k page {str(page_size):>4} {scaling:6} | gpu us fp8 {r['fp8_gpu_us']:8.1f} "
            + " ".join(f"{p} {r[f'{p}_gpu_us']:8.1f}" for p in peers)
            + " | "
            + " ".join(f"fp8/{p} {r['fp8_gpu_us'] / r[f'{p}_gpu_us']:.3f}" for p in peers)
            + f" | loop fp8 {r['fp8_loop_us']:8.1f} "
            + " ".join(f"{p} {r[f'{p}_loop_us']:8.1f}" for p in peers)
            + f" | {r['fp8_tbps']:.2f} TB/s | vs bf16 decode {r['fp8_vs_bf16']:.2e}",
            flush=True,
        )
    if "accuracy" in parts:
        for nk in (32768, 131072):
            for outliers in (False, True):
                for scaling in ("tensor", "head", "block"):
                    r = accuracy_row(rng, nk, scaling, outliers)
                    results["accuracy"].append(r)
                    print(
                        f"Nk{nk // 1024:>4}k {r['data']:17} {scaling:6} | (a) vs dequantized {r['vs dequantized']:.2e}"
                        f" | (b) vs bf16 values {r['vs bf16 values']:.2e}",
                        flush=True,
                    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
