"""Where the fused backward's CTAs wait (cuda_src/attention_bwd_ws.cu), by a clock around each wait. The source
is patched here, not in the library: a global table of clock() sums per CTA, written by the dq writer (waiting for
the consumers' dQ_partial, for its turn at the counter, for its add to land) and by the first consumer thread
(waiting for q and dout, for the staging buffer, and its whole time). Then the library's own call, once warm, on
FlashAttention's shapes (16k tokens, hidden 2048). The clocks perturb the kernel a little (a few registers); what
matters is the share of each wait. Prints the mean per CTA as a share of the consumer's time; writes
$OUT/bwd_waits.json.

    PYTHONPATH=. python bench/exp/16_bwd_waits.py
"""

import json
import os
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

import cupyflash
from cupyflash._cuda import compile as compile_
from cupyflash._cuda import plans, variants

SLOTS = 1 << 16
FIELDS = (
    "writer_dq_full",
    "writer_poll",
    "writer_land",
    "consumer_data",
    "consumer_staging",
    "consumer_total",
    "steps",
    "start_us",
)
PATCHES = [
    (
        "template <class K>\n__device__ __forceinline__ void bwd_write_dq(",
        f"__device__ unsigned int wait_clocks[{SLOTS}][8];\n"
        "template <class K>\n__device__ __forceinline__ void bwd_write_dq(",
    ),
    (
        "  int* counters = dq_counters + static_cast<i64>(walk.b) * walk.m_blocks * K::DQ_CHAINS;\n",
        "  int* counters = dq_counters + static_cast<i64>(walk.b) * walk.m_blocks * K::DQ_CHAINS;\n"
        "  unsigned w_full = 0, w_poll = 0, w_land = 0, t0;\n",
    ),
    (
        "    mbar_wait(cta.dq_full(), i & 1);\n    const float* from",
        "    t0 = clock();\n    mbar_wait(cta.dq_full(), i & 1);\n    w_full += clock() - t0;\n    const float* from",
    ),
    (
        "      while (load_acquire(counter) != link) {\n      }\n",
        "      t0 = clock();\n      while (load_acquire(counter) != link) {\n      }\n      w_poll += clock() - t0;\n",
    ),
    (
        '      bulk_wait<0>();\n      asm volatile("fence.proxy.async.global;"',
        "      t0 = clock();\n      bulk_wait<0>();\n      w_land += clock() - t0;\n"
        '      asm volatile("fence.proxy.async.global;"',
    ),
    (
        "  bulk_wait<0>();  // the last adds",
        "  unsigned* c = wait_clocks[blockIdx.y * gridDim.x + blockIdx.x];\n"
        "  c[0] = w_full; c[1] = w_poll; c[2] = w_land;\n"
        "  bulk_wait<0>();  // the last adds",
    ),
    (
        "  float* staging = cta.sdQ(wg);\n",
        "  float* staging = cta.sdQ(wg);\n  const unsigned t_begin = clock();\n"
        "  unsigned w_data = 0, w_stage = 0, t1;\n"
        '  unsigned long long g_begin;\n  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_begin));\n',
    ),
    (
        "    mbar_wait(cta.step_full(s), cta.parity(i));\n",
        "    t1 = clock();\n    mbar_wait(cta.step_full(s), cta.parity(i));\n    w_data += clock() - t1;\n",
    ),
    (
        "    if (i > 0) mbar_wait(cta.dq_empty(), (i - 1) & 1);\n",
        "    t1 = clock();\n    if (i > 0) mbar_wait(cta.dq_empty(), (i - 1) & 1);\n    w_stage += clock() - t1;\n",
    ),
    (
        "  store_tile<typename K::OutTile, K::HEAD_DIM, 128>(dv, p.d_v, stage_v, rows, p.d_v, thread);\n}",
        "  store_tile<typename K::OutTile, K::HEAD_DIM, 128>(dv, p.d_v, stage_v, rows, p.d_v, thread);\n"
        "  if (threadIdx.x == 128) {\n"
        "    unsigned* c = wait_clocks[blockIdx.y * gridDim.x + blockIdx.x];\n"
        "    c[3] = w_data; c[4] = w_stage; c[5] = clock() - t_begin; c[6] = walk.steps();\n"
        "    c[7] = static_cast<unsigned>((g_begin / 1000) % 1000000000ull);"
        "  // microseconds, wrapping every 16 min\n  }\n}",
    ),
]

original_module_code = variants.module_code
built = []


def patched_module_code(filename, names):
    code = original_module_code(filename, names)
    if "attention_bwd_ws_kernel" in code and any("attention_bwd_ws_kernel" in n for n in names):
        for old, new in PATCHES:
            assert code.count(old) == 1, old
            code = code.replace(old, new)
    return code


class RecordingModule(cupy.RawModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "wait_clocks" in kwargs.get("code", ""):
            built.append(self)


variants.module_code = patched_module_code
compile_.cupy.RawModule = RecordingModule
os.environ.setdefault("CUPY_CACHE_IN_MEMORY", "1")

BF16 = np.dtype(ml_dtypes.bfloat16)
results = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": []}
for d, causal, n in (
    (128, False, 8192),
    (128, False, 16384),
    (128, True, 16384),
    (64, False, 8192),
    (64, True, 16384),
    (128, False, 4096),
):
    heads, batch = 2048 // d, 16384 // n
    rng = np.random.default_rng()
    q, k, v, dout = (
        cupy.asarray(rng.standard_normal((batch, heads, n, d), dtype=np.float32).astype(BF16)) for _ in range(4)
    )
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    # a fresh module for each row (loaded from CuPy's cache), so that built[-1] is this row's
    compile_.modules.clear()
    plans.clear()
    cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    module = built[-1]
    pointer = module.get_global("wait_clocks")
    table = cupy.ndarray((SLOTS, 8), dtype=cupy.uint32, memptr=pointer)
    table.fill(0)
    cupy.cuda.Device().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    end.record()
    end.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, end)
    ctas = -(-n // 128) * batch * heads
    rows = cupy.asnumpy(table[:ctas]).astype(np.float64)
    total = rows[:, 5].sum()
    share = {f: float(rows[:, i].sum() / total) for i, f in enumerate(FIELDS[:5])}
    starts = rows[:, 7] - rows[:, 7].min()  # (a run that straddles the wrap shows a spread near 1e9: run again)
    row = {
        "d": d,
        "causal": causal,
        "n": n,
        "ctas": ctas,
        "ms": ms,
        "share": share,
        "mean_cycles_per_step": float(total / rows[:, 6].sum()),
        "start_us_quantiles": [float(x) for x in np.quantile(starts, [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1])],
    }
    results["rows"].append(row)
    print(
        f"D={d:3d} {'causal' if causal else 'full  '} N={n:5d} {ctas} CTAs {ms:.2f} ms: "
        + "  ".join(f"{f} {100 * x:5.1f}%" for f, x in share.items())
        + f"  cycles/step {row['mean_cycles_per_step']:.0f}",
        flush=True,
    )

Path(os.environ.get("OUT", "."), "bwd_waits.json").write_text(json.dumps(results, indent=1))
