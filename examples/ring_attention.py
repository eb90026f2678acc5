"""Ring attention end to end: shard a sequence, run the forward and backward across the ranks, check them.

On GPUs, one process per GPU:

    python -m cupyflash.distributed.launch --nproc 2 examples/ring_attention.py [--n 16384]

Without GPUs, W ranks as threads of this process, on NumPy arrays:

    python examples/ring_attention.py --cpu 4 [--n 512]

Every rank builds the same random inputs (same seed), takes its zigzag shard, and runs
ring_attention_forward and ring_attention_backward with a causal mask; the results are gathered and
compared with cupyflash.attention_forward / attention_backward over the whole sequence on one device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupyflash  # noqa: E402
from cupyflash import distributed as dist  # noqa: E402

HEADS_KV, GROUP, D = 4, 2, 64  # 8 query heads over 4 key/value heads


def make_inputs(xp, n, dtype):
    """q, dout (1, 4, 2, n, 64) and k, v (1, 4, 1, n, 64), N(0, 1), the same on every rank."""
    rng = np.random.default_rng(2024)
    shapes = [(1, HEADS_KV, GROUP, n, D), (1, HEADS_KV, 1, n, D), (1, HEADS_KV, 1, n, D), (1, HEADS_KV, GROUP, n, D)]
    return [xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for shape in shapes]


def rank_work(comm, xp, n, dtype):
    """One rank's part: its shards through the ring, then every result gathered on every rank."""
    q, k, v, dout = make_inputs(xp, n, dtype)
    q_l, k_l, v_l, dout_l = (dist.shard(x, comm, layout="zigzag") for x in (q, k, v, dout))
    out_l, lse_l = dist.ring_attention_forward(q_l, k_l, v_l, comm=comm, causal=True)
    dq_l, dk_l, dv_l = dist.ring_attention_backward(dout_l, q_l, k_l, v_l, out_l, lse_l, comm=comm, causal=True)
    gathered = [dist.unshard(x, comm) for x in (out_l, dq_l, dk_l, dv_l)]
    return [dist.unshard(lse_l, comm, axis=-1)] + gathered


def compare(xp, n, dtype, ring):
    """Max |ring - one device| per result, relative to the one-device result's largest magnitude."""
    q, k, v, dout = make_inputs(xp, n, dtype)
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    one = [lse, out, *cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)]
    for name, a, b in zip(("lse", "out", "dq", "dk", "dv"), ring, one):
        a, b = (np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64) for x in (a, b))
        print(f"  {name:3}  max |ring - one device| / max |one device| = {np.abs(a - b).max() / np.abs(b).max():.2e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="sequence length, a multiple of 2W (default: 16384 on GPUs, 512 on CPU, rounded up to one)",
    )
    parser.add_argument("--cpu", type=int, default=None, metavar="W", help="W ranks as threads, NumPy arrays")
    args = parser.parse_args(argv)

    def length(default, world_size):  # zigzag shards cut the sequence into 2W equal chunks
        return args.n or -(-default // (2 * world_size)) * 2 * world_size

    if args.cpu is not None:
        n = length(512, args.cpu)
        ring = dist.InProcessGroup(args.cpu).run(lambda comm: rank_work(comm, np, n, np.float32))[0]
        print(f"{args.cpu} ranks (threads), N = {n}, float32, causal:")
        compare(np, n, np.float32, ring)
        return
    import cupy
    import ml_dtypes

    comm = dist.init()  # RANK, WORLD_SIZE, LOCAL_RANK from the launcher; picks this rank's GPU
    n, dtype = length(16384, comm.world_size), ml_dtypes.bfloat16
    ring = rank_work(comm, cupy, n, dtype)
    if comm.rank == 0:
        print(f"{comm.world_size} GPUs, N = {n}, bfloat16, causal:")
        compare(cupy, n, dtype, ring)
    comm.barrier()


if __name__ == "__main__":
    main()
