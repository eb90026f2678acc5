"""Ring attention on W GPUs against our single-GPU attention over the whole sequence, same machine, same run.

Run under the launcher, one process per GPU:

    python -m cupyflash.distributed.launch --nproc 2 bench/bench_ring.py [--sizes 32k,128k,256k] [--json PATH]
    python -m cupyflash.distributed.launch --nproc 2 bench/bench_ring.py --window 4k --sizes 128k --skip noncausal

Shape (the context-parallel target's): bfloat16, B = 1, 32 query heads over 8 key/value heads (GQA by
broadcasting), D = 128; causal rows use the zigzag layout, the others the contiguous one. Every rank builds
the same inputs (same seed) and takes its shard.

1. NCCL: the ring exchange alone (send to rank + 1, receive from rank - 1), GB/s per direction per rank.
2. Exactness, at N = 8k: out, lse, dq, dk, dv from the ring and from one GPU, each against float64
   (cupyflash on float64 copies): the max error and the relative Frobenius error, and the ring's over one GPU's
   (the two-GPU tests hold the norm's ratio to at most 1.10 and the max's to 2: docs/design/distributed.md,
   Exactness).
3. Speed: forward, and forward + backward, wall time (CUDA events on every rank, the slowest rank counts),
   median of --repeats after a warm-up; single-GPU times on rank 0 while the others wait. Memory: the size
   of the CuPy pool after the ring calls (freed beforehand; with --parts, the parts' arrays count too), per GPU.
   With --window w the causal rows (and the exactness check) use a sliding window (w, 0) over global positions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import distributed as dist  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
HK, G, D = 8, 4, 128


def parse_size(text):
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def to_bf16(x):
    """float32 -> bfloat16, rounded to nearest even, by bits."""
    u = x.view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16).view(BF16)


def to_f64(x):
    """Any of our dtypes -> float64 (bfloat16 by its bits)."""
    if x.dtype == BF16:
        x = (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float64)


def inputs(n, seed):
    """q (1, 8, 4, n, 128), k and v (1, 8, 1, n, 128), dout like q: bfloat16 N(0, 1), the same on every rank."""
    rng = cupy.random.default_rng(seed)
    shapes = [(1, HK, G, n, D), (1, HK, 1, n, D), (1, HK, 1, n, D), (1, HK, G, n, D)]
    return [to_bf16(rng.standard_normal(shape, dtype=np.float32)) for shape in shapes]


WARMUP = [1]  # warm-up calls before each timing; --warmup 0 for sizes whose kernels an earlier size compiled


def events_ms(fn, repeats, comm=None):
    """Median over ``repeats`` of fn's time (after the warm-up calls); with comm, every rank starts together
    and the slowest rank's time counts."""
    for _ in range(WARMUP[0]):
        fn()
    times = []
    for _ in range(repeats):
        if comm is not None:
            comm.barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, end)
        if comm is not None:
            ms = float(max(cupy.asnumpy(x)[0] for x in comm.all_gather(cupy.asarray([ms], dtype=np.float64))))
        times.append(ms)
    return statistics.median(times)


def nccl_bandwidth(comm, sizes_mib=(8, 256, 1024), repeats=5):
    rows = []
    for mib in sizes_mib:
        send = cupy.ones(mib << 20, dtype=np.uint8)
        recv = cupy.empty_like(send)

        def exchange():
            comm.wait(comm.exchange([send], [recv]))

        ms = events_ms(exchange, repeats, comm)
        rows.append({"MiB": mib, "ms": ms, "GB/s": (mib << 20) / ms / 1e6})
    return rows


def errors(result, ref):
    """(max error, relative Frobenius error) of each result against float64."""
    return [
        (float(cupy.abs(to_f64(a) - b).max()), float(cupy.linalg.norm(to_f64(a) - b) / cupy.linalg.norm(b)))
        for a, b in zip(result, ref)
    ]


