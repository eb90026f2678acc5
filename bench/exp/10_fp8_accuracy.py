"""FlashAttention-3's FP8 accuracy experiment, emulated in NumPy (no GPU): how far an e4m3 attention forward
is from the float64 reference, with per-tensor scales, with per-block scales, and with per-block scales after an
incoherent rotation of q and k (a random orthogonal Hadamard-based matrix M: (q M)(k M)^T = q k^T).

Inputs (FA3, section 4.3): q, k, v drawn from N(0, 1) plus N(0, 100) * Bernoulli(0.001) outliers, D = 128,
N tokens. The emulated kernel: q, k, v rounded to e4m3 after dividing by their scale (the group's |max| / 448);
S = (q8 k8^T) * descale_q * descale_k * softmax scale in float32; P = exp(S - rowmax) rounded to e4m3 after
multiplying by 2^8 (the largest probability, 1, becomes 256 <= 448); out = (P8 (v8 * descale_v)) / 2^8 / rowsum,
accumulated in float32. bfloat16 for scale: q, k, v rounded to bfloat16, P rounded to bfloat16, float32 sums.

    python bench/exp/10_fp8_accuracy.py [--n 8192] [--heads 2] [--block 128]
"""

import argparse

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3_MAX = 448.0
P_OFFSET = 2.0**8


def inputs(rng, heads, n, d):
    def one():
        x = rng.standard_normal((heads, n, d))
        return x + rng.normal(0.0, 10.0, (heads, n, d)) * (rng.random((heads, n, d)) < 0.001)

    return one(), one(), one()


def quantize(x, rows):
    """x (H, N, D) float64 -> (e4m3 values as float32, descale (H, N, 1) float32): one scale per ``rows``
    rows of each head (None: one per tensor)."""
    h, n, d = x.shape
    if rows is None:
        amax = np.full((h, n, 1), np.abs(x).max())
    else:
        blocks = -(-n // rows)
        padded = np.zeros((h, blocks * rows, d))
        padded[:, :n] = np.abs(x)
        amax = padded.reshape(h, blocks, rows * d).max(axis=2)
        amax = np.repeat(amax, rows, axis=1)[:, :n, None]
    descale = (np.maximum(amax, 1e-30) / E4M3_MAX).astype(np.float32)
    x8 = (x / descale).astype(np.float32).astype(E4M3).astype(np.float32)
    return x8, descale


def hadamard_rotation(rng, d):
    """M = H diag(signs) / sqrt(d), H the Sylvester Hadamard matrix (d a power of two): orthogonal."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h * rng.choice([-1.0, 1.0], size=d)[None, :] / np.sqrt(d)


def attention_reference(q, k, v, chunk=1024):
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = np.empty_like(q)
    for i in range(0, q.shape[1], chunk):
        s = q[:, i : i + chunk] @ k.transpose(0, 2, 1) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, i : i + chunk] = (p @ v) / p.sum(axis=-1, keepdims=True)
    return out


def attention_fp8(q, k, v, rows, rotation=None, chunk=1024):
    scale = np.float32(1.0 / np.sqrt(q.shape[-1]))
    if rotation is not None:
        q, k = q @ rotation, k @ rotation
    (q8, dq), (k8, dk), (v8, dv) = quantize(q, rows), quantize(k, rows), quantize(v, rows)
    v_scaled = v8 * dv  # the kernel scales each key tile's product by its descale; the same sums
    out = np.empty(q.shape, dtype=np.float32)
    for i in range(0, q.shape[1], chunk):
        s = (q8[:, i : i + chunk] @ k8.transpose(0, 2, 1)) * dq[:, i : i + chunk] * dk.transpose(0, 2, 1) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p8 = (p * P_OFFSET).astype(E4M3).astype(np.float32)
        out[:, i : i + chunk] = (p8 @ v_scaled) / P_OFFSET / p.sum(axis=-1, keepdims=True)
    return out


def attention_bf16(q, k, v, chunk=1024):
    def rounded(x):
        return x.astype(np.float32).astype(BF16).astype(np.float32)

    q, k, v = rounded(q), rounded(k), rounded(v)
    scale = np.float32(1.0 / np.sqrt(q.shape[-1]))
    out = np.empty(q.shape, dtype=np.float32)
    for i in range(0, q.shape[1], chunk):
        s = q[:, i : i + chunk] @ k.transpose(0, 2, 1) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, i : i + chunk] = (rounded(p) @ v) / p.sum(axis=-1, keepdims=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--block", type=int, default=128, help="rows per scale for block quantization")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    q, k, v = inputs(rng, args.heads, args.n, 128)
    ref = attention_reference(q, k, v)
    rotation = hadamard_rotation(rng, 128)
    rows = {
        "bfloat16": attention_bf16(q, k, v),
        "fp8 per tensor": attention_fp8(q, k, v, None),
        "fp8 per tensor + incoherent": attention_fp8(q, k, v, None, rotation),
        f"fp8 per {args.block}-row block": attention_fp8(q, k, v, args.block),
        f"fp8 per {args.block}-row block + incoherent": attention_fp8(q, k, v, args.block, rotation),
    }
    print(f"N = {args.n}, {args.heads} heads, D = 128, seed {args.seed}; RMSE of out against float64")
    print("| variant | RMSE |\n|---|---|")
    for name, out in rows.items():
        print(f"| {name} | {np.sqrt(np.mean((out - ref) ** 2)):.2e} |")


if __name__ == "__main__":
    main()
