#!/usr/bin/env python3
"""Experiment 04: GPU time of the forward (and, with --backward, the backward) under two source trees, in
alternation, on the rows whose kernels differ between them.

Each tree (a checkout's root, holding cupyflash/ and cuda_src/) runs in its own process, through the public
API only, so any two versions of the library compare. A round times every row once per tree, A then B;
rounds repeat, and the lowest median of each (tree, row) is kept, so that a slow spell of the machine hurts
neither tree more than the other. Rows: bf16 and fp16, D = 128, B·N = 16k, H = 16, N = 2k and 8k, with the
options that pick the warp-specialized forward's window, ALiBi and block-mask forms. Each row is first
checked against the float64 reference (both trees). --backward times attention_backward instead, on rows
that pick the modifiers' backward forms (scalars, softcap alone, window alone, all) and a bias row's forward.

    python bench/exp/04_ab_timing.py --tree old=/path/to/old --tree new=. [--rounds 3] [--backward]

Used to show that restructuring the warp-specialized forward into producer, consumer and epilogue
functions, which changed the machine code of those forms, left their speed unchanged (docs/design/compile.md).
"""

import argparse
import functools
import json
import os
import subprocess
import sys

ROWS = [  # (name, causal, options); arrays are built by the worker
    ("window(256,0)", True, {"window": (256, 0)}),
    ("alibi full", False, {"alibi": True}),
    ("alibi causal", True, {"alibi": True}),
    ("block mask 10%", False, {"block_mask": 0.1}),
    ("block mask 10% + alibi", False, {"block_mask": 0.1, "alibi": True}),
    ("block mask 10% + softcap", False, {"block_mask": 0.1, "softcap": 30.0}),
]
BACKWARD_ROWS = [
    ("alibi full", False, {"alibi": True}),
    ("alibi causal", True, {"alibi": True}),
    ("softcap causal", True, {"softcap": 30.0}),
    ("window(256,0)", True, {"window": (256, 0)}),
    ("bias full", False, {"bias": True}),
    ("block mask 10%", False, {"block_mask": 0.1}),
]
SHAPES = [2048, 8192]
DTYPES = ["bfloat16", "float16"]


def worker(backward):
    import cupy
    import ml_dtypes
    import numpy as np

    import cupyflash
    from cupyflash import reference
    from cupyflash._timing import median_ms

    flush = cupy.empty(256 * 1024 * 1024, dtype=cupy.uint8)
    results = {}
    rng = np.random.default_rng(4)
    for dtype_name in DTYPES:
        dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(np.float16)
        for n in SHAPES:
            b, h, d = 16384 // n, 16, 128
            q, k, v = (
                cupy.asarray(rng.standard_normal((b, h, n, d), dtype=np.float32).astype(dtype)) for _ in range(3)
            )
            for name, causal, spec in BACKWARD_ROWS if backward else ROWS:
                options = {}
                if "window" in spec:
                    options["window"] = spec["window"]
                if spec.get("alibi"):
                    options["alibi_slopes"] = cupy.asarray((2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32))
                if "softcap" in spec:
                    options["softcap"] = spec["softcap"]
                if spec.get("bias"):
                    options["bias"] = cupy.asarray(rng.standard_normal((1, h, n, n), dtype=np.float32).astype(dtype))
                if "block_mask" in spec:
                    tiles = -(-n // cupyflash.BLOCK_MASK_TILE)
                    on = rng.random((1, h, tiles, tiles)) < spec["block_mask"]
                    on[..., np.arange(tiles), np.arange(tiles)] = True  # every row sees a tile
                    options["block_mask"] = cupy.asarray(on)
                # The check: a slice of two heads of the first batch entry against the float64 reference, at the
                # shorter length (the longer one runs the same kernel).
                small = {
                    key: (
                        value[:, :2] if key in ("block_mask", "bias") else value[:2] if key == "alibi_slopes" else value
                    )
                    for key, value in options.items()
                }
                if n == SHAPES[0]:
                    out = cupyflash.attention(q[:1, :2], k[:1, :2], v[:1, :2], causal=causal, **small)
                    host = {key: (value.get() if hasattr(value, "get") else value) for key, value in small.items()}
                    ref = reference.attention(*(x[:1, :2].get() for x in (q, k, v)), causal=causal, **host)
                    error = float(np.abs(out.get().astype(np.float64) - ref).max() / np.abs(ref).max())
                    if not error < 2e-2:
                        raise SystemExit(f"{dtype_name} {name} n={n}: relative error {error:.2e} against float64")
                if backward:
                    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, **options)
                    dout = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32).astype(dtype))
                    call = functools.partial(
                        cupyflash.attention_backward, dout, q, k, v, out, lse, causal=causal, **options
                    )
                else:
                    call = functools.partial(cupyflash.attention, q, k, v, causal=causal, **options)
                ms = median_ms(call, warmup=5, repeats=30, before_each=lambda: flush.fill(1))
                results[f"{dtype_name} {'bwd' if backward else 'fwd'} {name} n={n}"] = ms
    print("RESULTS " + json.dumps(results), flush=True)


def run_tree(root, backward):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    command = [sys.executable, os.path.abspath(__file__), "--worker"] + (["--backward"] if backward else [])
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=os.path.abspath(root))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS ") :])
    raise SystemExit(f"tree {root} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree",
        action="append",
        required="--worker" not in sys.argv,
        metavar="NAME=PATH",
        help="a source tree to time (twice: A and B)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time the backward's rows instead")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write every round's medians here")
    args = parser.parse_args()
    if args.worker:
        return worker(args.backward)
    trees = [t.split("=", 1) for t in args.tree]
    rounds = []
    for r in range(args.rounds):
        rounds.append({name: run_tree(path, args.backward) for name, path in trees})
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    (a, _), (b, _) = trees
    rows = list(rounds[0][a])
    print(f"{'row':42} {a + ' ms':>10} {b + ' ms':>10} {b + '/' + a:>8}   spread of {a} across rounds")
    for row in rows:
        best_a = min(rnd[a][row] for rnd in rounds)
        best_b = min(rnd[b][row] for rnd in rounds)
        spread = max(rnd[a][row] for rnd in rounds) / best_a - 1
        print(f"{row:42} {best_a:10.4f} {best_b:10.4f} {best_b / best_a:8.3f}   {spread * 100:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