def exactness(comm, n, causal, layout, window=None):
    q, k, v, dout = inputs(n, 1234)
    q64, k64, v64, dout64 = (to_f64(x) for x in (q, k, v, dout))
    kw = dict(causal=causal, window=window)
    out64, lse64 = cupyflash.attention_forward(q64, k64, v64, **kw)
    ref = [out64, lse64, *cupyflash.attention_backward(dout64, q64, k64, v64, out64, lse64, **kw)]
    out, lse = cupyflash.attention_forward(q, k, v, **kw)
    one = errors([out, lse, *cupyflash.attention_backward(dout, q, k, v, out, lse, **kw)], ref)
    ql, kl, vl, dl = (dist.shard(x, comm, layout) for x in (q, k, v, dout))
    out_l, lse_l = dist.ring_attention_forward(ql, kl, vl, comm=comm, layout=layout, **kw)
    grads = dist.ring_attention_backward(dl, ql, kl, vl, out_l, lse_l, comm=comm, layout=layout, **kw)
    ring = [
        dist.unshard(out_l, comm, layout),
        dist.unshard(lse_l, comm, layout, axis=-1),
        *(dist.unshard(g, comm, layout) for g in grads),
    ]
    ring_err = errors(ring, ref)
    names = ("out", "lse", "dq", "dk", "dv")
    return {
        name: {
            "one_gpu": a[0],
            "ring": b[0],
            "ratio": b[0] / a[0] if a[0] else float("inf"),
            "norm_one_gpu": a[1],
            "norm_ring": b[1],
            "norm_ratio": b[1] / a[1] if a[1] else float("inf"),
        }
        for name, a, b in zip(names, one, ring_err)
    }


def speed(comm, n, causal, layout, repeats, parts=False, window=None):
    row = {"N": n, "causal": causal, "layout": layout, "W": comm.world_size, "window": window}
    pool = cupy.get_default_memory_pool()
    full = inputs(n, 99)
    if comm.rank == 0:
        row["one_fwd_ms"], row["one_fwd_bwd_ms"] = _one_gpu(*full, causal, repeats, window)
    comm.barrier()
    shards = [dist.shard(x, comm, layout) for x in full]
    del full
    pool.free_all_blocks()
    if parts:  # rank 0's steps one by one, no ring: what the ring's time is made of
        row["parts_ms"] = _parts(comm, *shards, causal, layout, repeats, window)
    row["ring_fwd_ms"], row["ring_fwd_bwd_ms"] = _ring(comm, *shards, causal, layout, repeats, window)
    row["ring_pool_peak_GiB"] = pool.total_bytes() / 2**30
    if comm.rank == 0:
        row["speedup_fwd"] = row["one_fwd_ms"] / row["ring_fwd_ms"]
        row["speedup_fwd_bwd"] = row["one_fwd_bwd_ms"] / row["ring_fwd_bwd_ms"]
    del shards
    pool.free_all_blocks()
    return row


def connect(comm):
    """One small ring forward and backward, untimed. NCCL connects a pair of ranks on their first send and
    receive; without this, a process that skipped the exchange and exactness steps pays that inside its first
    timed call (about 0.5 s of the forward at N = 1M on 4 GPUs)."""
    n = 256 * comm.world_size
    q, k, v, dout = (dist.shard(x, comm, "zigzag") for x in inputs(n, 7))
    out, lse = dist.ring_attention_forward(q, k, v, comm=comm, causal=True, layout="zigzag")
    dist.ring_attention_backward(dout, q, k, v, out, lse, comm=comm, causal=True, layout="zigzag")
    cupy.cuda.get_current_stream().synchronize()


def _one_gpu(q, k, v, dout, causal, repeats, window=None):
    def fwd():
        return cupyflash.attention_forward(q, k, v, causal=causal, window=window)

    def fwd_bwd():
        out, lse = fwd()
        return cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window=window)

    return events_ms(fwd, repeats), events_ms(fwd_bwd, repeats)


def _ring(comm, ql, kl, vl, dl, causal, layout, repeats, window=None):
    kw = dict(comm=comm, causal=causal, window=window, layout=layout)

    def fwd():
        return dist.ring_attention_forward(ql, kl, vl, **kw)

    def fwd_bwd():
        out, lse = fwd()
        return dist.ring_attention_backward(dl, ql, kl, vl, out, lse, **kw)

    return events_ms(fwd, repeats, comm), events_ms(fwd_bwd, repeats, comm)


