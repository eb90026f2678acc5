"""Non-finite values at hidden keys in the CUDA kernels. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_hidden_keys.py

What the kernels guarantee (the CPU path and the reference guarantee more: tests/cpu/test_hidden_keys.py):

- a non-finite k at a key hidden from row i never affects row i's forward (out, lse), bit for bit: the
  kernels replace a hidden score by -inf, whatever the product gave;
- a non-finite v at a hidden key (forward), or a non-finite k or v at a hidden key (backward: dq, and that
  key's own dk and dv), can reach row i only where the kernels process row i's 128-row block together with
  key j's 128-key block. They never do when no query of that row block sees any key of that key block:
  blocks outside the causal diagonal or the window's band, and tiles a block mask turns off, are skipped
  whole. (Keys hidden by ``mask`` alone are read.)

Every case compares a run with one element poisoned against a clean run whose element there is 0 (a value
that is never a float32 row block's largest, so that the float32 pieces' per-block powers of two are the
same in both runs); every allocation is filled with NaN.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import bits, hidden_keys
from helpers.gpu import nan_filled_allocations

import cupyflash

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
BLOCK = 128  # the rows and keys within which the kernels' tiles lie (tests/cpu/test_variants.py)
BATCH, D, COLUMN = (2, 2), 64, 5
ENTRY = (1, 0)  # the poisoned batch entry
_SPECIAL = {"nan": np.nan, "inf": np.inf}


def _run(q, k, v, dout, causal, options):
    """Forward and backward on the GPU, every allocation NaN: (out, lse, dq, dk, dv) as host arrays."""
    with nan_filled_allocations():
        out, lse = cupyflash.attention_forward(q, k, v, causal=causal, **options)
        grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **options)
    return tuple(x.get() for x in (out, lse, *grads))


def _problem(rng, dtype, nq, nk):
    shapes = (BATCH + (nq, D), BATCH + (nk, D), BATCH + (nk, D), BATCH + (nq, D))
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in zip(("q", "k", "v", "dout"), shapes)}


def _clean_and_poisoned(rng, dtype, nq, nk, causal, options, name, index, value):
    """Results of the clean run (0 at ``index`` of input ``name`` in batch entry ENTRY) and of the poisoned
    one (``value`` there), as host arrays; options' NumPy arrays go to the GPU."""
    host = _problem(rng, dtype, nq, nk)
    host[name][ENTRY + index] = 0
    device_options = {key: cupy.asarray(x) if isinstance(x, np.ndarray) else x for key, x in options.items()}
    clean = _run(*(cupy.asarray(x) for x in host.values()), causal, device_options)
    host[name][ENTRY + index] = _SPECIAL[value]
    poisoned = _run(*(cupy.asarray(x) for x in host.values()), causal, device_options)
    return clean, poisoned


def _entry(x):
    return x[ENTRY]


def _assert_same_bits(label, x, y):
    """Host arrays x and y hold the same bits, and are finite (nothing unwritten, nothing poisoned)."""
    assert x.size, f"{label}: nothing to compare"
    differ = int(np.count_nonzero(bits(x) != bits(y)))
    assert differ == 0, f"{label}: {differ} of {x.size} elements differ from a clean run"
    assert np.isfinite(np.asarray(x, np.float64)).all(), f"{label}: not finite in both runs"


def _assert_not_finite(label, x):
    assert x.size, f"{label}: nothing to check"
    finite = int(np.count_nonzero(np.isfinite(np.asarray(x, np.float64))))
    assert finite == 0, f"{label}: {finite} of {x.size} elements are finite"


def _other_entries_unchanged(clean, poisoned):
    for label, x, y in zip(("out", "lse", "dq", "dk", "dv"), poisoned, clean):
        for entry in np.ndindex(BATCH):
            if entry != ENTRY:
                _assert_same_bits(f"{label} of batch entry {entry}", x[entry], y[entry])


