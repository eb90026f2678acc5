"""out on data with a mean and outlier channels, where its normalization matters: Hopper's warp-specialized 16-bit
forward divides O by the row sums of the rounded P that O's products took (from the tensor cores), so that each row
of out is a weighted mean of v and carries no common factor of its own. The backward's D = rowsum(dout * out), large
on such data, would take such a factor whole, and dq with it: here D and dq from our out must be as exact as from the
float64 out rounded once to the inputs' dtype. The warp-specialized forward at head dim 64 takes the row sums inside
P V's products, at 128 and 256 (and a window alone) in products of their own; k and v broadcast over groups of query
heads (GQA) take that forward too. Needs a GPU of compute capability 9.0 (docs/design/forward.md, Row sums, says
which forms and forwards keep O / l):

    python -m pytest -m gpu tests/gpu/test_gpu_out_normalization.py
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.problems import shifted_problem

import cupyflash
from cupyflash import _modifiers
from cupyflash._cuda import dense, plans, tile_policy
from cupyflash._cuda.compile import current_device
from cupyflash._cuda.variants import Features

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

# Rounded once, D's and dq's errors move by a few percent between draws; an out divided by the float32 sum of the
# unrounded P gives 2.0-3.4 times those errors on this data (the warp-specialized forward's cases, one H200).
FACTOR = 1.25


def _rms(x):
    return float(cupy.sqrt(cupy.mean(x * x)))


def _relative(x, ref):
    return float(cupy.linalg.norm(x.astype(np.float64) - ref) / cupy.linalg.norm(ref))


CASES = {  # (head dim, causal, heads of k and v, options): each served by the warp-specialized forward
    "d64-causal": (64, True, 4, {}),
    "d64": (64, False, 4, {}),
    "d128-causal": (128, True, 4, {}),
    "d128": (128, False, 4, {}),
    "d256-causal": (256, True, 4, {}),
    "d128-window": (128, False, 4, {"window": (700, 0)}),
    "d64-kv-broadcast": (64, False, 1, {}),
    "d128-causal-kv-broadcast": (128, True, 2, {}),
}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_d_and_dq_as_exact_as_from_out_rounded_once(rng, monkeypatch, dtype, case):
    if not current_device().wgmma:
        pytest.skip("Hopper's forwards run on compute capability 9.0 only")
    head_dim, causal, kv_heads, options = CASES[case]
    n = 3000
    q_shape = (1, kv_heads, 4 // kv_heads, n, head_dim)  # 4 query heads in groups over k's and v's heads
    kv_shape = (1, kv_heads, 1, n, head_dim)
    q, k, v, dout = shifted_problem(rng, q_shape, kv_shape, kv_shape, dtype, xp=cupy)
    mods = _modifiers.resolve(cupy, np.dtype(dtype), q_shape[:-2], n, n, **options) if options else None
    features = Features.of("fwd", np.dtype(dtype), head_dim, head_dim, causal, mods)
    # whether tensor maps could read q, k, v: without them the call falls back to the wgmma forward (dense.forward)
    mapped = []
    tma_reads = dense._tma_reads
    monkeypatch.setattr(dense, "_tma_reads", lambda *args: mapped.append(tma_reads(*args)) or mapped[-1])
    plans.clear()

    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    out64, lse64 = cupyflash.attention_forward(*wide[:3], causal=causal, **options)
    dq64 = cupyflash.attention_backward(wide[3], *wide[:3], out64, lse64, causal=causal, **options)[0]
    d64 = (wide[3] * out64).sum(-1)

    mapped.clear()
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, **options)
    chosen = tile_policy.dense(features, current_device())
    assert chosen.path == "ws" and mapped and all(mapped), (chosen, mapped)
    once = out64.astype(dtype)
    d_error = _rms((wide[3] * out.astype(np.float64)).sum(-1) - d64)
    d_error_once = _rms((wide[3] * once.astype(np.float64)).sum(-1) - d64)
    assert d_error <= FACTOR * d_error_once, (d_error, d_error_once)

    dq = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **options)[0]
    dq_once = cupyflash.attention_backward(dout, q, k, v, once, lse, causal=causal, **options)[0]
    dq_error, dq_error_once = _relative(dq, dq64), _relative(dq_once, dq64)
    assert dq_error <= FACTOR * dq_error_once, (dq_error, dq_error_once)
