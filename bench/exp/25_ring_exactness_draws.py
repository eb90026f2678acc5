"""Ring (2 ranks as threads on one GPU) against one GPU, N = 8192, 8/32 heads of 128: max-error ratio per result
for several seeds, fp16 and bf16, non-causal and causal; also the one-GPU out error of the float32-storing
forward (rounded once) to see whether that path alone differs."""

import sys

sys.path.insert(0, "tests")
import cupy
import ml_dtypes
import numpy as np
from helpers.problems import random_array

import cupyflash
from cupyflash import distributed as dist
from cupyflash._arrays import from_float, to_float


def err(x, ref):
    return float(np.abs(cupy.asnumpy(to_float(x, np.float64)) - ref).max())


n, hk, g, d = 8192, 8, 4, 128
for dtype, dname in ((np.float16, "f16"), (ml_dtypes.bfloat16, "bf16")):
    for causal in (False, True):
        for seed in range(4):
            rng = np.random.default_rng(1000 + seed)
            q = cupy.asarray(random_array(rng, (1, hk, g, n, d), dtype))
            k, v = (cupy.asarray(random_array(rng, (1, hk, 1, n, d), dtype)) for _ in range(2))

            def rank_work(comm):
                shards = [dist.shard(x, comm) for x in (q, k, v)]
                out, lse = dist.ring_attention_forward(*shards, comm=comm, causal=causal)
                return [dist.unshard(out, comm)]

            ring_out = dist.InProcessGroup(2).run(rank_work)[0][0]
            one_out, _ = cupyflash.attention_forward(q, k, v, causal=causal)
            wide_out, _ = cupyflash.attention_forward(q, k, v, causal=causal, out_dtype=np.float32)
            ref, _ = cupyflash.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
            ref = cupy.asnumpy(ref)
            e_ring, e_one = err(ring_out, ref), err(one_out, ref)
            # the float32 one-GPU result rounded to the dtype: out's own rounding vs the kernel's rounded store
            e_wide = err(from_float(wide_out, dtype), ref)
            print(
                f"{dname} causal={causal!s:5} seed {seed}: ring {e_ring:.3g} one {e_one:.3g} ratio {e_ring / e_one:.2f}"
                f" | one via float32-out rounded {e_wide:.3g} ratio {e_wide / e_one:.2f}",
                flush=True,
            )
