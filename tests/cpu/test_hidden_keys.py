"""Non-finite values at hidden keys, on the CPU path (NumPy inputs) and in ``cupyflash.reference``.

A key hidden from query row i (by causal, a window, a mask or a block mask: its score is -inf) never affects
row i's out, lse or gradients, nor does row i affect that key's own dk and dv, even where k, v (or q, dout)
hold a NaN or an infinity (``cupyflash._arrays.matmul_seen``). So a run with one element of k or v poisoned
at key j gives, bit for bit, a clean run's out, lse and dq on every row that cannot see j, and dk and dv on
every key that no row seeing j sees; the rows that see j are not finite where the poison reaches them. Likewise
q or dout poisoned at row i: the other rows, and the keys row i cannot see, are as in a clean run.

The clean run has the very same inputs with the poisoned element at its finite value: then every sum that
meets no non-finite value is the same sum, term for term (a hidden pair adds 0 either way). The kernels'
side is tests/gpu/test_gpu_hidden_keys.py.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import hidden_keys
from helpers.modifiers import block_grid

import cupyflash
from cupyflash import reference

BATCH, NQ, NK, D, DV = (2, 2), 150, 170, 24, 20
ENTRY = (1, 1)  # the poisoned batch entry; the other three stay clean
KEY, ROW, COLUMN = 100, 40, 5
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
NAMES = ("out", "lse", "dq", "dk", "dv")


def _hider(rng, name):
    """(causal, options) that hide key KEY from some rows of ENTRY and let others see it, and row ROW from
    some keys: off = Nk - Nq = 20."""
    if name == "causal":  # row i sees keys j <= i + 20: key 100 from row 80 on; row 40 keys 0..60
        return True, {}
    if name == "window":  # row i sees keys i + 10 .. i + 25: key 100 rows 75..90; row 40 keys 50..65
        return False, dict(window=(10, 5))
    if name == "mask":  # a random mask (keeps ~70%), and key 100 seen by row 149 at least
        mask = rng.random(BATCH + (NQ, NK)) < 0.7
        mask[..., NQ - 1, KEY] = mask[..., ROW, 0] = True
        return False, dict(mask=mask)
    if name == "block_mask":  # queries 0..127 never see keys 0..127 (key 100, and row 40 none of them)
        block_mask = np.ones(BATCH + block_grid(NQ, NK), bool)
        block_mask[..., 0, 0] = False
        return False, dict(block_mask=block_mask)
    raise ValueError(name)


HIDERS = ("causal", "window", "mask", "block_mask")


def _cpu_path(q, k, v, dout, causal, options):
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal, **options)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **options)
    return [np.asarray(x, dtype=np.float64) for x in (out, lse, *grads)]


def _reference(q, k, v, dout, causal, options):
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    return [out, lse, *reference.attention_backward(dout, q, k, v, causal=causal, **options)]


RUNNERS = {"cpu": _cpu_path, "reference": _reference}


def _problem(rng, dtype):
    shapes = (BATCH + (NQ, D), BATCH + (NK, D), BATCH + (NK, DV), BATCH + (NQ, DV))
    return dict(zip(("q", "k", "v", "dout"), (rng.standard_normal(s).astype(dtype) for s in shapes)))


def _run_both(rng, runner, dtype, hider, name, index, value):
    """Clean and poisoned results (float64 host arrays) of one problem, the hidden matrix of ENTRY, and the
    clean inputs."""
    causal, options = _hider(rng, hider)
    inputs = _problem(rng, dtype)
    clean = RUNNERS[runner](*inputs.values(), causal, options)
    poisoned_inputs = dict(inputs)
    poisoned_inputs[name] = inputs[name].copy()
    poisoned_inputs[name][ENTRY + index] = value
    assert not np.isfinite(np.asarray(poisoned_inputs[name][ENTRY + index], dtype=np.float64))
    poisoned = RUNNERS[runner](*poisoned_inputs.values(), causal, options)
    hidden = hidden_keys(BATCH, NQ, NK, causal, **options)[ENTRY]
    return clean, poisoned, hidden, inputs


def _others(shape):
    """True on every batch entry but ENTRY."""
    where = np.ones(shape, bool)
    where[ENTRY] = False
    return where


def _assert_equal(name, poisoned, clean, where):
    """poisoned == clean wherever ``where`` (broadcast to their shape) is True; those must be finite."""
    where = np.broadcast_to(where, poisoned.shape)
    assert where.any(), f"{name}: nothing to compare"
    x, y = poisoned[where], clean[where]
    assert np.isfinite(x).all(), (
        f"{name}: {np.count_nonzero(~np.isfinite(x))} elements the poison cannot reach are not finite"
    )
    differ = np.count_nonzero(x != y)
    assert differ == 0, (
        f"{name}: {differ} of {x.size} elements the poison cannot reach differ from a clean run "
        f"(max difference {np.max(np.abs(x - y)):.3g})"
    )


def _assert_not_finite(name, x):
    assert x.size, f"{name}: nothing to check"
    assert not np.isfinite(x).any(), f"{name}: {np.count_nonzero(np.isfinite(x))} of {x.size} are finite"


def _entry_rows(rows, ndim):
    """Bool of the results' shape (ndim dims, batch first) selecting ``rows`` (bool over NQ or NK) of ENTRY."""
    where = np.zeros(BATCH + (len(rows),) + (1,) * (ndim - 3), bool)
    where[ENTRY] = rows.reshape((-1,) + (1,) * (ndim - 3))
    return where


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("hider", HIDERS)
@pytest.mark.parametrize("runner, dtype", [("cpu", d) for d in DTYPES] + [("reference", "float64")])
def test_a_poisoned_key_reaches_only_the_rows_that_see_it(rng, runner, dtype, hider, name, value):
    clean, bad, hidden, inputs = _run_both(rng, runner, DTYPES[dtype], hider, name, (KEY, COLUMN), value)
    out, lse, dq, dk, dv = bad
    sees = ~hidden[:, KEY]  # the rows of ENTRY that see the poisoned key
    assert sees.any() and not sees.all(), "the problem must hide the key from some rows and not from others"
    for label, i, where in (
        ("out", 0, _entry_rows(~sees, 4)),
        ("lse", 1, _entry_rows(~sees, 3)),
        ("dq", 2, _entry_rows(~sees, 4)),
    ):
        _assert_equal(f"{label} of the rows that cannot see the key", bad[i], clean[i], where)
    # Keys that no row seeing KEY sees (KEY itself apart; the window leaves some): their dk and dv.
    untouched_keys = ~(~hidden[sees]).any(axis=0)
    untouched_keys[KEY] = False
    assert untouched_keys.any() or hider != "window"
    if untouched_keys.any():
        for label, i in (("dk", 3), ("dv", 4)):
            _assert_equal(
                f"{label} of the keys the poison cannot reach", bad[i], clean[i], _entry_rows(untouched_keys, 4)
            )
    for label, i in zip(NAMES, range(5)):  # other batch entries
        _assert_equal(
            f"{label} of the other batch entries",
            bad[i],
            clean[i],
            _others(bad[i].shape[:2]).reshape(BATCH + (1,) * (bad[i].ndim - 2)),
        )
    if name == "v":
        # v enters neither lse nor dv (P does not depend on it): both exactly as without the poison.
        _assert_equal("lse", lse, clean[1], True)
        _assert_equal("dv", dv, clean[4], True)
        _assert_not_finite("out of the rows that see the key, in its column", out[ENTRY][sees, COLUMN])
        _assert_not_finite("dq of the rows that see the key", dq[ENTRY][sees])
    elif np.isnan(value):
        _assert_not_finite("out of the rows that see the key", out[ENTRY][sees])
        _assert_not_finite("lse of the rows that see the key", lse[ENTRY][sees])
        _assert_not_finite("dq of the rows that see the key", dq[ENTRY][sees])
    else:  # +inf in k: a score of +inf where q's element is positive (-inf, a hidden key, where negative)
        plus = sees & (np.asarray(inputs["q"][ENTRY][:, COLUMN], dtype=np.float64) > 0)
        assert plus.any()
        _assert_not_finite("out of the rows that score the key +inf", out[ENTRY][plus])
        _assert_not_finite("lse of the rows that score the key +inf", lse[ENTRY][plus])


