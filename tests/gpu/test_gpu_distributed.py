"""Ring attention on the GPU. Needs a GPU; the NCCL tests need two:

    python -m pytest -m gpu tests/gpu/test_gpu_distributed.py

On one GPU: a world of one process (``init()`` without a launcher) gives attention's results bit for bit;
W ranks as threads (InProcessGroup) on CuPy arrays run the GPU's merge and accumulate kernels through the
ring, held to the accuracy rule and each result to the single GPU's error against float64 by the rule for
blocked schedules in helpers/checks.py (the blocks' results come unrounded and the ring rounds once, as one GPU
does); the kernels themselves (cupyflash/_cuda/ring_states.py) against the NumPy merge, with every allocation
poisoned. On two GPUs: tests/gpu/ring_worker.py over NCCL through the launcher (every case held to the accuracy
rule and to the single GPU's error by the same rule), and the example script.
"""

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import (
    assert_as_exact_as_the_single_call,
    assert_bitwise_equal,
    assert_close,
    naive_attention,
    to_host,
)
from helpers.gpu import gpu_available, nan_filled_allocations
from helpers.problems import random_array, random_problem, shifted_problem

import cupyflash
from cupyflash import distributed as dist
from cupyflash import reference
from cupyflash._arrays import cupy
from cupyflash._cuda import ring_states

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _two_gpus():
    return gpu_available() and cupy.cuda.runtime.getDeviceCount() >= 2


@pytest.mark.parametrize("causal", [True, False])
def test_world_of_one_is_attention_bit_for_bit(rng, causal, monkeypatch):
    """init() without a launcher is a world of one; the ring is then one call of each kernel, and the float32
    accumulators hold the block's results exactly, so out, lse and dq are attention's, bit for bit. dk and dv of
    the grouped key/value heads are sums over the G = 2 query heads of a group, which both sum unrounded and round
    once, each in its own code (the ring's accumulator and conversion, attention's sum of float32 parts): held to
    at most a rounding of each term apart."""
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    comm = dist.init(device=cupy.cuda.Device().id)
    assert (comm.rank, comm.world_size) == (0, 1)
    q, dout = (cupy.asarray(random_array(rng, (2, 3, 2, 90, 64), ml_dtypes.bfloat16)) for _ in range(2))
    k, v = (cupy.asarray(random_array(rng, (2, 3, 1, 90, 64), ml_dtypes.bfloat16)) for _ in range(2))
    with nan_filled_allocations():
        out, lse = dist.ring_attention_forward(q, k, v, comm=comm, causal=causal)
        grads = dist.ring_attention_backward(dout, q, k, v, out, lse, comm=comm, causal=causal)
    one_out, one_lse = cupyflash.attention_forward(q, k, v, causal=causal)
    one = cupyflash.attention_backward(dout, q, k, v, one_out, one_lse, causal=causal)
    assert_bitwise_equal((out, lse, grads[0]), (one_out, one_lse, one[0]))
    for name, x, y in zip(("dk", "dv"), grads[1:], one[1:]):
        x, y = to_host(x).astype(np.float64), to_host(y).astype(np.float64)
        allowed = 2.0**-7 * (np.abs(y) + np.abs(y).max())  # one bfloat16 rounding of each of the two terms
        assert np.all(np.abs(x - y) <= allowed), f"{name}: more than a rounding of each term from attention's"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "world_size, layout, causal, options",
    [
        (2, "zigzag", True, {}),
        (3, "contiguous", False, {"softcap": 15.0}),
        (4, "zigzag", True, {"alibi": True}),
        (2, "contiguous", True, {"scale": 0.2}),
        (3, "zigzag", True, {"window": (50, 0)}),
        (2, "contiguous", False, {"window": (20, 30), "alibi": True}),
    ],
)
def test_ring_over_threads_on_one_gpu(rng, assert_matches_reference, dtype, world_size, layout, causal, options):
    """W ranks as threads sharing one GPU: the same schedule as over NCCL, through the GPU's kernels
    (attention, merge_states, accumulate_rows); the gathered results by the accuracy rule and, in each rank's
    shard of rows, by the blocked-schedule rule against one GPU's."""
    n, hk, g, d, dv = world_size * 2 * 37, 2, 2, 40, 56
    q = cupy.asarray(random_array(rng, (1, hk, g, n, d), dtype))
    k = cupy.asarray(random_array(rng, (1, hk, 1, n, d), dtype))
    v = cupy.asarray(random_array(rng, (1, hk, 1, n, dv), dtype))
    dout = cupy.asarray(random_array(rng, (1, hk, g, n, dv), dtype))
    kwargs = {key: val for key, val in options.items() if key != "alibi"}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = cupy.asarray(rng.uniform(0.05, 0.5, (hk, g, 1)).astype(np.float32))[..., 0]

    def rank_work(comm):
        shards = [dist.shard(x, comm, layout) for x in (q, k, v, dout)]
        out, lse = dist.ring_attention_forward(*shards[:3], comm=comm, causal=causal, layout=layout, **kwargs)
        grads = dist.ring_attention_backward(
            shards[3], *shards[:3], out, lse, comm=comm, causal=causal, layout=layout, **kwargs
        )
        return [
            dist.unshard(out, comm, layout),
            dist.unshard(lse, comm, layout, axis=-1),
            *(dist.unshard(x, comm, layout) for x in grads),
        ]

    results = dist.InProcessGroup(world_size).run(rank_work)
    for other in results[1:]:  # every rank gathers the same arrays
        assert_bitwise_equal(other, results[0])
    host = {key: to_host(val) if hasattr(val, "shape") else val for key, val in kwargs.items()}
    ref_out, ref_lse = reference.attention(*(to_host(x) for x in (q, k, v)), causal=causal, return_lse=True, **host)
    refs = [
        ref_out,
        ref_lse,
        *reference.attention_backward(*(to_host(x) for x in (dout, q, k, v)), causal=causal, **host),
    ]
    one_out, one_lse = cupyflash.attention_forward(q, k, v, causal=causal, **kwargs)
    one = [one_out, one_lse, *cupyflash.attention_backward(dout, q, k, v, one_out, one_lse, causal=causal, **kwargs)]
    chunks = (2 if layout == "zigzag" else 1) * world_size  # the ranks' shards
    assert_as_exact_as_the_single_call(("out", "lse", "dq", "dk", "dv"), results[0], one, refs, dtype, chunks)
    if dtype != np.float64:
        assert_matches_reference(q, k, v, dout, results[0], causal=causal, **kwargs)
        return
    # float64 runs in float64 throughout: held to the float64 reference at 1e-12 of its largest magnitude.
    for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), results[0], refs):
        error = np.abs(to_host(x) - ref).max()
        assert error <= 1e-12 * max(1.0, np.abs(ref).max()), f"{name}: float64 error {error:.3g}"


