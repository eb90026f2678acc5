"""The ring's bf16 GQA results against one call on the CPU path (in-process ranks, W = 2): each result's worst
shard's norm ratio / max ratio by the GPU tests' rule (assert_as_exact_as_the_single_call). Run from the repo root,
on a tree whose one call rounds GQA's dk, dv per head and on one that rounds them once:

    python bench/exp/40_ring_gqa_rounding_cpu.py

Prediction: rounded per head, one call's dk, dv are the less exact, so the ring's ratios sit near 0.7-0.8 (as the
two-GPU runs measured, 0.81-0.84 norm); rounded once, both round once and the ratios come out at 1."""

import sys

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/cpu")
import ml_dtypes
import numpy as np
from helpers.checks import assert_as_exact_as_the_single_call
from helpers.problems import random_problem, shifted_problem
from test_distributed import _ring, _single

for make in (random_problem, shifted_problem):
    for causal, layout in ((True, "zigzag"), (False, "contiguous")):
        for seed in (1, 2):
            rng = np.random.default_rng(seed)
            n = 2 * 2 * 48
            q, k, v, dout = make(rng, (1, 2, 2, n, 32), (1, 2, 1, n, 32), (1, 2, 1, n, 32), ml_dtypes.bfloat16)
            ring = _ring(2, q, k, v, dout, causal=causal, layout=layout)
            one = _single(q, k, v, dout, causal=causal)
            w = [x.astype(np.float64) for x in (q, k, v, dout)]
            ref = _single(*w, causal=causal)
            r = assert_as_exact_as_the_single_call(
                ("out", "lse", "dq", "dk", "dv"), ring, one, ref, ml_dtypes.bfloat16, 4
            )
            print(make.__name__[:7], causal, layout, seed, " ".join(f"{a:.2f}/{b:.2f}" for a, b in r), flush=True)
