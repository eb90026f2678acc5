"""Why does out's error drive the gradients' error on data with a mean (bench/exp/33: one GPU's backward on the
float64 out rounded once has 0.25-0.43x its dq error)? The forward multiplies v by P rounded to 16 bits (the
tensor cores' operand) but divides by l, the sum of the unrounded P. So out_i = sum_j P~_ij v_j / sum_j P_ij
is v's weighted mean times (1 + e_i), e_i = sum_j (P~_ij - P_ij) / sum_j P_ij, the same relative error in every
column of the row. On data whose v has a mean (3 here) that error is coherent across the columns, and the
backward's D_i = rowsum(dout_i * out_i) (about 190 here) takes it whole: an error of about e_i * D_i, where the
rounding of out alone (independent per column) moves D by far less.

A NumPy emulation of the algorithm (one query head over one key/value head, N = 4096, D = 128, exp/31's shifted
draw, causal and not; a single pass with the row's max as reference, which is what the online softmax computes up
to the order of the sums) against float64. Prediction: (a) most of the unrounded out's error (before its final
rounding) is the per-row multiple e_i * out_i; (b) D's error from the kernel's rounded out is several times D's
error from the float64 out rounded once; (c) dividing by the sum of the rounded P instead (out_i = sum P~ v / sum
P~) brings D's error down to the rounded-once level. Measured for bf16 and fp16. Gradients are not
emulated: exp/33 measured them on the GPU."""

import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, "tests")
from helpers.problems import shifted_problem

N, D = 4096, 128


def rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


for (dtype, name), causal in [
    (t, c) for t in ((ml_dtypes.bfloat16, "bf16"), (np.float16, "fp16")) for c in (False, True)
]:
    rng = np.random.default_rng(35)
    q, k, v, dout = (x.astype(np.float64) for x in shifted_problem(rng, (N, D), (N, D), (N, D), dtype))
    s = q @ k.T / np.sqrt(D)
    if causal:
        s[np.triu_indices(N, 1)] = -np.inf
    name = f"{name} {'causal' if causal else 'full'}"
    p = np.exp(s - s.max(axis=1, keepdims=True))
    exact = p @ v / p.sum(axis=1, keepdims=True)
    p32 = p.astype(np.float32)
    p16 = p32.astype(dtype).astype(np.float64)  # the product's operand
    numerator = (p16 @ v).astype(np.float32).astype(np.float64)  # float32 accumulators
    kernel = numerator / p32.astype(np.float64).sum(axis=1, keepdims=True)  # divided by l = sum of unrounded P
    fixed = numerator / p16.sum(axis=1, keepdims=True)  # divided by the sum of the rounded P
    e = kernel - exact
    ratio = (e * exact).sum(axis=1, keepdims=True) / (exact * exact).sum(axis=1, keepdims=True)
    coherent = ratio * exact
    d_exact = (dout * exact).sum(axis=1)

    def d_error(out):
        rounded = out.astype(dtype).astype(np.float64)
        return rms((dout * rounded).sum(axis=1) - d_exact)

    print(
        f"{name}: |D| mean {np.abs(d_exact).mean():.1f}; unrounded out's error rms {rms(e):.3g}, of which the "
        f"per-row multiple e_i * out_i {rms(coherent):.3g} ({rms(coherent) ** 2 / rms(e) ** 2:.0%} of its square); "
        f"e_i rms {rms(ratio):.3g}"
    )
    print(
        f"{name}: D's error rms from out rounded from: the kernel's {d_error(kernel):.3g}, the float64 out "
        f"{d_error(exact):.3g}, divided by the rounded P's sum {d_error(fixed):.3g}; unrounded kernel out "
        f"{rms((dout * kernel).sum(axis=1) - d_exact):.3g}"
    )
