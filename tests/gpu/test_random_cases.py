"""Randomized differential testing: random problems through the CUDA kernels against the float64 reference.
Needs a GPU:

    python -m pytest tests/gpu/test_random_cases.py                     # 150 cases, seed 6
    python -m pytest tests/gpu/test_random_cases.py --random-cases 1000
    python -m pytest tests/gpu/test_random_cases.py --random-seed 6 --random-cases 18 -k case_17_

Case ``i`` of seed ``S`` is drawn from its own generator, seeded with ``(S, i)``: it does not depend on how
many cases run, so a failure replays alone with the command its message prints (``--random-cases`` only has
to be larger than ``i``). A case draws:

- the dtype (float16, bfloat16, float32); head dims D and Dv in 1..256, mostly the common ones, often odd;
  Nq and Nk in 1..700, often just off a multiple of 64;
- leading dims: (B, H); grouped-query (B, Hk, G) against (B, Hk, 1); k and v with no leading dims; k and v
  broadcast along different dims; none at all; or four dims that do not merge (the kernels' copy path).
  The batch shrinks so that B·H·Nq·Nk stays below ``SCORE_BUDGET`` and the float64 reference stays quick;
- causal or not; an explicit scale or the default;
- each score modifier on with some probability: window, softcap, ALiBi slopes, bias (broadcast shapes, the
  inputs' dtype or float32, sometimes a transposed view), mask (broadcast, sometimes a strided view),
  block mask;
- a memory layout for each of q, k, v and dout: contiguous, (…, N, H, D) transposed to (…, H, N, D),
  every other row, rows starting one row in, rows wider than D (sliced), or stride-0 broadcast leading dims.

Each case runs forward and backward with every allocation poisoned with NaN (helpers.gpu) and is held to
the project's rule (tests/helpers/checks.py: float16/bfloat16 within twice a naive same-dtype
implementation's error plus the reference's rounding, float32 1e-5 relative; dbias too). Magnitudes stay
where that rule applies to float32 (logits of at most ~10: ALiBi slopes are capped by the sequence length).
The generator leaves out what that rule cannot judge: gradients that are exactly 0 everywhere while ours
hold float32 rounding noise of dP - delta (every row seeing one key: Nk = 1 with long Nq or large Dv, a
window side of 0, a random mask over a few keys; a bias constant along the keys, whose gradient is 0), and
block masks broadcast along their tile dims (tests/helpers/checks.hidden_keys expands the tiles as given).

The module first compiles every kernel variant the selected cases need, in parallel, into CuPy's on-disk
kernel cache, so the cases do not wait on ~150 serial NVRTC compiles.
"""

import math
import os
import warnings
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest
from helpers.checks import assert_matches_reference
from helpers.gpu import nan_filled_allocations
from helpers.modifiers import run

from cupyflash._cuda import tile_policy
from cupyflash._cuda.compile import compile_ahead, current_device
from cupyflash._cuda.variants import Features
from cupyflash._modifiers import BLOCK_MASK_TILE, Modifiers

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

DEFAULT_CASES = 150
DEFAULT_SEED = 6
DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}
COMMON_HEAD_DIMS = (16, 32, 40, 64, 64, 80, 96, 128, 128, 160, 192, 256)
MAX_HEAD_DIM = 256
MAX_LENGTH = 700
SCORE_BUDGET = 300_000  # B·H·Nq·Nk, so the float64 reference takes well under a second
LAYOUTS = ("bh", "gqa", "shared_kv", "mixed", "none", "deep")
VIEWS = ("contiguous", "transposed", "step", "offset", "wide_rows", "expanded")
OPTION_LETTERS = dict(window="w", softcap="s", alibi="a", bias="b", mask="m", block_mask="k")


