"""The warp-specialized fused backward (cuda_src/attention_bwd_ws.cu), in each order of its dq adds (by arrival,
the shipped one where the host allows it; by key-block index; unordered, walking rotated or by index), against
the two-pass backward, the library's own choice (ordered, and with deterministic=False) and cuDNN (torch SDPA)
in the same run. Correctness first: on a small awkward problem
each of dq, dk, dv against a float64 reference (max error beside the two-pass backward's), and on every timed
problem against the two-pass results. Then the median of 15 (L2 flushed and a spin before each call, GPU work
only) on FlashAttention's shapes (16k tokens, hidden 2048). The fused forms' times include everything they
launch: zeroing dq_accum and the counters (the library zeroes the counters alone), the preprocess, the main
kernel and dq's conversion. Writes $OUT/ws_backward.json.

    PYTHONPATH=. python bench/exp/15_ws_backward.py [--dims 128,64] [--seqlens 1k,2k,8k] [--check-only]
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash import _timing
from cupyflash._cuda import plans, tile_policy, tiles, tma
from cupyflash._cuda.compile import current_device, functions
from cupyflash._cuda.launch import CPointer, launch
from cupyflash._cuda.params import PARAMS_BYTES, dense_params, layout
from cupyflash._cuda.variants import Features, Variant

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_attention  # noqa: E402  (TorchSDPA)

BF16 = np.dtype(ml_dtypes.bfloat16)
parser = argparse.ArgumentParser()
parser.add_argument("--dims", default="128,64")
parser.add_argument("--seqlens", default="1k,2k,8k")
parser.add_argument("--check-only", action="store_true")
args = parser.parse_args()
dims = [int(x) for x in args.dims.split(",")]
seqlens = [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in args.seqlens.split(",")]


def kernels(d, causal, deterministic):
    """The library's fused-backward kernels of this head dim (its tile-table cell), and the cell."""
    variant = Variant("bwd", "bfloat16", d, "ws", causal=causal, deterministic=deterministic)
    found = functions(variant)
    return found["bwd"], found["dq_convert"], variant