@pytest.mark.parametrize(
    "name, value",
    [("q", np.nan), ("q", np.inf), ("dout", np.nan), ("dout", np.inf)],
    ids=["q-nan", "q-inf", "dout-nan", "dout-inf"],
)
@pytest.mark.parametrize("hider", HIDERS)
@pytest.mark.parametrize("runner, dtype", [("cpu", d) for d in DTYPES] + [("reference", "float64")])
def test_a_poisoned_row_reaches_only_the_keys_it_sees(rng, runner, dtype, hider, name, value):
    """q or dout poisoned at row ROW: every other row's out, lse and dq, and the dk and dv of every key ROW
    cannot see, are a clean run's; ROW's own results, and the keys it sees, are not finite."""
    clean, bad, hidden, inputs = _run_both(rng, runner, DTYPES[dtype], hider, name, (ROW, COLUMN), value)
    out, lse, dq, dk, dv = bad
    seen = ~hidden[ROW]  # the keys ROW sees
    assert seen.any() and not seen.all(), "the problem must hide some keys from the row and not others"
    others = np.ones(NQ, bool)
    others[ROW] = False
    for label, i, where in (
        ("out", 0, _entry_rows(others, 4)),
        ("lse", 1, _entry_rows(others, 3)),
        ("dq", 2, _entry_rows(others, 4)),
        ("dk", 3, _entry_rows(~seen, 4)),
        ("dv", 4, _entry_rows(~seen, 4)),
    ):
        _assert_equal(f"{label} the poisoned row cannot reach", bad[i], clean[i], where)
    for label, i in zip(NAMES, range(5)):
        _assert_equal(
            f"{label} of the other batch entries",
            bad[i],
            clean[i],
            _others(bad[i].shape[:2]).reshape(BATCH + (1,) * (bad[i].ndim - 2)),
        )
    _assert_not_finite("dq of the poisoned row", dq[ENTRY][ROW])
    if name == "dout":  # the forward never reads dout
        _assert_equal("out", out, clean[0], True)
        _assert_equal("lse", lse, clean[1], True)
        _assert_not_finite("dv of the keys the row sees, in its column", dv[ENTRY][seen, COLUMN])
        _assert_not_finite("dk of the keys the row sees", dk[ENTRY][seen])
        return
    _assert_not_finite("out of the poisoned row", out[ENTRY][ROW])
    _assert_not_finite("lse of the poisoned row", lse[ENTRY][ROW])
    # q NaN: every key the row sees scores NaN; q +inf: those scored +inf (k's element positive).
    reached = seen if np.isnan(value) else seen & (np.asarray(inputs["k"][ENTRY][:, COLUMN], np.float64) > 0)
    assert reached.any()
    _assert_not_finite("dk of the keys the poisoned row reaches", dk[ENTRY][reached])
    _assert_not_finite("dv of the keys the poisoned row reaches", dv[ENTRY][reached])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_key_no_row_sees_changes_nothing(rng, dtype):
    """k NaN and v +inf at every key that no query sees (those left of a window band): every result, on the
    CPU path and in the reference, is a clean run's, and those keys' dk and dv are 0."""
    causal, options = False, dict(window=(10, 5))
    inputs = _problem(rng, dtype)
    hidden = hidden_keys(BATCH, NQ, NK, causal, **options)
    unseen = hidden.all(axis=-2)  # (*BATCH, NK): keys no row sees
    assert unseen.any() and not unseen.all()
    clean = _cpu_path(*inputs.values(), causal, options)
    poisoned = dict(inputs)
    for name, value in (("k", np.nan), ("v", np.inf)):
        poisoned[name] = np.where(unseen[..., None], value, inputs[name]).astype(inputs[name].dtype)
    bad = _cpu_path(*poisoned.values(), causal, options)
    for label, x, y in zip(NAMES, bad, clean):
        _assert_equal(label, x, y, True)
    assert not bad[3][unseen].any() and not bad[4][unseen].any()
    ref_clean = _reference(*inputs.values(), causal, options)
    ref_bad = _reference(*poisoned.values(), causal, options)
    for label, x, y in zip(NAMES, ref_bad, ref_clean):
        _assert_equal(f"reference {label}", x, y, True)