# ----------------------------------------------------------------------------- case generation (cheap)
@dataclass
class Case:
    """Everything that defines one random problem; the arrays themselves are drawn in the test."""

    seed: int
    index: int
    dtype: str
    d: int
    dv: int
    nq: int
    nk: int
    layout: str
    leads: dict  # q, k, v -> leading dims
    causal: bool
    scale: float = None
    views: dict = field(default_factory=dict)  # q, k, v, dout -> one of VIEWS
    window: tuple = None
    softcap: float = 0.0
    alibi: tuple = None  # (shape, max slope)
    bias: tuple = None  # (shape, dtype name, transposed view)
    mask: tuple = None  # (shape, keep probability, strided view)
    block_mask: tuple = None  # (shape, keep probability)

    @property
    def batch(self):
        return tuple(np.broadcast_shapes(*self.leads.values()))

    @property
    def options_on(self):
        on = [name for name in ("window", "alibi", "bias", "mask", "block_mask") if getattr(self, name) is not None]
        return on + (["softcap"] if self.softcap else [])

    @property
    def has_mods(self):
        window_on = self.window is not None and tuple(self.window) != (-1, -1)
        return (
            window_on
            or bool(self.softcap)
            or any(getattr(self, name) is not None for name in ("alibi", "bias", "mask", "block_mask"))
        )

    @property
    def id(self):
        letters = "".join(OPTION_LETTERS[name] for name in OPTION_LETTERS if name in self.options_on)
        return (
            f"case_{self.index}_{self.dtype}_d{self.d}v{self.dv}_q{self.nq}k{self.nk}_{self.layout}"
            + ("_causal" if self.causal else "")
            + (f"_{letters}" if letters else "")
        )

    def describe(self):
        lines = [
            f"random case {self.index} of seed {self.seed}: {self.id}",
            f"  replay: python -m pytest tests/gpu/test_random_cases.py --random-seed {self.seed} "
            f"--random-cases {self.index + 1} -k case_{self.index}_",
            f"  dtype {self.dtype}, D {self.d}, Dv {self.dv}, Nq {self.nq}, Nk {self.nk}, causal {self.causal}, "
            f"scale {self.scale}",
            f"  layout {self.layout}: q {self.leads['q']}, k {self.leads['k']}, v {self.leads['v']} -> batch "
            f"{self.batch}; views {self.views}",
            f"  window {self.window}, softcap {self.softcap}, alibi (shape, max slope) {self.alibi}",
            f"  bias (shape, dtype, transposed) {self.bias}, mask (shape, keep, strided) {self.mask}, "
            f"block_mask (shape, keep) {self.block_mask}",
        ]
        return "\n".join(lines)

    def variants(self):
        """The kernel variants this case launches (forward and backward) on the current device."""
        dtype = np.dtype(DTYPES[self.dtype])
        vec = 16 // dtype.itemsize
        d_w, dv_w = (-(-x // vec) * vec for x in (self.d, self.dv))
        # What Features.of asks of the modifiers: whether there are any, which per-element arrays, and the
        # softcap and window as resolve() gives them (window (-1, -1) when off). A Modifiers holding the
        # case's option specs where resolve() puts arrays: the selection only asks whether each is given.
        window = (-1, -1) if self.window is None else tuple(int(x) for x in self.window)
        mods = (
            Modifiers(
                window=window,
                softcap=float(self.softcap or 0.0),
                alibi_slopes=self.alibi,
                bias=self.bias,
                bias_shape=None,
                mask=self.mask,
                block_mask=self.block_mask,
            )
            if self.has_mods
            else None
        )
        device = current_device()
        return {
            tile_policy.dense(Features.of(direction, dtype, d_w, dv_w, self.causal, mods), device)
            for direction in ("fwd", "bwd")
        }


def draw_case(seed, index):
    """Case ``index`` of ``seed``: a pure function of the two, so any one case can be rebuilt alone."""
    rng = np.random.default_rng([seed, index])
    dtype = str(rng.choice(list(DTYPES)))
    d = _head_dim(rng)
    dv = d if rng.random() < 0.6 else _head_dim(rng)
    nq, nk = _length(rng), _length(rng)
    # Rows that see one key have dq = dk = 0 exactly; ours there is float32 noise of dP - delta (~1e-6 per
    # sqrt(Dv) terms), times scale * |k|. Keep it under the rule's absolute ZERO_ATOL and float32's rule:
    if nk == 1:
        nq, dv = min(nq, 16), min(dv, 64)
    if dtype == "fp32":
        dv = min(dv, 4 * d)
    layout = str(rng.choice(LAYOUTS))
    leads = _leading_dims(rng, layout, max(1, SCORE_BUDGET // (nq * nk)))
    case = Case(seed, index, dtype, d, dv, nq, nk, layout, leads, causal=bool(rng.random() < 0.4))
    if rng.random() < 0.25:
        case.scale = float(rng.uniform(0.3, 1.5) / math.sqrt(d))
    case.views = {name: _view_kind(rng) for name in ("q", "k", "v", "dout")}
    batch, full = case.batch, case.batch + (nq, nk)
    if rng.random() < 0.3:
        case.window = (_window_side(rng, nk, unbounded=0.3), _window_side(rng, nk, unbounded=0.5))
    if rng.random() < 0.25:
        case.softcap = float(rng.uniform(1.0, 30.0))
    if rng.random() < 0.25:
        # float32 holds logits to ~1e-7 relative: keep slope * distance below ~8 there (module docstring)
        max_slope = 0.5 if dtype != "fp32" else min(0.5, 8.0 / max(nq, nk))
        case.alibi = (_broadcast_shape(rng, batch), max_slope)
    if rng.random() < 0.3 and nk >= 2:
        # A bias constant along the keys only shifts each row's logits: softmax ignores it and its exact
        # gradient is 0 (rows of dS sum to 0), which no relative rule can hold. Keep the key dim (with
        # Nk = 1 every bias is such a constant: seed 6, case 985 summed that float32 noise over 96 rows).
        shape = _broadcast_shape(rng, full)
        shape = shape[:-1] + (nk,)
        transposed = len(shape) >= 2 and rng.random() < 0.25
        case.bias = (shape, "fp32" if rng.random() < 0.3 else dtype, bool(transposed))
    if rng.random() < 0.3 and nk >= 9:  # with a few keys a random mask may leave every row one key
        shape = _broadcast_shape(rng, full)
        case.mask = (shape, float(rng.uniform(0.5, 0.95)), bool(len(shape) >= 1 and rng.random() < 0.25))
    if rng.random() < 0.2:
        # Broadcast along the leading dims only: helpers.checks.hidden_keys expands the tile dims as given.
        grid = (math.ceil(nq / BLOCK_MASK_TILE), math.ceil(nk / BLOCK_MASK_TILE))
        case.block_mask = (_broadcast_shape(rng, batch) + grid, 0.7)
    return case


def _head_dim(rng):
    return int(rng.choice(COMMON_HEAD_DIMS)) if rng.random() < 0.6 else int(rng.integers(1, MAX_HEAD_DIM + 1))


def _length(rng):
    """1..MAX_LENGTH: tiny, just off a multiple of 64 (tile edges), or anything."""
    r = rng.random()
    if r < 0.1:
        return int(rng.integers(1, 9))
    if r < 0.35:
        return int(64 * rng.integers(1, 11) + rng.integers(-1, 2))
    return int(rng.integers(1, MAX_LENGTH + 1))


def _leading_dims(rng, layout, max_batch):
    """Leading dims of q, k, v for a layout, shrunk until their broadcast has at most max_batch entries."""
    size = lambda: int(rng.integers(1, 4))  # noqa: E731
    if layout == "bh":
        b, h = size(), size() + 1
        leads = dict(q=(b, h), k=(b, h), v=(b, h))
    elif layout == "gqa":
        b, hk, g = size(), size(), size() + 1
        leads = dict(q=(b, hk, g), k=(b, hk, 1), v=(b, hk, 1))
    elif layout == "shared_kv":
        leads = dict(q=(size(), size()), k=(), v=())
    elif layout == "mixed":  # k broadcast along B, v along H
        b, h = size() + 1, size() + 1
        leads = dict(q=(b, h), k=(1, h), v=(b, 1))
    elif layout == "none":
        leads = dict(q=(), k=(), v=())
    else:  # "deep": four dims that k and v broadcast along alternately (no merge to three dims)
        dims = [size() + 1 for _ in range(4)]
        leads = dict(q=tuple(dims), k=(dims[0], 1, dims[2], 1), v=(dims[0], 1, dims[2], 1))
    while math.prod(np.broadcast_shapes(*leads.values())) > max_batch:
        batch = np.broadcast_shapes(*leads.values())
        axis = int(np.argmax(batch))  # halve the largest dim, in every array that has it
        new = max(1, batch[axis] // 2)
        leads = {name: _resize_axis(shape, len(batch), axis, new) for name, shape in leads.items()}
    return leads


def _resize_axis(shape, ndim, axis, new):
    """Set the (right-aligned) ``axis`` of a ``ndim``-dim batch to ``new`` in ``shape`` where it is not 1."""
    at = axis - (ndim - len(shape))
    if at < 0 or shape[at] == 1:
        return shape
    return shape[:at] + (new,) + shape[at + 1 :]


def _broadcast_shape(rng, full):
    """A shape that broadcasts to ``full``: each dim kept or made 1, then leading 1s sometimes dropped."""
    shape = [n if rng.random() < 0.6 else 1 for n in full]
    while shape and shape[0] == 1 and rng.random() < 0.5:
        shape.pop(0)
    return tuple(shape)


def _window_side(rng, nk, unbounded):
    r = rng.random()
    if r < unbounded:
        return -1
    if r < unbounded + (1 - unbounded) / 2:  # >= 1: a side of 0 with causal leaves every row one key
        return int(rng.integers(1, 17))
    return int(rng.integers(1, nk + 1))


def _view_kind(rng):
    return "contiguous" if rng.random() < 0.5 else str(rng.choice(VIEWS[1:]))


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    count = metafunc.config.getoption("random_cases", default=None)
    seed = metafunc.config.getoption("random_seed", default=None)
    count = DEFAULT_CASES if count is None else count
    seed = DEFAULT_SEED if seed is None else seed
    cases = [draw_case(seed, index) for index in range(count)]
    metafunc.parametrize("case", cases, ids=[case.id for case in cases])


# ----------------------------------------------------------------------------- arrays of a case
def _random(rng, shape, dtype):
    """Standard-normal values rounded to dtype, on the GPU (as helpers.problems.random_array)."""
    return cupy.asarray(np.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype))


def _view(rng, shape, dtype, kind):
    """An array of ``shape`` (…, N, D) with unit column stride, laid out as ``kind`` says."""
    lead, (n, d) = shape[:-2], shape[-2:]
    if kind == "transposed" and lead:  # (…, N, H, D) memory seen as (…, H, N, D)
        return _random(rng, lead[:-1] + (n, lead[-1], d), dtype).swapaxes(-2, -3)
    if kind == "step":
        return _random(rng, lead + (2 * n, d), dtype)[..., ::2, :]
    if kind == "offset":
        return _random(rng, lead + (n + 1, d), dtype)[..., 1:, :]
    if kind == "wide_rows":
        return _random(rng, lead + (n, d + int(rng.integers(1, 9))), dtype)[..., :d]
    if kind == "expanded" and any(size > 1 for size in lead):
        sizes = [i for i, size in enumerate(lead) if size > 1]
        stretched = set(rng.choice(sizes, size=int(rng.integers(1, len(sizes) + 1)), replace=False).tolist())
        small = tuple(1 if i in stretched else size for i, size in enumerate(lead))
        return cupy.broadcast_to(_random(rng, small + (n, d), dtype), shape)
    return _random(rng, shape, dtype)


def draw_arrays(case):
    """q, k, v, dout and the options of a case, from its own data generator."""
    rng = np.random.default_rng([case.seed, case.index, 1])
    dtype = DTYPES[case.dtype]
    q = _view(rng, case.leads["q"] + (case.nq, case.d), dtype, case.views["q"])
    k = _view(rng, case.leads["k"] + (case.nk, case.d), dtype, case.views["k"])
    v = _view(rng, case.leads["v"] + (case.nk, case.dv), dtype, case.views["v"])
    dout = _view(rng, case.batch + (case.nq, case.dv), dtype, case.views["dout"])
    options = {}
    if case.window is not None:
        options["window"] = case.window
    if case.softcap:
        options["softcap"] = case.softcap
    if case.alibi is not None:
        shape, max_slope = case.alibi
        options["alibi_slopes"] = cupy.asarray(np.asarray(rng.uniform(0, max_slope, size=shape), np.float32))
    if case.bias is not None:
        shape, bias_dtype, transposed = case.bias
        if transposed:
            options["bias"] = _random(rng, shape[:-2] + (shape[-1], shape[-2]), DTYPES[bias_dtype]).swapaxes(-1, -2)
        else:
            options["bias"] = _random(rng, shape, DTYPES[bias_dtype])
    if case.mask is not None:
        shape, keep, strided = case.mask
        if strided:
            options["mask"] = cupy.asarray(np.asarray(rng.random(shape[:-1] + (2 * shape[-1],)) < keep))[..., ::2]
        else:
            options["mask"] = cupy.asarray(np.asarray(rng.random(shape) < keep))
    if case.block_mask is not None:
        shape, keep = case.block_mask
        options["block_mask"] = cupy.asarray(np.asarray(rng.random(shape) < keep))
    return q, k, v, dout, options


# ----------------------------------------------------------------------------- compile ahead, in parallel
@pytest.fixture(scope="module", autouse=True)
def _compiled_ahead(request):
    """Compile every variant the selected cases need into CuPy's kernel cache, 16 at a time: NVRTC runs
    without the GIL, and cupyflash._cuda.compile then loads each module from the cache instead of compiling
    ~150 of them one after another. Best effort: a failure here is only a warning (the case then
    compiles, and fails, on its own)."""
    cases = [
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    ]
    variants = set().union(*(case.variants() for case in cases)) if cases else set()
    _compile_into_cache(variants)


def _compile_into_cache(variants):
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") not in ("", "0"):
        return  # no on-disk cache to fill
    problems = compile_ahead(variants, max_workers=min(16, os.cpu_count() or 1))
    if problems:
        warnings.warn("compiling ahead failed for:\n" + "\n".join(problems[:5]), stacklevel=2)


# ----------------------------------------------------------------------------- the test
def test_random_case(case):
    print(case.describe())  # shown by pytest with the failure
    q, k, v, dout, options = draw_arrays(case)
    try:
        with nan_filled_allocations():
            results = run(q, k, v, dout, causal=case.causal, scale=case.scale, **options)
        assert_matches_reference(q, k, v, dout, results, causal=case.causal, scale=case.scale, **options)
    except Exception as error:
        if hasattr(error, "add_note"):  # Python >= 3.11; older ones still print the description above
            error.add_note(case.describe())
        raise