class Fused:
    """One problem's fused backward, its parameters and tensor maps made once (as a plan would)."""

    def __init__(self, q, k, v, out, lse, dout, causal, deterministic=True, by_arrival=None):
        self.batch_shape, (nq, d), nk = q.shape[:-2], q.shape[-2:], k.shape[-2]
        self.nq, self.nk, self.d, self.causal = nq, nk, d, causal
        self.batch = math.prod(self.batch_shape)
        self.main, self.convert, self.variant = kernels(d, causal, deterministic)
        t = self.variant.tiles("bwd")
        self.bm, self.keys = t.block, t.rows  # query rows a step, keys a CTA
        self.dq, self.dk, self.dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        self.lse_log2, self.delta = cupy.empty_like(lse), cupy.empty_like(lse)
        self.m_blocks = -(-nq // self.bm)
        # dq_accum and the counters of the ordered adds, zeroed by one fill per call
        chains = tiles.ws_bwd_dq_chains(self.variant.tiles("bwd"), deterministic)
        self.workspace = cupy.empty(self.batch * self.m_blocks * chains * (self.bm * d + 1), dtype=cupy.float32)
        self.dq_accum = self.workspace[: self.batch * self.m_blocks * chains * self.bm * d]
        self.counters = self.workspace[self.dq_accum.size :].view(cupy.int32)
        arrays, sizes, strides, _ = layout(self.batch_shape, {"q": q, "k": k, "v": v, "out": out, "dout": dout})
        others = {
            "dq": self.dq,
            "dk": self.dk,
            "dv": self.dv,
            "lse": lse,
            "lse_log2": self.lse_log2,
            "delta": self.delta,
        }
        self.params = dense_params(
            arrays,
            sizes,
            strides,
            batch=self.batch,
            nq=nq,
            nk=nk,
            d=d,
            d_v=d,
            scale=1 / math.sqrt(d),
            others=others,
            causal=causal,
        )
        self.pre_variant = tile_policy.dense(Features.of("bwd", q.dtype, d, d, causal, None), current_device())
        self.pre = functions(self.pre_variant)
        maps = tma.TensorMaps(arrays, sizes, strides, {"q": self.bm, "k": self.keys, "v": self.keys, "dout": self.bm})
        self.maps = maps.encode({"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "dout": dout.data.ptr})
        # Key blocks take their turn by arrival where a batch entry's CTAs can all be resident at once.
        key_blocks = -(-nk // self.keys)
        fits = key_blocks <= cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        self.by_arrival = np.int32(fits if by_arrival is None else by_arrival)

    def __call__(self):
        self.workspace.fill(0)
        launch(self.pre, self.pre_variant, "preprocess", self.nq, self.batch, self.params)
        arg = self.params.view(PARAMS_BYTES)
        self.main(
            (-(-self.nk // self.keys), self.batch),
            (384,),
            (arg, CPointer(self.maps.ctypes.data), self.dq_accum, self.counters, self.by_arrival),
            shared_mem=self.variant.smem("bwd"),
        )
        self.convert((self.m_blocks, self.batch), (256,), (arg, self.dq_accum))
        return self.dq, self.dk, self.dv


def two_passes(dout, q, k, v, out, lse, causal):
    """The library's two-pass backward (the fused one's threshold set past every length)."""
    saved = dict(tile_policy.WS_BWD_MIN_LENGTH)
    tile_policy.WS_BWD_MIN_LENGTH.update({d: 1 << 30 for d in saved})
    try:
        return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    finally:
        tile_policy.WS_BWD_MIN_LENGTH.update(saved)
        plans.clear()


def f64(x):
    return cupy.asarray(bench_attention.float32_if_bf16(x), dtype=cupy.float64)


def reference_grads(q, k, v, dout, causal):
    q, k, v, dout = (f64(x) for x in (q, k, v, dout))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    s = q @ k.swapaxes(-1, -2) / math.sqrt(d)
    if causal:
        s = cupy.where(cupy.tri(nq, nk, k=nk - nq, dtype=bool), s, -cupy.inf)
    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(cupy.isfinite(m), m, 0)
    p = cupy.exp(s - m)
    p /= cupy.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    out = p @ v
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (dout * out).sum(axis=-1, keepdims=True))
    return ds @ k / math.sqrt(d), ds.swapaxes(-1, -2) @ q / math.sqrt(d), p.swapaxes(-1, -2) @ dout


def rand(shape):
    return cupy.asarray(np.random.default_rng().standard_normal(shape).astype(BF16))


def max_err(x, ref):
    return float(cupy.abs(f64(x) - ref).max() / cupy.abs(ref).max())


results = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "checks": [], "timings": []}
# Small awkward problems against float64: nq != nk, sizes off every block, causal both ways round.
for d in dims:
    for causal in (False, True):
        for nq, nk in ((333, 397), (397, 261), (128, 128)):
            q, k, v, dout = rand((2, 3, nq, d)), rand((2, 3, nk, d)), rand((2, 3, nk, d)), rand((2, 3, nq, d))
            ref = reference_grads(q, k, v, dout, causal)
            out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
            cupy.cuda.Device().synchronize()
            fused = Fused(q, k, v, out, lse, dout, causal)
            for x in (fused.dq, fused.dk, fused.dv):
                x.view(cupy.uint16).fill(0x7FC0)  # NaN: every element must be written
            got = [x.copy() for x in fused()]
            again = [x.copy() for x in fused()]
            assert all(bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()) for a, b in zip(got, again)), (
                "not bitwise reproducible"
            )
            two_pass = two_passes(dout, q, k, v, out, lse, causal)
            for other in (
                Fused(q, k, v, out, lse, dout, causal, by_arrival=False),
                Fused(q, k, v, out, lse, dout, causal, deterministic=False),
            ):
                errs = [max_err(x, r) for x, r in zip(other(), ref)]
                assert max(errs) < 2 * max(max_err(x, r) for x, r in zip(two_pass, ref)), errs
            row = {
                "d": d,
                "causal": causal,
                "nq": nq,
                "nk": nk,
                "fused": [max_err(x, r) for x, r in zip(got, ref)],
                "two_pass": [max_err(x, r) for x, r in zip(two_pass, ref)],
            }
            results["checks"].append(row)
            print(
                f"check D={d} causal={causal} {nq}x{nk}: fused dq/dk/dv "
                + " ".join(f"{e:.2e}" for e in row["fused"])
                + " | two-pass "
                + " ".join(f"{e:.2e}" for e in row["two_pass"]),
                flush=True,
            )

flush = cupy.empty(256 << 20, dtype=cupy.uint8)


def ms(fn):
    def before():
        flush.fill(0)
        _timing.spin(10)

    return _timing.median_ms(fn, warmup=3, repeats=15, before_each=before)


if not args.check_only:
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                heads, batch = 2048 // d, 16384 // n
                shape = (batch, heads, n, d)
                q, k, v, dout = rand(shape), rand(shape), rand(shape), rand(shape)
                out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
                fused = Fused(q, k, v, out, lse, dout, causal)
                unordered = Fused(q, k, v, out, lse, dout, causal, deterministic=False)
                by_index = Fused(q, k, v, out, lse, dout, causal, by_arrival=False)
                unordered_by_index = Fused(q, k, v, out, lse, dout, causal, deterministic=False, by_arrival=False)
                got = [x.copy() for x in fused()]
                again = [x.copy() for x in fused()]
                same = all(bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()) for a, b in zip(got, again))
                two_pass = two_passes(dout, q, k, v, out, lse, causal)
                agree = [float(cupy.abs(f64(a) - f64(b)).max() / cupy.abs(f64(b)).max()) for a, b in zip(got, two_pass)]
                t_fused = ms(fused)
                t_unordered = ms(unordered)
                t_by_index = ms(by_index)
                t_unordered_by_index = ms(unordered_by_index)
                t_library_unordered = ms(
                    lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False)
                )
                t_two = ms(lambda: two_passes(dout, q, k, v, out, lse, causal))
                t_library = ms(lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
                sdpa = bench_attention.TorchSDPA("cudnn", q, k, v, dout, causal, 1 / math.sqrt(d))
                sdpa.prepare_backward()
                t_cudnn = ms(sdpa.backward)
                flops = 2.5 * 4 * batch * heads * n * n * d * (0.5 if causal else 1)
                times = {
                    "fused": t_fused,
                    "unordered": t_unordered,
                    "by_index": t_by_index,
                    "unordered_by_index": t_unordered_by_index,
                    "library_unordered": t_library_unordered,
                    "two_pass": t_two,
                    "library": t_library,
                    "cudnn": t_cudnn,
                }
                tf = {name: flops / t / 1e9 for name, t in times.items()}
                results["timings"].append(
                    {"d": d, "causal": causal, "n": n, "agree": agree, "reproducible": same, "tflops": tf}
                )
                print(
                    f"D={d:3d} {'causal' if causal else 'full  '} N={n:5d}: fused {tf['fused']:6.1f} unordered "
                    f"{tf['unordered']:6.1f} (by index {tf['unordered_by_index']:6.1f}) "
                    f"by-index {tf['by_index']:6.1f} library "
                    f"{tf['library']:6.1f} (unordered {tf['library_unordered']:6.1f}) two-pass "
                    f"{tf['two_pass']:6.1f} cudnn {tf['cudnn']:6.1f} TFLOP/s  "
                    f"fused/cudnn {tf['fused'] / tf['cudnn']:.2f}  vs two-pass dq/dk/dv "
                    + " ".join(f"{e:.1e}" for e in agree)
                    + f" reproducible {same}",
                    flush=True,
                )

out_dir = os.environ.get("OUT", ".")
Path(out_dir, "ws_backward.json").write_text(json.dumps(results, indent=1))
