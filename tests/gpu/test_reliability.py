"""Reliability: extreme and non-finite values; threads, devices, streams and CUDA graphs; memory.
Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_reliability.py

Non-finite inputs: the policy
-----------------------------
A NaN or an infinity in q, k or v is never hidden and never leaks:

1. Whatever depends on it through a nonzero path is NaN. q row i poisoned: out row i and dq row i (every
   column), dk and dv of every key row i sees (with +inf and 16-bit inputs, dv of the keys whose score is
   +inf: those with -inf get P = 0), and lse_i is not finite. k row j poisoned: out, lse and dq of every
   row that sees key j, dk of every key those rows see, dv row j. v[j, c] poisoned: column c of out for
   every row that sees key j, and through delta_i = rowsum(out_i * dout_i) every dq and dk of those rows.
2. What it cannot reach is bit for bit the result of a clean run: other batch entries, other rows of out,
   lse and dq (rows are independent), other columns of out, and lse and dv when only v is poisoned.
3. out and lse are NaN (lse: not finite) exactly where the float64 reference's are: the reference, the CPU
   path and the kernels all let a NaN row sum through (only a sum of exactly 0, a row that sees no key,
   gives out = 0 and lse = -inf). Every test below checks that against the reference.
4. Keys a row cannot see: the CPU path and the reference never let a hidden key reach a row, nor a row the
   gradients of a key it cannot see (tests/cpu/test_hidden_keys.py). The kernels skip whole blocks of rows
   and keys that see nothing of each other (never read: finite); inside a block they load, a gradient
   reached only through a zero probability, 0 * NaN, is unspecified (tests/gpu/test_gpu_hidden_keys.py
   says what is guaranteed).

Extreme values. Logits of +-1e4 are built exactly (integer q, k; scale 1/4), so the float64 reference sees
the very logits the kernels do. The forward is held to the project's rule; the backward rebuilds
P = exp(s - lse) from a float32 lse of magnitude 1e4, whose resolution (~1e-3) is a relative error of every
recomputed P: the backward is held to the rule plus ``LSE_RESOLUTION * max|lse|`` times the gradient's
magnitude (sums of absolute values). A bias of -inf hides a key exactly as the mask does.

Concurrency: eight threads compile each new variant once and agree with the reference; a second device
compiles its own modules (skipped with one GPU); the calls enqueue on CuPy's current stream and return
without waiting for it; forward and backward capture into a CUDA graph that replays correctly on new
inputs. Memory: the forward allocates out and lse only, the backward the gradients and two O(N) row
statistics; 1,000 calls leave the memory pool, the module cache and Python's heap where they were.
"""

import collections
import functools
import gc
import threading
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import (
    FP32_RTOL,
    NAIVE_FACTOR,
    ZERO_ATOL,
    assert_close,
    assert_lse_close,
    assert_matches_reference,
    bits,
    max_abs,
    naive_attention,
    to_host,
)
from helpers.gpu import nan_filled_allocations
from helpers.modifiers import run
from helpers.problems import random_array, random_problem

import cupyflash
from cupyflash import _modifiers, reference
from cupyflash._cuda import compile as compile_
from cupyflash._cuda import plans, tile_policy
from cupyflash._cuda.variants import Features

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
NAMES = ("out", "lse", "dq", "dk", "dv")
_random = functools.partial(random_array, xp=cupy)
_random_problem = functools.partial(random_problem, xp=cupy)


def _run(q, k, v, dout, *, causal, scale=None, **options):
    """Forward then backward, every allocation NaN: (out, lse, dq, dk, dv[, dbias])."""
    with nan_filled_allocations():
        return run(q, k, v, dout, causal=causal, scale=scale, **options)


# =============================================================================== (a) extreme values
EXTREME_ENTRY = 200.0  # q[i, 0] k[j, 0] (or q[i, 1] k[j, 1]) = +-40000 raw, exact in every dtype ...
EXTREME_SCALE = 0.25  # ... times 1/4: logits of +-1e4, exactly
LSE_RESOLUTION = 2.0**-20  # relative error of a recomputed P per unit of |lse| (~2e-3 seen at 1e4; 5x margin)