def _rows_apart_from(hidden, key):
    """Rows in 128-row blocks that see no key of ``key``'s 128-key block (the kernels never meet them)."""
    nq = hidden.shape[0]
    block = slice(key // BLOCK * BLOCK, min(hidden.shape[1], (key // BLOCK + 1) * BLOCK))
    apart = np.zeros(nq, bool)
    for r0 in range(0, nq, BLOCK):
        apart[r0 : r0 + BLOCK] = hidden[r0 : r0 + BLOCK, block].all()
    return apart


# (Nq, Nk, causal, options, the poisoned key): a causally hidden key in the last key block, seen by rows
# 290..299 (rows 0..255 are in row blocks that see no key of block 256..383); a key the window hides from all
# but rows 836..964 of 1000 (row blocks 0..5 never meet its block 896..1023).
CASES = {"causal": (300, 300, True, {}, 290), "window": (1000, 1000, False, dict(window=(64, 64)), 900)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_nan_k_at_a_hidden_key_never_reaches_the_forward(rng, dtype, case):
    """k NaN at key j: out and lse of every row that cannot see j are a clean run's, bit for bit (also rows
    whose blocks meet j's); rows that see j are not finite; dq of the rows whose blocks never meet j's is a
    clean run's; other batch entries are untouched."""
    nq, nk, causal, options, key = CASES[case]
    clean, bad = _clean_and_poisoned(rng, dtype, nq, nk, causal, options, "k", (key, COLUMN), "nan")
    hidden = hidden_keys((), nq, nk, causal, **options)
    sees = ~hidden[:, key]
    assert sees.any() and not sees.all()
    blind = np.flatnonzero(~sees)
    _assert_same_bits("out of the rows that cannot see the key", _entry(bad[0])[blind], _entry(clean[0])[blind])
    _assert_same_bits("lse of the rows that cannot see the key", _entry(bad[1])[blind], _entry(clean[1])[blind])
    seeing = np.flatnonzero(sees)
    _assert_not_finite("out of the rows that see the key", _entry(bad[0])[seeing])
    _assert_not_finite("lse of the rows that see the key", _entry(bad[1])[seeing])
    apart = np.flatnonzero(_rows_apart_from(hidden, key))
    _assert_same_bits("dq of the row blocks apart from the key's block", _entry(bad[2])[apart], _entry(clean[2])[apart])
    _other_entries_unchanged(clean, bad)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_poisoned_v_at_a_hidden_key_stays_in_the_blocks_that_meet_it(rng, dtype, case, value):
    """v NaN or +inf at key j, column c: out and dq of the rows whose blocks never meet j's block are a clean
    run's, bit for bit; lse and dv (which no v enters) are a clean run's everywhere; column c of out is not
    finite on the rows that see j."""
    nq, nk, causal, options, key = CASES[case]
    clean, bad = _clean_and_poisoned(rng, dtype, nq, nk, causal, options, "v", (key, COLUMN), value)
    hidden = hidden_keys((), nq, nk, causal, **options)
    apart = _rows_apart_from(hidden, key)
    assert apart.any() and not apart.all()
    rows = np.flatnonzero(apart)
    _assert_same_bits("out of the row blocks apart from the key's block", _entry(bad[0])[rows], _entry(clean[0])[rows])
    _assert_same_bits("dq of the row blocks apart from the key's block", _entry(bad[2])[rows], _entry(clean[2])[rows])
    _assert_same_bits("lse", bad[1], clean[1])
    _assert_same_bits("dv", bad[4], clean[4])
    seeing = np.flatnonzero(~hidden[:, key])
    _assert_not_finite("out of the rows that see the key, in its column", _entry(bad[0])[seeing, COLUMN])
    _other_entries_unchanged(clean, bad)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_mask_hidden_key_in_a_tile_the_block_mask_turns_off_is_never_read(rng, dtype, name):
    """mask hides key 200 from rows 0..127, and the block mask turns their tile of keys 128..255 off: k or v
    NaN there leaves out, lse and dq of rows 0..127 as in a clean run, bit for bit; rows 128..299 see the
    key and are not finite (out: v's column)."""
    nq = nk = 300
    key = 200
    mask = rng.random(BATCH + (nq, nk)) < 0.9
    mask[..., :BLOCK, key] = False
    mask[..., :, 0] = True  # every row sees a key
    mask[..., BLOCK:, key] = True
    block_mask = np.ones(BATCH + (math.ceil(nq / BLOCK), math.ceil(nk / BLOCK)), bool)
    block_mask[..., 0, 1] = False
    options = dict(mask=mask, block_mask=block_mask)
    clean, bad = _clean_and_poisoned(rng, dtype, nq, nk, False, options, name, (key, COLUMN), "nan")
    for label, i in (("out", 0), ("lse", 1), ("dq", 2)):
        _assert_same_bits(f"{label} of rows 0..127", _entry(bad[i])[:BLOCK], _entry(clean[i])[:BLOCK])
    seen = _entry(bad[0])[BLOCK:]
    _assert_not_finite("out of the rows that see the key", seen[:, COLUMN] if name == "v" else seen)
    _other_entries_unchanged(clean, bad)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_keys_no_row_sees_in_skipped_blocks_change_nothing(rng, dtype):
    """Nk > Nq with a window: keys 0..635 are seen by no row (row i sees i + 636 .. i + 764), and key blocks
    0..3 lie wholly outside the band. k NaN and v +inf at keys 0..511: every result is a clean run's, bit
    for bit, and those keys' dk and dv are 0."""
    nq, nk, options = 300, 1000, dict(window=(64, 64))
    host = _problem(rng, dtype, nq, nk)
    unseen = slice(0, 4 * BLOCK)
    assert hidden_keys((), nq, nk, False, **options)[:, unseen].all()
    device = {name: cupy.asarray(x) for name, x in host.items()}
    clean = _run(*device.values(), False, options)
    host["k"][..., unseen, :] = np.nan
    host["v"][..., unseen, :] = np.inf
    poisoned = _run(*(cupy.asarray(x) for x in host.values()), False, options)
    for label, x, y in zip(("out", "lse", "dq", "dk", "dv"), poisoned, clean):
        _assert_same_bits(label, x, y)
    for label, x in (("dk", poisoned[3]), ("dv", poisoned[4])):
        assert not np.asarray(x[..., unseen, :], np.float64).any(), f"{label} of the keys no row sees is not 0"