@pytest.mark.parametrize(
    "causal, dtype",
    [(True, np.float16), (True, ml_dtypes.bfloat16), (False, np.float16), (False, ml_dtypes.bfloat16)],
    ids=["causal-float16", "causal-bfloat16", "full-float16", "full-bfloat16"],
)
@pytest.mark.parametrize("make", [random_problem, shifted_problem], ids=["normal", "shifted"])
def test_ring_of_long_16_bit_shards_as_exact_as_one_gpu(rng, dtype, causal, make):
    """Two ranks as threads, N = 8192, 32 heads of 128 (where rounding each block's results first left dv's
    error 2.9x one GPU's, bf16 causal): blocks long enough for the warp-specialized forward and the fused
    backward, each result's error against float64 within the blocked-schedule rule of helpers/checks.py against
    one GPU's, in each of the four zigzag shards of rows; on standard-normal data and on data with a mean and
    outlier channels (helpers/problems.py), where dk is held to the accuracy rule instead."""
    n, hk, g, d = 8192, 8, 4, 128
    q, k, v, dout = make(rng, (1, hk, g, n, d), (1, hk, 1, n, d), (1, hk, 1, n, d), dtype, xp=cupy)

    def rank_work(comm):
        shards = [dist.shard(x, comm) for x in (q, k, v, dout)]
        out, lse = dist.ring_attention_forward(*shards[:3], comm=comm, causal=causal)
        grads = dist.ring_attention_backward(shards[3], *shards[:3], out, lse, comm=comm, causal=causal)
        return [dist.unshard(out, comm), dist.unshard(lse, comm, axis=-1), *(dist.unshard(x, comm) for x in grads)]

    ring = dist.InProcessGroup(2).run(rank_work)[0]
    one_out, one_lse = cupyflash.attention_forward(q, k, v, causal=causal)
    one = [one_out, one_lse, *cupyflash.attention_backward(dout, q, k, v, one_out, one_lse, causal=causal)]
    # float64 from our float64 kernels (held to 1e-12 of the reference by the other tests): the reference's N x N
    # float64 scores for 32 heads would take 17 GB.
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = cupyflash.attention_forward(*wide[:3], causal=causal)
    refs = [ref_out, ref_lse, *cupyflash.attention_backward(wide[3], *wide[:3], ref_out, ref_lse, causal=causal)]
    refs = [to_host(x) for x in refs]
    held = ["out", "lse", "dq", "dk", "dv"]
    if make is shifted_problem:
        # On data with a mean and outlier channels, dk's 16-bit error is set by roundings that add up over all
        # the rows that see a key (out's, through D = rowsum(dout * out), and dS's before its product with q), so
        # one GPU's own dk error moves a long way when only out's last bits change (docs/design/distributed.md,
        # Exactness). dk is held to the accuracy rule every call is held to (the naive, one key/value head at a
        # time for memory); the other results to one GPU's error, as on standard-normal data.
        naive_dk = [
            naive_attention(*(x[:, h : h + 1] for x in (q, k, v, dout)), causal=causal, round_scaled_scores=False)[2]
            for h in range(hk)
        ]
        assert_close("dk", to_host(ring[3]), refs[3], to_host(cupy.concatenate(naive_dk, axis=1)), dtype)
        held.remove("dk")
    pick = [("out", "lse", "dq", "dk", "dv").index(name) for name in held]
    ratios = assert_as_exact_as_the_single_call(
        held, *([x[i] for i in pick] for x in (ring, one, refs)), dtype, chunks=4
    )
    print(
        "ring / one GPU error (norm/max):", ", ".join(f"{name} {a:.3f}/{b:.2f}" for name, (a, b) in zip(held, ratios))
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    "world_size, layout, causal, window",
    [(2, "zigzag", True, None), (3, "contiguous", False, None), (2, "zigzag", True, (9, 0))],
)
def test_packed_ring_over_threads_on_one_gpu(rng, dtype, world_size, layout, causal, window):
    """A packed batch (one empty sequence, GQA) sharded sequence by sequence across W ranks as threads on one GPU:
    the ring's results against attention_varlen's on the GPU, both against float64 on the host: the ring's
    error within the blocked-schedule rule against the single call's (float64 also within 1e-12 of the largest
    magnitude)."""
    parts = (2 if layout == "zigzag" else 1) * world_size
    cu = np.concatenate([[0], np.cumsum([11 * parts, 0, 3 * parts, 29 * parts])]).astype(np.int32)
    total = int(cu[-1])
    q, dout = (random_array(rng, (total, 4, 48), dtype) for _ in range(2))
    k, v = (random_array(rng, (total, 2, 48), dtype) for _ in range(2))
    gq, gk, gv, gdout, gcu = (cupy.asarray(x) for x in (q, k, v, dout, cu))

    def rank_work(comm):
        shards = [dist.shard_varlen(x, gcu, comm, layout) for x in (gq, gk, gv, gdout)]
        kw = dict(comm=comm, causal=causal, window=window, layout=layout)
        out, lse = dist.ring_attention_varlen_forward(*shards[:3], gcu, **kw)
        grads = dist.ring_attention_varlen_backward(shards[3], *shards[:3], out, lse, gcu, **kw)
        return [dist.unshard_varlen(x, gcu, comm, layout) for x in (out, *grads)]

    results = dist.InProcessGroup(world_size).run(rank_work)
    for other in results[1:]:
        assert_bitwise_equal(other, results[0])
    kw = dict(causal=causal, window=window)
    one_out, one_lse = cupyflash.attention_varlen_forward(gq, gk, gv, gcu, gcu, **kw)
    one = [one_out, *cupyflash.attention_varlen_backward(gdout, gq, gk, gv, one_out, one_lse, gcu, gcu, **kw)]
    wide = [np.asarray(x, dtype=np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = cupyflash.attention_varlen_forward(*wide[:3], cu, cu, **kw)
    refs = [ref_out, *cupyflash.attention_varlen_backward(wide[3], *wide[:3], ref_out, ref_lse, cu, cu, **kw)]
    assert_as_exact_as_the_single_call(("out", "dq", "dk", "dv"), results[0], one, refs, dtype)
    if dtype == np.float64:
        for name, x, ref in zip(("out", "dq", "dk", "dv"), results[0], refs):
            error = float(np.abs(to_host(x) - ref).max())
            assert error <= 1e-12 * max(1.0, float(np.abs(ref).max())), f"{name}: float64 error {error:.3g}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_merge_rows_is_the_public_merge(rng, dtype):
    """merge_rows on a run of rows inside a larger accumulator: NumPy's merge_attention_states (the same rules)
    on those rows, every other row untouched, and rows that one side never saw (lse -inf) copied exactly."""
    acc_dtype = np.float64 if dtype == np.float64 else np.float32
    lead, n_acc, n, row0, dv = (2, 3), 50, 19, 23, 72
    out_acc = random_array(rng, lead + (n_acc, dv), acc_dtype)
    lse_acc = rng.standard_normal(lead + (n_acc,)).astype(acc_dtype)
    out_b = random_array(rng, lead + (n, dv), dtype)
    lse_b = rng.standard_normal(lead + (n,)).astype(acc_dtype)
    lse_acc[0, 0, row0 : row0 + 5] = -np.inf  # the accumulator saw nothing: a copy of the block
    lse_b[0, 1, :4] = -np.inf  # the block saw nothing: the accumulator unchanged
    lse_acc[1, 2, row0 + 2 : row0 + 4] = -np.inf
    lse_b[1, 2, 2:4] = -np.inf  # neither saw anything: out 0, lse -inf
    expected_out, expected_lse = out_acc.copy(), lse_acc.copy()
    merged = cupyflash.merge_attention_states(
        out_acc[..., row0 : row0 + n, :], lse_acc[..., row0 : row0 + n], out_b.astype(acc_dtype), lse_b
    )
    expected_out[..., row0 : row0 + n, :], expected_lse[..., row0 : row0 + n] = merged
    with nan_filled_allocations():
        g_out, g_lse = cupy.asarray(out_acc), cupy.asarray(lse_acc)
        ring_states.merge_rows(g_out, g_lse, row0, cupy.asarray(out_b), cupy.asarray(lse_b))
    got_out, got_lse = to_host(g_out), to_host(g_lse)
    tol = 1e-13 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(got_out, expected_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_lse, expected_lse, rtol=tol, atol=tol)
    np.testing.assert_array_equal(got_out[0, 0, row0 : row0 + 5], out_b[0, 0, :5].astype(acc_dtype))
    np.testing.assert_array_equal(got_out[0, 1, row0 : row0 + 4], out_acc[0, 1, row0 : row0 + 4])
    assert np.all(got_out[1, 2, row0 + 2 : row0 + 4] == 0) and np.all(np.isneginf(got_lse[1, 2, row0 + 2 : row0 + 4]))
    outside = np.ones(n_acc, dtype=bool)
    outside[row0 : row0 + n] = False
    np.testing.assert_array_equal(got_out[..., outside, :], out_acc[..., outside, :])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_add_rows(rng, dtype):
    """add_rows adds a block into a run of rows of a float accumulator, and touches no other row."""
    acc_dtype = np.float64 if dtype == np.float64 else np.float32
    acc = random_array(rng, (3, 40, 33), acc_dtype)
    x = random_array(rng, (3, 11, 33), dtype)
    g_acc = cupy.asarray(acc)
    ring_states.add_rows(g_acc, 7, cupy.asarray(x))
    expected = acc.copy()
    expected[:, 7:18] += x.astype(acc_dtype)
    np.testing.assert_array_equal(to_host(g_acc), expected)
    with pytest.raises(ValueError, match="does not fit"):
        ring_states.add_rows(g_acc, 35, cupy.asarray(x))


@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_ring_over_nccl_on_two_gpus():
    """Eight cases over NCCL on two GPUs (dtypes, layouts, GQA, softcap, ALiBi, scale, window, and bf16 causal at
    N = 8192) and two packed batches: each result held to the single GPU's error against float64 by the
    blocked-schedule rule (the dense ones to the accuracy rule too); mismatched calls raise on every rank."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cupyflash.distributed.launch",
            "--nproc",
            "2",
            str(ROOT / "tests" / "gpu" / "ring_worker.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("ring/one-GPU error") == 8, done.stdout
    assert done.stdout.count("packed ring/one-GPU") == 2, done.stdout
    assert "mismatched calls raise on every rank" in done.stdout


@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_two_nodes_under_slurm_variables():
    """Two "nodes" of one GPU each, as srun starts them: each process sees one GPU (CUDA_VISIBLE_DEVICES) and
    only Slurm's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID = 0, SLURM_NNODES = 2); init() finds
    rank 0's host as the step's first node and the example's ring matches one GPU's results."""
    from cupyflash.distributed.launch import free_port

    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "CUPYX_DISTRIBUTED_HOST",
        "CUPYX_DISTRIBUTED_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
    )
    base = {name: value for name, value in os.environ.items() if name not in drop}
    base.update(
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_LOCALID="0",
        SLURM_STEP_NODELIST="localhost",
        MASTER_PORT=str(free_port()),
    )
    command = [sys.executable, str(ROOT / "examples" / "ring_attention.py"), "--n", "4096"]
    procs = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=dict(base, SLURM_PROCID=str(rank), CUDA_VISIBLE_DEVICES=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:] + err[-4000:]
    errors = [float(line.rsplit("=", 1)[1]) for line in outputs[0][0].splitlines() if "max |ring" in line]
    assert len(errors) == 5 and max(errors) < 3e-2, outputs[0][0]


@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_example_runs_on_two_gpus():
    """examples/ring_attention.py under the launcher: the ring's results match one GPU's closely."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cupyflash.distributed.launch",
            "--nproc",
            "2",
            str(ROOT / "examples" / "ring_attention.py"),
            "--n",
            "4096",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    errors = [float(line.rsplit("=", 1)[1]) for line in done.stdout.splitlines() if "max |ring" in line]
    assert len(errors) == 5 and max(errors) < 3e-2, done.stdout
