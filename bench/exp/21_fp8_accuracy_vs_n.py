"""The FP8 forward's error against the sequence length, with the accumulation of P V and the rounding of P each
isolated by an emulation of the kernel's arithmetic on the GPU (CuPy array code).

Data: q, k, v ~ N(0, 1), v plus --v-mean (0.5: a bias that a zero-mean v hides), each quantized with
``quantize_fp8(x, block=128)``; B = 1, --heads heads. Error: relative Frobenius norm of the last --rows query rows
(they see every key when causal) against float64 attention of the *dequantized* inputs, so that the inputs' own
rounding is not counted. Columns:

- ``kernel``: the FP8 forward (cupyflash.attention_forward on the FP8Tensors);
- ``bf16``: our bfloat16 forward on the unquantized inputs rounded to bfloat16 (against float64 of those);
- ``emu exact``: the kernel's algorithm with exact sums: S = q8 k8^T times the descales, P = 2^(c S - c max + 8)
  rounded to e4m3, out = (P8 (v8 * descale_v)) / 2^8 / rowsum(P before rounding), in float64;
- ``emu P f32``: the same without rounding P (what the format of P costs);
- ``emu cut O``: P V accumulated as the tensor cores do when fed O itself: per 32-key k-step the accumulator and
  the step's products are aligned to the largest of them and cut 13 bits below it (fixed_point_step): the
  single-level accumulation;
- ``emu cut block``: the same cut, but each key block of --block-n keys summed from zero and added to O in
  float32 (the two-level accumulation).

    PYTHONPATH=. python bench/exp/21_fp8_accuracy_vs_n.py [--seqlens 2k,8k,32k,128k] [--head-dims 64,128,256]
        [--v-mean 0.5] [--no-emulation] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash._cuda import tile_policy
from cupyflash._fp8.tensor import DECODE_TABLE, encode_e4m3

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def size(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def rel(x, ref) -> float:
    return float(cupy.linalg.norm((x - ref).ravel()) / cupy.linalg.norm(ref.ravel()))


def reference(q, k, v, causal, rows):
    """float64 attention of the last ``rows`` query rows of q (H, N, D) over k, v."""
    n, d = q.shape[-2], q.shape[-1]
    qr = q[:, n - rows :]
    s = qr @ k.transpose(0, 2, 1) / math.sqrt(d)
    if causal:
        i = cupy.arange(n - rows, n)[:, None]
        s = cupy.where(cupy.arange(n)[None, :] <= i, s, -cupy.inf)
    p = cupy.exp(s - s.max(axis=-1, keepdims=True))
    return (p @ v) / p.sum(axis=-1, keepdims=True)


def e4m3_round(x):
    """x (float32) rounded to e4m3 (to nearest even, saturating), as float32 values."""
    return cupy.asarray(DECODE_TABLE)[encode_e4m3(x.astype(cupy.float32))]


def fixed_point_step(acc, p8, v32):
    """One 32-key k-step of the tensor cores' FP8 accumulation, as measured on Hopper (DeepSeek-V3's report,
    SageAttention 2): the accumulator and the step's 32 products (exact, float64 here) are aligned to the largest
    magnitude among them and kept to 13 bits after it, the rest cut (a right shift of two's complement values:
    toward minus infinity), then summed. acc (H, R, Dv) float64, p8 (H, R, 32), v32 (H, 32, Dv)."""
    products = p8[..., :, None] * v32[:, None, :, :]  # (H, R, 32, Dv)
    top = cupy.maximum(cupy.abs(acc), cupy.abs(products).max(axis=-2))
    ulp = cupy.exp2(cupy.floor(cupy.log2(cupy.maximum(top, 1e-300))) - 13)
    return cupy.floor(acc / ulp) * ulp + (cupy.floor(products / ulp[..., None, :]) * ulp[..., None, :]).sum(axis=-2)


def emulations(q8, k8, v8, causal, rows, block_n):
    """The emulated outputs of the last ``rows`` rows (H, rows, Dv), float64, by name."""
    qd, kd, vd = (x.dequantize(np.float64)[0] for x in (q8, k8, v8))
    n, d = qd.shape[-2], qd.shape[-1]
    c = math.log2(math.e) / math.sqrt(d)
    s = qd[:, n - rows :] @ kd.transpose(0, 2, 1)
    hidden = None
    if causal:
        i = cupy.arange(n - rows, n)[:, None]
        hidden = cupy.arange(n)[None, :] > i
        s = cupy.where(hidden, -cupy.inf, s)
    m = s.max(axis=-1, keepdims=True)
    p = cupy.exp2(c * (s - m) + 8).astype(cupy.float32)  # the kernel's exponentials, in float32
    row_sum = p.astype(cupy.float64).sum(axis=-1, keepdims=True)
    p8 = e4m3_round(p)
    found = {
        "emu exact": (p8.astype(cupy.float64) @ vd) / row_sum,
        "emu P f32": (p.astype(cupy.float64) @ vd) / row_sum,
    }
    # Accumulation as the tensor cores do it (fixed_point_step): fed O itself, or a fresh sum per key block.
    single = cupy.zeros(p8.shape[:-1] + (vd.shape[-1],), cupy.float64)
    two = cupy.zeros_like(single)
    block = cupy.zeros_like(single)
    p8 = p8.astype(cupy.float64)
    for k0 in range(0, n, 32):
        single = fixed_point_step(single, p8[..., k0 : k0 + 32], vd[:, k0 : k0 + 32])
        block = fixed_point_step(
            block if k0 % block_n else cupy.zeros_like(block), p8[..., k0 : k0 + 32], vd[:, k0 : k0 + 32]
        )
        if (k0 + 32) % block_n == 0 or k0 + 32 >= n:
            two += block
    found["emu cut O"] = single / row_sum
    found["emu cut block"] = two / row_sum
    return found


def run(d, n, causal, v_mean, heads, rows, emulate, block_n, seed=0):
    rng = cupy.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(3))
    v += np.float32(v_mean)
    q8, k8, v8 = (cupyflash.quantize_fp8(x, block=128) for x in (q, k, v))
    out, _ = cupyflash.attention_forward(q8, k8, v8, causal=causal)
    ref = reference(*(x.dequantize(np.float64)[0] for x in (q8, k8, v8)), causal, rows)
    row = {
        "d": d,
        "n": n,
        "causal": causal,
        "v_mean": v_mean,
        "kernel": rel(out[0, :, n - rows :].astype(cupy.float64), ref),
    }
    qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
    out16, _ = cupyflash.attention_forward(qb, kb, vb, causal=causal)
    ref16 = reference(*(x[0].astype(cupy.float64) for x in (qb, kb, vb)), causal, rows)
    row["bf16"] = rel(out16[0, :, n - rows :].astype(cupy.float64), ref16)
    if emulate:
        for name, x in emulations(q8, k8, v8, causal, rows, block_n).items():
            row[name] = rel(x, ref)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default="2k,8k,32k,128k")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--v-mean", default="0,0.5")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--no-emulation", dest="emulate", action="store_false")
    parser.add_argument("--emulate-up-to", type=size, default=131072, help="longest N emulated (its loop is slow)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    cols = ["kernel", "bf16", "emu exact", "emu P f32", "emu cut O", "emu cut block"]
    print("| D | causal | v mean | N | " + " | ".join(cols) + " |")
    print("|---" * (4 + len(cols)) + "|")
    for d in (int(x) for x in args.head_dims.split(",")):
        block_n = tile_policy.fp8(d, False, "bfloat16").tiles("fwd").block
        for causal in (False, True):
            for v_mean in (float(x) for x in args.v_mean.split(",")):
                for n in (size(x) for x in args.seqlens.split(",")):
                    row = run(
                        d, n, causal, v_mean, args.heads, args.rows, args.emulate and n <= args.emulate_up_to, block_n
                    )
                    rows.append(row)
                    print(
                        f"| {d} | {causal} | {v_mean} | {n} | "
                        + " | ".join(f"{row[c]:.1e}" if c in row else "-" for c in cols)
                        + " |",
                        flush=True,
                    )
                    cupy.get_default_memory_pool().free_all_blocks()  # the next N's arrays are larger
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
