"""The host time of the dense fast path's pieces (bf16, 8 x 8 x 1024 x 64, causal, qkv views), each timed
alone behind a spin kernel as bench_train_step.host_us does. Prints one table; no arguments."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from bench_train_step import host_us  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash._cuda import plans  # noqa: E402

bf16 = np.dtype(ml_dtypes.bfloat16)
qkv = cupy.random.standard_normal((8, 1024, 3, 8, 64), dtype=np.float32).astype(bf16)
q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
out, lse = cupyflash.attention_forward(q, k, v, causal=True)
dout = cupy.ones_like(out)
cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
args = (q, k, v)
OPTIONS = (True, None, None, 0.0, 0.0, type(None))  # the API's call key options: causal=True, the rest default
found = plans.key("call", "fwd", args, OPTIONS)
call = plans.get(found)
bwd_found = plans.key("call", "bwd", (dout, q, k, v, out, lse), OPTIONS)
bwd_call = plans.get(bwd_found)
spare = [cupy.empty_like(x) for x in (out, lse, q, k, v, lse, lse)]  # where the timed launches write
pointers = [x.data.ptr for x in args + tuple(spare[:2])]
bwd_pointers = [x.data.ptr for x in (q, k, v, out, dout, lse, *spare[2:])]
memory = cupy.cuda.alloc(1024)
rows = {
    "attention_forward (fast path)": lambda: cupyflash.attention_forward(q, k, v, causal=True),
    "plans.key fwd": lambda: plans.key("call", "fwd", args, OPTIONS),
    "plans.get fwd": lambda: plans.get(found),
    "Call.run fwd": lambda: call.run([q, k, v], None),
    "plan.launch_with fwd (no alloc)": lambda: call.plan.launch_with(call.slots, pointers),
    "cupy.cuda.alloc": lambda: cupy.cuda.alloc(1 << 20),
    "ndarray(shape, dtype, memptr)": lambda: cupy.ndarray((8, 8, 1024, 64), bf16, memory),
    "memory + offset": lambda: memory + 256,
    "attention_backward (fast path)": lambda: cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True),
    "plans.key bwd": lambda: plans.key("call", "bwd", (dout, q, k, v, out, lse), OPTIONS),
    "Call.run bwd": lambda: bwd_call.run([q, k, v, out, dout, lse], None),
    "plan.launch_with bwd (no alloc)": lambda: bwd_call.plan.launch_with(bwd_call.slots, bwd_pointers),
}
print("| piece | host us |\n|---|---|")
for name, fn in rows.items():
    print(f"| {name} | {host_us(fn):.2f} |")