def _extreme_problem(rng, dtype, batch=(2, 2), nq=150, nk=190, d=64):
    """Integer q, k (entries -1, 0, 1 and +-200) whose logits, times EXTREME_SCALE, are +-1e4 plus O(1):
    per row, every logit ~ +1e4, every logit ~ -1e4, or +-1e4 depending on the key."""
    q = rng.integers(-1, 2, size=batch + (nq, d)).astype(np.float32)
    k = rng.integers(-1, 2, size=batch + (nk, d)).astype(np.float32)
    kind = rng.integers(0, 3, size=batch + (nq,))
    q[..., 0] = np.select([kind == 0, kind == 1], [EXTREME_ENTRY, -EXTREME_ENTRY], 0.0)
    q[..., 1] = np.where(kind == 2, EXTREME_ENTRY * rng.choice([-1.0, 1.0], size=kind.shape), 0.0)
    k[..., 0] = EXTREME_ENTRY
    k[..., 1] = EXTREME_ENTRY * rng.choice([-1.0, 1.0], size=batch + (nk,))
    v, dout = (rng.standard_normal(batch + (n, d), dtype=np.float32) for n in (nk, nq))
    return tuple(cupy.asarray(x.astype(dtype)) for x in (q, k, v, dout))


def _rule_bound(ref, naive, dtype):
    """helpers.checks.assert_close's bound, as a number."""
    size = max_abs(ref)
    if size == 0:
        return ZERO_ATOL
    if dtype == np.float32:
        return FP32_RTOL * size
    rounding = max_abs(ref.astype(dtype).astype(np.float64) - ref)
    return NAIVE_FACTOR * max_abs(naive - ref) + rounding


