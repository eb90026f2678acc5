#!/usr/bin/env python3
"""Benchmark variable-length packed batches against the padded dense batch.

    python bench/bench_varlen.py                 # bf16, D = 128, H = 16, causal and not
    python bench/bench_varlen.py --seqs 32 --min-len 128 --max-len 4096 --seed 0

A batch of --seqs sequences with lengths drawn uniformly in [--min-len, --max-len] (seeded), packed:
q (total, H, D), k, v alike, cu_seqlens int32. Timed, forward and backward, in one run:
- ``varlen``: cupyflash.attention_varlen_forward / _backward on the packed batch;
- ``padded``: our dense kernels on the batch padded to the longest sequence, (B, H, max_len, D) (no
  key-padding mask: the padded rows simply cost what they cost, which flatters the padded side);
- ``torch-varlen``: torch's public variable-length attention where the device's torch has one
  (``torch.nn.attention.varlen.varlen_attn``), on the same packed tensors; otherwise reported as n/a.
Both are counted by useful FLOPs, those of the sequences themselves: forward 4·H·D·sum(n_i²) (halved
for causal), backward 2.5× forward; ratio = useful TFLOP/s(varlen) / useful TFLOP/s(padded) =
time(padded) / time(varlen), target >= 1.0. Validation first: the packed output against the float64
reference on three sequences, and the padded dense output rows of those sequences against it too.
Timing as bench_attention.py: CUDA events, warm-up, median of --repeats, L2 flushed before each call.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402  (also finds cupyflash in a checkout that is not installed)
import cupy  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import reference  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error("--repeats must be >= 20")
    return args


def torch_varlen():
    """torch's public varlen attention function, or None."""
    if ba.torch is None:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - absent in this torch
        return None
    return varlen_attn


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.seqs)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, longest, h, d = int(cu[-1]), int(lengths.max()), args.heads, args.head_dim
    dtype = ba.DTYPES["bf16"]
    q, k, v, dout = (cupy.asarray(rng.standard_normal((total, h, d), dtype=np.float32).astype(dtype)) for _ in range(4))
    cu_dev = cupy.asarray(cu)
    # The padded batch (B, H, max_len, D): each sequence's rows, zeros after.
    padded = []
    for x in (q, k, v, dout):
        buf = cupy.zeros((args.seqs, longest, h, d), dtype=dtype)
        for s in range(args.seqs):
            buf[s, : lengths[s]] = x[cu[s] : cu[s + 1]]
        padded.append(cupy.ascontiguousarray(buf.transpose(0, 2, 1, 3)))
    print(ba.environment())
    print(
        f"{args.seqs} sequences, lengths {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}), "
        f"total {total} tokens, padded {args.seqs * longest}; H={h}, D={d}, bf16"
    )
    flush = ba.L2Flush()
    fn_torch = torch_varlen()
    results = {"lengths": lengths.tolist(), "heads": h, "head_dim": d, "rows": []}
    for causal in (False, True):
        useful = 4 * h * d * float(np.sum(lengths.astype(np.float64) ** 2)) / (2 if causal else 1)
        validate(q, k, v, cu, padded, lengths, causal)
        saved = cupyflash.attention_varlen_forward(
            q, k, v, cu_dev, cu_dev, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal
        )
        dense_saved = cupyflash.attention_forward(*padded[:3], causal=causal)
        timings = {
            ("varlen", "fwd"): lambda: cupyflash.attention_varlen_forward(
                q, k, v, cu_dev, cu_dev, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal
            ),
            ("varlen", "bwd"): lambda: cupyflash.attention_varlen_backward(
                dout, q, k, v, *saved, cu_dev, cu_dev, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal
            ),
            ("padded", "fwd"): lambda: cupyflash.attention_forward(*padded[:3], causal=causal),
            ("padded", "bwd"): lambda: cupyflash.attention_backward(
                padded[3], *padded[:3], *dense_saved, causal=causal
            ),
        }
        row = {"causal": causal, "useful_flops_fwd": useful, "useful_flops_bwd": ba.BWD_FLOPS_FACTOR * useful}
        for (name, phase), fn in timings.items():
            ms = ba._timing.median_ms(fn, warmup=args.warmup, repeats=args.repeats, before_each=flush)
            row[f"{name}_{phase}_ms"] = ms
            row[f"{name}_{phase}_tflops"] = row[f"useful_flops_{phase}"] / ms / 1e9
        row["torch_varlen_fwd_ms"] = time_torch(fn_torch, q, k, v, cu_dev, longest, causal, args, flush)
        results["rows"].append(row)
    print_table(results["rows"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def validate(q, k, v, cu, padded, lengths, causal):
    """Three sequences of the packed and the padded outputs against the float64 reference."""
    out = cupyflash.attention_varlen(q, k, v, cupy.asarray(cu), cupy.asarray(cu), causal=causal)
    dense = cupyflash.attention(*padded[:3], causal=causal)
    for s in (0, len(lengths) // 2, len(lengths) - 1):
        r0, r1 = int(cu[s]), int(cu[s + 1])
        host = [ba.float32_if_bf16(x[r0:r1]).get().astype(np.float64).transpose(1, 0, 2) for x in (q, k, v)]
        want = reference.attention(*host, causal=causal)
        got = ba.float32_if_bf16(out[r0:r1]).get().astype(np.float64).transpose(1, 0, 2)
        err = ba.rel_err(got, want)
        if not err <= ba.TOLERANCES["bf16"]:
            raise SystemExit(f"varlen output of sequence {s} is off: relative error {err:.3g}")
        # Padded keys take part in the dense softmax, so only full-length sequences match exactly.
        if lengths[s] == padded[0].shape[2]:
            got = ba.float32_if_bf16(dense[s]).get().astype(np.float64)
            assert ba.rel_err(got, want) <= ba.TOLERANCES["bf16"]


def time_torch(fn, q, k, v, cu_dev, longest, causal, args, flush):
    if fn is None:
        return None
    import inspect

    params = inspect.signature(fn).parameters
    if "is_causal" in params:
        mask = {"is_causal": causal}
    elif "window_size" in params:  # FlashAttention's (left, right); causal is (-1, 0)
        mask = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        print(f"torch varlen_attn{inspect.signature(fn)}: no causal argument; skipped")
        return None
    try:
        tq, tk, tv = (ba.torch.from_dlpack(x) for x in (q, k, v))
        cu_t = ba.torch.from_dlpack(cu_dev)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ba._timing.median_ms(
                lambda: fn(tq, tk, tv, cu_t, cu_t, longest, longest, **mask),
                warmup=args.warmup,
                repeats=args.repeats,
                before_each=flush,
            )
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        print(f"torch varlen_attn failed: {type(exc).__name__}: {exc}")
        return None


def print_table(rows):
    print("\nuseful TFLOP/s (sum over sequences of n_i^2), ratio = varlen / padded (target >= 1.0)")
    print(f"{'mask':8} | {'phase':5} | {'varlen':>8} | {'padded':>8} | {'ratio':>6} | {'torch varlen ms':>15}")
    for row in rows:
        for phase in ("fwd", "bwd"):
            a, b = row[f"varlen_{phase}_tflops"], row[f"padded_{phase}_tflops"]
            torch_ms = row["torch_varlen_fwd_ms"] if phase == "fwd" else None
            torch_cell = "n/a" if torch_ms is None else f"{torch_ms:.3f} (ours {row[f'varlen_{phase}_ms']:.3f})"
            print(
                f"{'causal' if row['causal'] else 'full':8} | {phase:5} | {a:8.1f} | {b:8.1f} | {a / b:6.2f} | "
                f"{torch_cell:>15}"
            )


if __name__ == "__main__":
    main()
