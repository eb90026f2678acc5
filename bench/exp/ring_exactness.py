"""What the ring-exactness experiments (29-34) share: one GPU's call and the float64 reference, the ring as W
ranks of threads on one GPU (InProcessGroup runs the ring's kernels and schedule as over NCCL), and the error
measures. Every function returns whole arrays (unsharded) and takes NumPy or CuPy arrays alike."""

import numpy as np
from helpers.checks import array_module
from helpers.problems import random_array

import cupyflash
from cupyflash import distributed as dist


def one_gpu(q, k, v, dout, *, causal, roll=0):
    """[out, lse, dq, dk, dv] of one call; ``roll``: over keys rolled by that many positions (dk, dv rolled
    back), the same function without a causal mask."""
    xp = array_module(q)
    k, v = (xp.roll(x, roll, axis=-2) for x in (k, v))
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    return [out, lse, dq, *(xp.roll(x, -roll, axis=-2) for x in (dk, dv))]


def reference(q, k, v, dout, *, causal):
    """one_gpu on float64 copies (our float64 kernels on the GPU)."""
    return one_gpu(*(x.astype(np.float64) for x in (q, k, v, dout)), causal=causal)


def without_lse(results):
    """[out, dq, dk, dv] of [out, lse, dq, dk, dv]."""
    return [results[0], *results[2:]]


def ring_forward(q, k, v, *, causal, layout="zigzag", world=2):
    """(out, lse) of ring_attention_forward over ``world`` ranks as threads."""

    def work(comm):
        s = [dist.shard(x, comm, layout) for x in (q, k, v)]
        out, lse = dist.ring_attention_forward(*s, comm=comm, causal=causal, layout=layout)
        return dist.unshard(out, comm, layout), dist.unshard(lse, comm, layout, axis=-1)

    return dist.InProcessGroup(world).run(work)[0]


def ring_backward(dout, q, k, v, out, lse, *, causal, layout="zigzag", world=2):
    """[dq, dk, dv] of ring_attention_backward over ``world`` ranks as threads, given the whole out and lse."""

    def work(comm):
        s = [dist.shard(x, comm, layout) for x in (dout, q, k, v, out)]
        grads = dist.ring_attention_backward(
            *s, dist.shard(lse, comm, layout, axis=-1), comm=comm, causal=causal, layout=layout
        )
        return [dist.unshard(g, comm, layout) for g in grads]

    return dist.InProcessGroup(world).run(work)[0]


def ring(q, k, v, dout, *, causal, layout="zigzag", world=2):
    """[out, lse, dq, dk, dv] of the ring's forward and backward, each rank's backward on its own forward's
    shards (what users run)."""

    def work(comm):
        s = [dist.shard(x, comm, layout) for x in (q, k, v, dout)]
        out, lse = dist.ring_attention_forward(*s[:3], comm=comm, causal=causal, layout=layout)
        grads = dist.ring_attention_backward(s[3], *s[:3], out, lse, comm=comm, causal=causal, layout=layout)
        return [dist.unshard(out, comm, layout), dist.unshard(lse, comm, layout, axis=-1)] + [
            dist.unshard(g, comm, layout) for g in grads
        ]

    return dist.InProcessGroup(world).run(work)[0]


def draw(seed, dtype, xp):
    """The long-shard test's standard-normal shape: N = 8192, 8 key/value heads x 4, D = 128."""
    n, hk, g, d = 8192, 8, 4, 128
    rng = np.random.default_rng(seed)
    q = xp.asarray(random_array(rng, (1, hk, g, n, d), dtype))
    k, v = (xp.asarray(random_array(rng, (1, hk, 1, n, d), dtype)) for _ in range(2))
    dout = xp.asarray(random_array(rng, (1, hk, g, n, d), dtype))
    return q, k, v, dout


def errors(xs, refs):
    """(max, relative Frobenius) error of each result against float64."""
    res = []
    for x, ref in zip(xs, refs):
        xp = array_module(ref)
        d = x.astype(np.float64) - ref
        res.append((float(xp.abs(d).max()), float(xp.linalg.norm(d) / xp.linalg.norm(ref))))
    return res


def shard_norms(x, ref, chunks):
    """The relative Frobenius error of x against ref in each of ``chunks`` runs of rows (a ring's shards)."""
    xp = array_module(ref)
    e = x.astype(np.float64) - ref
    pieces = zip(xp.array_split(e, chunks, -2), xp.array_split(ref, chunks, -2))
    return np.array([float(xp.linalg.norm(a) / xp.linalg.norm(r)) for a, r in pieces])


def span(a, b):
    """min-max of a / b, as text."""
    r = a / b
    return f"{r.min():.2f}-{r.max():.2f}"
