"""One rank of the two-GPU ring tests (tests/gpu/test_gpu_distributed.py), run by the launcher:

    python -m cupyflash.distributed.launch --nproc 2 tests/gpu/ring_worker.py

Every rank builds the same inputs, runs ring attention over NCCL on its shards, and gathers the results;
rank 0 holds them to the accuracy rule (helpers/checks.py) against the float64 reference, and each result to
the error of our single-GPU result by the rule for blocked schedules (helpers/checks.py: the relative Frobenius
error within 1.10x in each rank's shard of rows, the max error within 2x; the blocks' results come unrounded and
the ring rounds once, at the end, as one GPU does). A failed check raises, so the process (and the launcher)
exits non-zero. Rank 0 prints one line per case, with each result's ratios.
"""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
from helpers.checks import assert_as_exact_as_the_single_call, assert_matches_reference, to_host  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import distributed as dist  # noqa: E402
from cupyflash import reference  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
# (dtype, B, Hk, G, N, D, Dv, causal, layout, options)
CASES = [
    (BF16, 1, 2, 3, 4 * 96, 128, 128, True, "zigzag", {}),
    (BF16, 2, 2, 2, 4 * 70, 64, 40, False, "contiguous", {}),
    (np.float16, 1, 3, 1, 4 * 33, 80, 80, True, "contiguous", {"softcap": 20.0}),
    (BF16, 1, 2, 2, 4 * 50, 32, 32, True, "zigzag", {"alibi": True}),
    (np.float32, 1, 1, 2, 4 * 45, 48, 24, True, "zigzag", {"scale": 0.3}),
    (np.float64, 1, 2, 1, 4 * 20, 16, 16, False, "zigzag", {"alibi": True}),
    (BF16, 1, 2, 2, 4 * 64, 64, 64, True, "zigzag", {"window": (40, 0)}),
    (BF16, 1, 4, 4, 8192, 128, 128, True, "zigzag", {}),  # where rounding each block first left dv at 2.9x
]
# From this length the float64 results come from our float64 kernels on the GPU (held to 1e-12 of the reference
# by the other tests), as the reference's N x N float64 scores would not fit the host; the accuracy rule's naive
# twin, as long, is skipped for the same reason.
LONG = 4096