def _gradient_magnitudes(q, k, v, dout, *, causal, scale):
    """max of scale |dS| |k|, scale |dS|^T |q| and P^T |dout| (float64): what a relative error of every P
    can move dq, dk and dv by."""
    p = reference.attention_probs(q, k, v, causal=causal, scale=scale)
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = np.abs(p * (dp - np.sum(p * dp, axis=-1, keepdims=True)))
    return (
        scale * max_abs(ds @ np.abs(k)),
        scale * max_abs(np.swapaxes(ds, -1, -2) @ np.abs(q)),
        max_abs(np.swapaxes(p, -1, -2) @ np.abs(dout)),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_logits_of_plus_and_minus_ten_thousand(rng, dtype, causal):
    q, k, v, dout = _extreme_problem(rng, dtype)
    results = _run(q, k, v, dout, causal=causal, scale=EXTREME_SCALE)
    host = [to_host(x) for x in (q, k, v, dout)]
    ours = [to_host(x) for x in results]
    for name, x in zip(NAMES, ours):
        assert np.isfinite(x).all(), f"{name}: {np.count_nonzero(~np.isfinite(x))} elements are not finite"

    ref_out, ref_lse = reference.attention(*host[:3], causal=causal, scale=EXTREME_SCALE, return_lse=True)
    assert max_abs(ref_lse) > 9000, "the problem lost its extreme logits"
    ref_grads = reference.attention_backward(host[3], *host[:3], causal=causal, scale=EXTREME_SCALE)
    naive = [
        to_host(x)
        for x in naive_attention(q, k, v, dout, causal=causal, scale=EXTREME_SCALE, round_scaled_scores=False)
    ]
    assert_lse_close(ours[1], ref_lse)
    assert_close("out", ours[0], ref_out, naive[0], dtype)

    p_error = LSE_RESOLUTION * max_abs(ref_lse)
    magnitudes = _gradient_magnitudes(*host, causal=causal, scale=EXTREME_SCALE)
    for name, x, ref, naive_x, magnitude in zip(NAMES[2:], ours[2:], ref_grads, naive[1:], magnitudes):
        error, rule = max_abs(x - ref), _rule_bound(ref, naive_x, dtype)
        bound = rule + p_error * magnitude
        assert error <= bound, (
            f"{name}: max error {error:.3g} > bound {bound:.3g} (rule {rule:.3g} + "
            f"{p_error:.3g} x magnitude {magnitude:.3g}; max|ref| {max_abs(ref):.3g})"
        )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_minus_infinity_bias_hides_keys_like_the_mask(rng, dtype):
    """-inf in the bias is a hidden key: a row of -inf gives out 0, lse -inf, dq 0; dbias is 0 there; the
    results are those of mask=(bias > -inf) with the finite bias, bit for bit."""
    batch, nq, nk, d = (2, 2), 150, 170, 64
    q, k, v, dout = _random_problem(rng, batch + (nq, d), batch + (nk, d), batch + (nk, d), dtype)
    keep = rng.random((2, 1, nq, nk)) < 0.7  # broadcast over the heads: dbias by float32 atomics
    keep[:, :, 5] = False  # query 5 sees no key
    values = rng.standard_normal(keep.shape, dtype=np.float32)
    bias = cupy.asarray(np.where(keep, values, -np.inf).astype(dtype))
    by_bias = _run(q, k, v, dout, causal=False, bias=bias)
    assert_matches_reference(q, k, v, dout, by_bias, causal=False, bias=bias)

    out, lse, dq, dk, dv, dbias = (to_host(x) for x in by_bias)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert not np.isnan(x).any(), f"{name} has NaN"
    assert not out[:, :, 5].any() and np.isneginf(lse[:, :, 5]).all() and not dq[:, :, 5].any()
    assert not dbias[~keep].any(), "dbias is not 0 where the bias is -inf"

    finite_bias = cupy.asarray(np.where(keep, values, 0).astype(dtype))
    by_mask = _run(q, k, v, dout, causal=False, bias=finite_bias, mask=cupy.asarray(keep))
    for name, x, y in zip(NAMES, by_bias, by_mask):
        assert cupy.array_equal(bits(x), bits(y)), f"{name}: -inf bias and mask differ"
    assert np.array_equal(dbias, to_host(by_mask[5])), "dbias: -inf bias and mask differ"


# ------------------------------------------------------------------------------- non-finite inputs
_SPECIAL_BITS = {
    ("float16", "nan"): 0x7E00,
    ("float16", "inf"): 0x7C00,
    ("bfloat16", "nan"): 0x7FC0,
    ("bfloat16", "inf"): 0x7F80,
    ("float32", "nan"): 0x7FC00000,
    ("float32", "inf"): 0x7F800000,
}
NQ, NK, D = 130, 150, 64
ROW, KEY, COLUMN = 77, 33, 7  # the poisoned query row, key row and column (in batch entry 1 of 2)


def _poisoned(x, index, value):
    """A copy of x with x[index] set to NaN or +inf (written as bits: no bfloat16 arithmetic)."""
    y = x.copy()
    bits(y)[index] = _SPECIAL_BITS[(np.dtype(x.dtype).name, value)]
    return y


def _clean_and_poisoned(rng, dtype, causal, name, index, value):
    """Results of a clean run and of one with input ``name`` ("q", "k" or "v") poisoned at ``index`` with
    ``value`` ("nan" or "inf"), as host arrays of their own dtype; and the clean k."""
    inputs = dict(zip("qkv", _random_problem(rng, (2, NQ, D), (2, NK, D), (2, NK, D), dtype)[:3]))
    dout = _random(rng, (2, NQ, D), dtype)
    clean = [x.get() for x in _run(*inputs.values(), dout, causal=causal)]
    inputs[name] = _poisoned(inputs[name], index, value)
    bad = [x.get() for x in _run(*inputs.values(), dout, causal=causal)]
    host = [np.asarray(x.get(), dtype=np.float64) for x in inputs.values()]
    ref_out, ref_lse = reference.attention(*host, causal=causal, return_lse=True)
    assert np.array_equal(np.isnan(_as_float(bad[0])), np.isnan(ref_out)), "out is NaN elsewhere than the reference"
    assert np.array_equal(np.isfinite(bad[1]), np.isfinite(ref_lse)), "lse is not finite elsewhere than the reference"
    return clean, bad, inputs["k"].get()


def _as_float(x):
    return np.asarray(x, dtype=np.float32)


def _assert_nan(name, x):
    x = _as_float(x)
    assert x.size and np.isnan(x).all(), f"{name}: {np.count_nonzero(~np.isnan(x))} of {x.size} are not NaN"


def _assert_unchanged(name, bad, clean, where):
    """bad == clean bit for bit wherever ``where`` (broadcast to their shape) is True."""
    where = np.broadcast_to(where, bad.shape)
    differ = np.count_nonzero(bits(bad)[where] != bits(clean)[where])
    assert differ == 0, f"{name}: {differ} elements the poison cannot reach differ from a clean run"


def _batch_entry(index, ndim):
    """Bool of shape (2, 1, ...) (ndim dims): True for batch entry ``index``."""
    return (np.arange(2) == index).reshape((2,) + (1,) * (ndim - 1))


def _assert_q_row_poisoned_alone(clean, bad):
    """Row ROW of batch entry 1 (where q was poisoned): out, dq NaN and lse not finite; every other row, and
    batch entry 0's key gradients, exactly as without the poison."""
    out, lse, dq, _, _ = bad
    _assert_nan("out of the poisoned row", out[1, ROW])
    _assert_nan("dq of the poisoned row", dq[1, ROW])
    assert not np.isfinite(lse[1, ROW]), f"lse of the poisoned row is {lse[1, ROW]}"
    other_rows = np.ones((2, NQ), dtype=bool)
    other_rows[1, ROW] = False
    for name, i, where in (
        ("out", 0, other_rows[..., None]),
        ("lse", 1, other_rows),
        ("dq", 2, other_rows[..., None]),
        ("dk", 3, _batch_entry(0, 3)),
        ("dv", 4, _batch_entry(0, 3)),
    ):
        _assert_unchanged(name, bad[i], clean[i], where)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_nan_in_q_poisons_its_row(rng, dtype, causal):
    clean, bad, _ = _clean_and_poisoned(rng, dtype, causal, "q", (1, ROW, 5), "nan")
    _assert_q_row_poisoned_alone(clean, bad)
    dk, dv = bad[3], bad[4]
    seen = np.arange(NK) <= ROW + NK - NQ if causal else np.ones(NK, dtype=bool)
    _assert_nan("dk of the keys the poisoned row sees", dk[1, seen])
    _assert_nan("dv of the keys the poisoned row sees", dv[1, seen])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_infinity_in_q_poisons_its_row(rng, dtype):
    clean, bad, k = _clean_and_poisoned(rng, dtype, False, "q", (1, ROW, 5), "inf")
    _assert_q_row_poisoned_alone(clean, bad)
    dk, dv = bad[3], bad[4]
    _assert_nan("dk of batch entry 1", dk[1])
    plus_infinity = _as_float(k[1, :, 5]) > 0  # keys whose score with the poisoned row is +inf
    _assert_nan("dv of the keys scored +inf", dv[1, plus_infinity])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_nan_in_k_poisons_every_row_that_sees_it(rng, dtype):
    clean, bad, _ = _clean_and_poisoned(rng, dtype, False, "k", (1, KEY, COLUMN), "nan")
    out, lse, dq, dk, dv = bad
    for name, x in (("out", out), ("dq", dq), ("dk", dk)):
        _assert_nan(f"{name} of batch entry 1", x[1])
    assert not np.isfinite(lse[1]).any(), "lse of batch entry 1 has finite values"
    _assert_nan("dv of the poisoned key", dv[1, KEY])  # other keys' dv: unspecified (policy 3)
    for name, i in zip(NAMES, range(5)):
        _assert_unchanged(name, bad[i], clean[i], _batch_entry(0, bad[i].ndim))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_nan_in_v_poisons_one_output_column_and_the_query_gradients(rng, dtype):
    clean, bad, _ = _clean_and_poisoned(rng, dtype, False, "v", (1, KEY, COLUMN), "nan")
    out, lse, dq, dk, dv = bad
    _assert_nan("out column of the poisoned value", out[1, :, COLUMN])
    _assert_nan("dq of batch entry 1", dq[1])
    _assert_nan("dk of batch entry 1", dk[1])
    other_columns = np.ones((2, 1, D), dtype=bool)
    other_columns[1, 0, COLUMN] = False
    _assert_unchanged("out", out, clean[0], other_columns)
    _assert_unchanged("lse", lse, clean[1], True)
    _assert_unchanged("dv", dv, clean[4], True)
    for name, i in (("dq", 2), ("dk", 3)):
        _assert_unchanged(name, bad[i], clean[i], _batch_entry(0, 3))


# =============================================================================== (b) concurrency
def _module_names(variant):
    """Each of the variant's modules, as the sorted kernel names it is built with."""
    return {tuple(sorted(variant.name_expression(kernel) for kernel in kernels)) for kernels in variant.modules}


def _expected_modules(dtype, d, dv, causal, options):
    vec = 16 // np.dtype(dtype).itemsize
    d_w, dv_w = (-(-x // vec) * vec for x in (d, dv))
    mods = _modifiers.resolve(np, np.dtype(dtype), (2,), 150, 170, **options) if options else None
    device = compile_.current_device()
    variants = (
        tile_policy.dense(Features.of(direction, np.dtype(dtype), d_w, dv_w, causal, mods), device)
        for direction in ("fwd", "bwd")
    )
    return set().union(*(_module_names(variant) for variant in variants))


def test_threads_compile_each_variant_once(rng, monkeypatch):
    """Eight threads start at once on four problems (two threads each) whose modules are not loaded: each
    module is built exactly once (counted at cupy.RawModule), and every thread's results are right."""
    problems = [
        (np.float16, 72, 72, False, {}),  # HEAD_DIM 96
        (ml_dtypes.bfloat16, 200, 200, True, {}),  # HEAD_DIM 256, causal
        (np.float32, 24, 40, True, {}),  # HEAD_DIM 64, D != Dv
        (np.float16, 140, 140, False, {"window": (30, 30)}),  # HEAD_DIM 160, modifiers
    ]
    inputs = [_random_problem(rng, (2, 150, d), (2, 170, d), (2, 170, dv), dtype) for dtype, d, dv, _, _ in problems]
    expected = set().union(
        *(_expected_modules(dtype, d, dv, causal, options) for dtype, d, dv, causal, options in problems)
    )
    built, lock = [], threading.Lock()
    original = cupy.RawModule

    def counting_raw_module(*args, **kwargs):
        code = kwargs.get("code", args[0] if args else "")
        if code.startswith("// cupyflash module:"):
            with lock:
                built.append(tuple(sorted(kwargs["name_expressions"])))
        return original(*args, **kwargs)

    saved, saved_plans = dict(compile_.modules), plans.entries()
    compile_.modules.clear()
    plans.clear()  # a plan holds its kernels: the calls must find the modules unloaded
    monkeypatch.setattr(cupy, "RawModule", counting_raw_module)
    barrier = threading.Barrier(2 * len(problems))
    results, errors = {}, []

    def work(slot, problem, arrays):
        _, _, _, causal, options = problem
        q, k, v, dout = arrays
        try:
            barrier.wait(timeout=120)
            results[slot] = run(q, k, v, dout, causal=causal, **options)
            cupy.cuda.get_current_stream().synchronize()
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append((slot, error))

    try:
        threads = [
            threading.Thread(target=work, args=(slot, problems[slot // 2], inputs[slot // 2]))
            for slot in range(2 * len(problems))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not any(thread.is_alive() for thread in threads), "a thread is still running after 10 minutes"
    finally:
        for key, value in saved.items():
            compile_.modules.setdefault(key, value)
        for key, value in saved_plans.items():
            plans.put(key, value)
    if errors:
        raise errors[0][1]
    counts = collections.Counter(built)
    assert set(counts) == expected and all(n == 1 for n in counts.values()), (
        f"modules built: {dict(counts)}; expected each of {sorted(expected)} once"
    )
    for slot in range(0, 2 * len(problems), 2):
        _, _, _, causal, options = problems[slot // 2]
        for name, x, y in zip(NAMES, results[slot], results[slot + 1]):
            assert cupy.array_equal(bits(x), bits(y)), f"problem {slot // 2}: two threads differ in {name}"
        assert_matches_reference(*inputs[slot // 2], results[slot], causal=causal, **options)


def test_second_device(rng):
    """Inputs on device 1 run there, with modules compiled for device 1."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    with cupy.cuda.Device(1):
        q, k, v, dout = _random_problem(rng, (2, 150, 64), (2, 170, 64), (2, 170, 64), np.float16)
        results = run(q, k, v, dout, causal=True, window=(50, 0))
        assert all(x.device.id == 1 for x in results)
        assert_matches_reference(q, k, v, dout, results, causal=True, window=(50, 0))
    assert any(device == 1 for device, _ in compile_.modules), "no module was compiled for device 1"


# A kernel that keeps its stream busy for `duration_ns` of the GPU's global timer (at most `max_cycles`).
_SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long duration_ns, long long max_cycles) {
  unsigned long long start, now;
  long long first, cycles;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(first));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(cycles));
  } while (now - start < duration_ns && cycles - first < max_cycles);
}
"""
SPIN_SECONDS = 2.0
MAX_SPIN_CYCLES = 40 * 10**9  # ~20 s at 2 GHz: a bound in case the global timer does not advance


def test_runs_on_the_current_stream_without_waiting(rng):
    """On a non-blocking stream held busy by a 2 s kernel, then given the inputs by copies queued behind it
    (the arrays hold NaN until then): the forward and backward calls return at once, an event recorded after
    them is still pending (no hidden synchronization), and the results, read after the stream finishes,
    are the default stream's bit for bit (the kernels ran on the current stream, after the copies)."""
    q0, k0, v0, dout0 = _random_problem(rng, (2, 3, 300, 64), (2, 3, 400, 64), (2, 3, 400, 64), np.float16)
    expected = run(q0, k0, v0, dout0, causal=True)
    sources = (q0, k0, v0, dout0)
    q, k, v, dout = targets = tuple(cupy.empty_like(x) for x in sources)
    spin = cupy.RawKernel(_SPIN_SOURCE, "spin")
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        # Warm up on this stream: the spin and copy kernels, and the memory pool's blocks for this stream.
        spin((1,), (1,), (np.uint64(0), np.int64(0)))
        for target, source in zip(targets, sources):
            target[...] = source
        warm = run(q, k, v, dout, causal=True)
        del warm
        for target in targets:
            target.fill(np.nan)
        stream.synchronize()

        started = time.perf_counter()
        spin((1,), (1,), (np.uint64(int(SPIN_SECONDS * 1e9)), np.int64(MAX_SPIN_CYCLES)))
        for target, source in zip(targets, sources):
            target[...] = source
        results = run(q, k, v, dout, causal=True)
        finished = stream.record()
        host_seconds = time.perf_counter() - started
        still_running = not finished.done
    stream.synchronize()
    assert host_seconds < SPIN_SECONDS / 2, f"the calls took {host_seconds:.2f} s: they waited for the stream"
    assert still_running, "the stream had finished when the calls returned: something synchronized with it"
    for name, x, y in zip(NAMES, results, expected):
        assert cupy.array_equal(bits(x), bits(y)), f"{name} differs from the default stream's"


def test_cuda_graph_capture_and_replay(rng):
    """Forward and backward (window, causal, a bias broadcast over the batch, so dbias goes through a zeroed
    float32 accumulator) captured on a stream into a CUDA graph, then replayed three times on new values
    written into the captured inputs: each replay's results match the reference (a dbias that accumulated
    across replays would not). Allocations come from a private memory pool that lives as long as the graph,
    warmed by one uncaptured call, so nothing the graph writes is handed to anyone else."""
    batch, nq, nk, d = (2, 2), 190, 230, 64
    dtype = np.float16
    shapes = (batch + (nq, d), batch + (nk, d), batch + (nk, d), batch + (nq, d), (1, 2, nq, nk))
    q, k, v, dout, bias = inputs = tuple(_random(rng, shape, dtype) for shape in shapes)
    options = dict(window=(120, 0), bias=bias)
    stream = cupy.cuda.Stream(non_blocking=True)
    graph_pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(graph_pool.malloc), stream:
        warm = run(q, k, v, dout, causal=True, **options)
        del warm
        stream.synchronize()
        stream.begin_capture()
        try:
            captured = run(q, k, v, dout, causal=True, **options)
        finally:
            graph = stream.end_capture()
    for _ in range(3):
        for x, shape in zip(inputs, shapes):
            x.set(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert_matches_reference(q, k, v, dout, captured, causal=True, **options)


# =============================================================================== (c) memory
class _AllocationTracker(cupy.cuda.MemoryHook):
    """Bytes held from CuPy's memory pool while active: now (``current``) and at most (``peak``)."""

    name = "cupyflash_allocation_tracker"

    def __init__(self):
        self.current = self.peak = 0

    def malloc_postprocess(self, **kwargs):
        if not kwargs["mem_ptr"]:  # a failed allocation
            return
        self.current += kwargs["mem_size"]
        self.peak = max(self.peak, self.current)

    def free_postprocess(self, **kwargs):
        self.current -= kwargs["mem_size"]


SLACK_BYTES = 64 * 1024  # what "small" means below: far below one (Nq x Nk) float32 score matrix per head


def _memory_problem(rng):
    shape = (2, 4, 4096, 64)
    q, k, v, dout = _random_problem(rng, shape, shape, shape, np.float16)
    scores_bytes = 2 * 4 * 4096 * 4096 * 4
    return q, k, v, dout, scores_bytes


def test_forward_allocates_only_out_and_lse(rng):
    q, k, v, _, scores_bytes = _memory_problem(rng)
    cupyflash.attention_forward(q, k, v, causal=True)  # compile and load outside the measurement
    cupy.cuda.Device().synchronize()
    tracker = _AllocationTracker()
    with tracker:
        out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    expected = out.nbytes + lse.nbytes
    assert tracker.peak <= expected + SLACK_BYTES, (
        f"forward peak {tracker.peak} bytes > out + lse {expected} + {SLACK_BYTES} (scores: {scores_bytes})"
    )
    assert expected <= tracker.current <= expected + SLACK_BYTES, f"forward holds {tracker.current} bytes after"


def test_backward_allocates_only_gradients_and_row_statistics(rng):
    q, k, v, dout, scores_bytes = _memory_problem(rng)
    out, lse = cupyflash.attention_forward(q, k, v, causal=True)
    cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)  # compile and load first
    cupy.cuda.Device().synchronize()
    tracker = _AllocationTracker()
    with tracker:
        dq, dk, dv = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    gradients = dq.nbytes + dk.nbytes + dv.nbytes
    rows = 4 * lse.nbytes  # delta = rowsum(out * dout), lse in log2 units (and room for 2 more): O(N)
    assert tracker.peak <= gradients + rows + SLACK_BYTES, (
        f"backward peak {tracker.peak} bytes > dq + dk + dv {gradients} + row statistics {rows} + {SLACK_BYTES} "
        f"(scores: {scores_bytes})"
    )
    assert gradients <= tracker.current <= gradients + SLACK_BYTES, f"backward holds {tracker.current} bytes after"


def test_a_thousand_calls_leave_memory_where_it_was(rng):
    """1,000 rounds of a plain causal call and a call with bias (dbias), mask and softcap, forward and
    backward: CuPy's pool holds the same bytes (used and reserved), no module is added, and Python's heap
    grows by less than 1 KiB per round."""
    q, k, v, dout = _random_problem(rng, (2, 2, 64, 32), (2, 2, 80, 32), (2, 2, 80, 32), np.float16)
    options = dict(
        bias=_random(rng, (2, 1, 64, 80), np.float16), mask=cupy.asarray(rng.random((64, 80)) < 0.8), softcap=10.0
    )

    def round_of_calls():
        return run(q, k, v, dout, causal=True), run(q, k, v, dout, causal=False, **options)

    pool = cupy.get_default_memory_pool()
    tracemalloc.start()
    try:
        for _ in range(10):
            results = round_of_calls()
            del results
        cupy.cuda.Device().synchronize()
        gc.collect()
        used, reserved, modules = pool.used_bytes(), pool.total_bytes(), len(compile_.modules)
        heap = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            results = round_of_calls()
            del results
        cupy.cuda.Device().synchronize()
        gc.collect()
        heap_growth = tracemalloc.get_traced_memory()[0] - heap
    finally:
        tracemalloc.stop()
    assert pool.used_bytes() == used, f"pool used bytes {used} -> {pool.used_bytes()}"
    assert pool.total_bytes() <= reserved, f"pool reserved bytes {reserved} -> {pool.total_bytes()}"
    assert len(compile_.modules) == modules, "the module cache grew"
    assert heap_growth < 1000 * 1024, f"Python's heap grew by {heap_growth} bytes over 1,000 rounds"