def _parts(comm, ql, kl, vl, dl, causal, layout, repeats, window=None):
    """Per step and block of rank 0 (steps after the first on its own keys in place of the travelling
    ones: same shapes, same work): forward and backward times, and the merges'."""
    from cupyflash._cuda import ring_states
    from cupyflash.distributed._ring import _Call

    call = _Call(dict(q=ql, k=kl, v=vl), comm, causal, None, window, 0.0, None, layout, "parts")
    found = {}
    if comm.rank == 0:
        for step in range(comm.world_size):
            for i, blk in enumerate(call.blocks(step)):
                args = (ql[..., blk.q_rows, :], kl[..., blk.k_rows, :], vl[..., blk.k_rows, :])
                kw = call.options(blk, blk.q_rows.stop - blk.q_rows.start, blk.k_rows.stop - blk.k_rows.start)[0]
                out, lse = cupyflash.attention_forward(*args, **kw)
                acc = cupy.zeros(out.shape, dtype=np.float32)
                acc_lse = cupy.zeros(lse.shape, dtype=np.float32)
                name = f"t{step}b{i} q{blk.q_rows.stop - blk.q_rows.start}xk{blk.k_rows.stop - blk.k_rows.start}"
                found[name + " fwd"] = events_ms(lambda: cupyflash.attention_forward(*args, **kw), repeats)
                found[name + " merge"] = events_ms(lambda: ring_states.merge_rows(acc, acc_lse, 0, out, lse), repeats)
                found[name + " bwd"] = events_ms(
                    lambda: cupyflash.attention_backward(dl[..., blk.q_rows, :], *args, out, lse, **kw), repeats
                )
        print("  parts: " + "  ".join(f"{k} {v:.2f}" for k, v in found.items()))
    comm.barrier()
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="32k,128k,256k")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="calls before each timing (0 is fine where an earlier size compiled the kernels)",
    )
    parser.add_argument("--exact-n", default="8k")
    parser.add_argument("--json", default=None)
    parser.add_argument("--parts", action="store_true", help="also time rank 0's steps one by one")
    parser.add_argument("--skip", default="", help="comma list of: nccl, exact, speed, noncausal")
    parser.add_argument("--window", default=None, help="a sliding window (w, 0) for the causal rows, e.g. 4k")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    window = None if args.window is None else (parse_size(args.window), 0)
    WARMUP[0] = args.warmup
    comm = dist.init()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    props = cupy.cuda.runtime.getDeviceProperties(comm.device)
    result = {"device": props["name"].decode(), "W": comm.world_size}
    say(f"# {comm.world_size} x {result['device']}")
    if "nccl" not in skip and comm.world_size > 1:
        result["nccl"] = nccl_bandwidth(comm)
        for r in result["nccl"]:
            say(f"nccl ring exchange {r['MiB']:5d} MiB: {r['ms']:8.3f} ms  {r['GB/s']:6.1f} GB/s per direction")
    if "exact" not in skip:
        n = parse_size(args.exact_n)
        result["exact"] = {}
        for causal, layout in ((True, "zigzag"), (False, "contiguous")):
            e = exactness(comm, n, causal, layout, window if causal else None)
            result["exact"][f"causal={causal}"] = e
            say(
                f"exactness N={n} causal={causal} {layout}: "
                + "  ".join(
                    f"{k} max {x['ring']:.2e}/{x['one_gpu']:.2e}={x['ratio']:.2f} norm {x['norm_ratio']:.3f}"
                    for k, x in e.items()
                )
            )
    if "speed" not in skip:
        connect(comm)
        result["speed"] = []
        cases = [(True, "zigzag")] + ([] if "noncausal" in skip else [(False, "contiguous")])
        for causal, layout in cases:
            for n in (parse_size(s) for s in args.sizes.split(",")):
                row = speed(comm, n, causal, layout, args.repeats, args.parts, window if causal else None)
                result["speed"].append(row)
                if comm.rank == 0:
                    say(
                        f"N={n:7d} causal={causal!s:5} window={row['window']} {layout:10}  "
                        f"one fwd {row['one_fwd_ms']:9.2f} "
                        f"fwd+bwd {row['one_fwd_bwd_ms']:9.2f} | ring fwd {row['ring_fwd_ms']:9.2f} "
                        f"fwd+bwd {row['ring_fwd_bwd_ms']:9.2f} ms | speedup fwd {row['speedup_fwd']:.3f} "
                        f"fwd+bwd {row['speedup_fwd_bwd']:.3f} | pool {row['ring_pool_peak_GiB']:.2f} GiB"
                    )
    if comm.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    comm.barrier()


if __name__ == "__main__":
    main()