def run_case(comm, rng, dtype, b, hk, g, n, d, dv, causal, layout, options):
    q = rng.standard_normal((b, hk, g, n, d), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((b, hk, 1, n, d), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((b, hk, 1, n, dv), dtype=np.float32).astype(dtype)
    dout = rng.standard_normal((b, hk, g, n, dv), dtype=np.float32).astype(dtype)
    kwargs = {key: val for key, val in options.items() if key != "alibi"}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = cupy.asarray(rng.uniform(0.05, 0.5, (hk, g, 1)).astype(np.float32)[..., 0])
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    shards = [dist.shard(x, comm, layout) for x in (gq, gk, gv, gdout)]
    out_l, lse_l = dist.ring_attention_forward(*shards[:3], comm=comm, causal=causal, layout=layout, **kwargs)
    grads = dist.ring_attention_backward(
        shards[3], *shards[:3], out_l, lse_l, comm=comm, causal=causal, layout=layout, **kwargs
    )
    ring = [
        dist.unshard(out_l, comm, layout),
        dist.unshard(lse_l, comm, layout, axis=-1),
        *(dist.unshard(x, comm, layout) for x in grads),
    ]
    if comm.rank != 0:
        return None
    # the accuracy rule's naive twin computes in float32; float64 is held by the blocked-schedule rule below
    if dtype != np.float64 and n < LONG:
        assert_matches_reference(gq, gk, gv, gdout, ring, causal=causal, round_scaled_scores=False, **kwargs)
    one_out, one_lse = cupyflash.attention_forward(gq, gk, gv, causal=causal, **kwargs)
    one = [
        one_out,
        one_lse,
        *cupyflash.attention_backward(gdout, gq, gk, gv, one_out, one_lse, causal=causal, **kwargs),
    ]
    if n >= LONG:
        wide = [x.astype(np.float64) for x in (gq, gk, gv, gdout)]
        ref_out, ref_lse = cupyflash.attention_forward(*wide[:3], causal=causal, **kwargs)
        grads = cupyflash.attention_backward(wide[3], *wide[:3], ref_out, ref_lse, causal=causal, **kwargs)
        refs = [to_host(x) for x in (ref_out, ref_lse, *grads)]
    else:
        host = {key: to_host(val) if hasattr(val, "shape") else val for key, val in kwargs.items()}
        ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, **host)
        refs = [ref_out, ref_lse, *reference.attention_backward(dout, q, k, v, causal=causal, **host)]
    chunks = (2 if layout == "zigzag" else 1) * comm.world_size  # the ranks' shards
    return _ratios(("out", "lse", "dq", "dk", "dv"), ring, one, refs, dtype, chunks)


def run_varlen_case(comm, rng, dtype, causal, layout):
    """A packed batch of four sequences (one empty), each sharded across the ranks: the ring against the single
    GPU's attention_varlen, both against float64 on the host, per result."""
    parts = (2 if layout == "zigzag" else 1) * comm.world_size
    cu = np.concatenate([[0], np.cumsum([37 * parts, 0, 5 * parts, 64 * parts])]).astype(np.int32)
    total = int(cu[-1])
    q, dout = (rng.standard_normal((total, 4, 64), dtype=np.float32).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((total, 2, 64), dtype=np.float32).astype(dtype) for _ in range(2))
    gq, gk, gv, gdout = (cupy.asarray(x) for x in (q, k, v, dout))
    gcu = cupy.asarray(cu)
    shards = [dist.shard_varlen(x, gcu, comm, layout) for x in (gq, gk, gv, gdout)]
    out_l, lse_l = dist.ring_attention_varlen_forward(*shards[:3], gcu, comm=comm, causal=causal, layout=layout)
    grads = dist.ring_attention_varlen_backward(
        shards[3], *shards[:3], out_l, lse_l, gcu, comm=comm, causal=causal, layout=layout
    )
    ring = [dist.unshard_varlen(x, gcu, comm, layout) for x in (out_l, *grads)]
    if comm.rank != 0:
        return None
    one_out, one_lse = cupyflash.attention_varlen_forward(gq, gk, gv, gcu, gcu, causal=causal)
    one = [one_out, *cupyflash.attention_varlen_backward(gdout, gq, gk, gv, one_out, one_lse, gcu, gcu, causal=causal)]
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = cupyflash.attention_varlen_forward(*wide[:3], cu, cu, causal=causal)
    refs = [ref_out, *cupyflash.attention_varlen_backward(wide[3], *wide[:3], ref_out, ref_lse, cu, cu, causal=causal)]
    return _ratios(("out", "dq", "dk", "dv"), ring, one, refs, dtype, 1)


def _ratios(names, ring, one, refs, dtype, chunks):
    """The blocked-schedule rule per result (the norm in ``chunks`` runs of rows); its ratios as one line."""
    ratios = assert_as_exact_as_the_single_call(names, ring, one, refs, dtype, chunks)
    return ", ".join(f"{name} {a:.3f}/{b:.2f}" for name, (a, b) in zip(names, ratios))


def main():
    comm = dist.init()
    assert comm.world_size >= 2, "run under the launcher with --nproc >= 2"
    assert comm.device == comm.rank, f"rank {comm.rank} is on device {comm.device}"
    for i, case in enumerate(CASES):
        rng = np.random.default_rng(1000 + i)  # the same inputs on every rank
        line = run_case(comm, rng, *case)
        if comm.rank == 0:
            print(
                f"case {i} ({np.dtype(case[0]).name}, N={case[4]}, causal={case[7]}, {case[8]}, "
                f"{sorted(case[9])}): ring/one-GPU error {line}",
                flush=True,
            )
    for i, (dtype, causal, layout) in enumerate([(BF16, True, "zigzag"), (np.float16, False, "contiguous")]):
        line = run_varlen_case(comm, np.random.default_rng(2000 + i), dtype, causal, layout)
        if comm.rank == 0:
            print(f"varlen case {i} ({np.dtype(dtype).name}, causal={causal}, {layout}): packed ring/one-GPU {line}")
    # A call that differs between ranks raises on every rank.
    n = 16 * (2 + comm.rank)
    x = cupy.zeros((1, 2, n, 16), dtype=np.float16)
    try:
        dist.ring_attention_forward(x, x, x, comm=comm)
    except ValueError as error:
        assert "calls differ" in str(error), error
    else:
        raise AssertionError("mismatched shards did not raise")
    comm.barrier()
    if comm.rank == 0:
        print("mismatched calls raise on every rank", flush=True)


if __name__ == "__main__":
    main()
