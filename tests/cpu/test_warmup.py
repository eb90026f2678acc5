"""cupyflash.warmup without a GPU: its argument checks, the variants it picks for a device's abilities
(``select_variants(..., device=Device(...))``, and warmup itself with the loader replaced by a recorder),
and its errors without CuPy or a device. That a call after it compiles nothing is tests/gpu/test_gpu_warmup.py.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.gpu import gpu_available

import cupyflash
from cupyflash import _modifiers, _warmup
from cupyflash._cuda import compile as compile_
from cupyflash._cuda import decode_tiles, tile_policy, tiles
from cupyflash._cuda.variants import DTYPES, FP8, Device, Features, Variant

HOPPER = Device(wgmma=True, large_smem=True)
AMPERE = Device()
BF16 = np.dtype(ml_dtypes.bfloat16)
# Head dim as passed -> the kernel HEAD_DIM that serves it: the smallest shipped one that holds it.
EXPECTED_HEAD_DIM = {
    1: 16,
    8: 16,
    16: 16,
    17: 32,
    40: 64,
    64: 64,
    80: 96,
    100: 128,
    129: 160,
    192: 192,
    200: 256,
    256: 256,
}
SHIPPED = set(tile_policy.shipped_variants())


@pytest.fixture
def recorder(monkeypatch):
    """Replaces the loader with a list of the variants it was asked for, pretends device 0 exists and has
    no Hopper paths (the selection of a GPU other than Hopper: deterministic on any machine)."""
    calls = []
    monkeypatch.setattr(compile_, "functions", lambda variant: calls.append(variant) or {})
    monkeypatch.setattr(compile_, "modules", {})
    monkeypatch.setattr(compile_, "current_device", lambda: AMPERE)
    monkeypatch.setattr(_warmup, "_current_device_id", lambda: 0)
    monkeypatch.setattr(_warmup, "_cache_entries", lambda: None)  # CuPy's cache directory: not asked
    return calls


def _select(direction, dtype, head_dim, causal, device=HOPPER, **options):
    mods = _modifiers.resolve(np, np.dtype(dtype), (2, 3), 100, 120, **options) if options else None
    return tile_policy.dense(Features.of(direction, np.dtype(dtype), head_dim, head_dim, causal, mods), device)


def test_default_warms_every_plain_variant_of_the_api(recorder):
    warmed = cupyflash.warmup()
    rounded = [v for v in warmed if not v.wide]  # (the others: grouped calls' backward, test_grouped_... below)
    expected = [v for v in SHIPPED if v.mods == "none" and not v.dropout and v.path == "mma" and not v.wide]
    assert sorted(rounded, key=repr) == sorted(expected, key=repr)
    assert recorder == warmed, "each variant is loaded once, in the order returned"
    assert len(rounded) == len(DTYPES) * len(tiles.HEAD_DIMS) * 2 * 2  # causal x direction


def test_on_hopper_the_default_warms_hoppers_paths():
    """The same calls on Hopper: the warp-specialized, wgmma, pieces and large-shared-memory variants where
    those calls take them, one per call as before."""
    warmed = [v for v in _warmup.select_variants(DTYPES, None, (False, True), False, True, device=HOPPER) if not v.wide]
    fused = [v for v in warmed if v.fused_backward]  # long sequences' 16-bit backward, causal and not
    assert len(fused) == 2 * len(tiles.WS_BWD_HEAD_DIMS) * 2
    # 16-bit forwards at HEAD_DIM 96 and 160 take the warp-specialized forward at 128 or 192 (padded),
    # which those head dims' own calls warm already
    shared = [d for d in tiles.HEAD_DIMS if tiles.ws_head_dim(d) not in (None, d)]
    assert shared == [96, 160]
    assert (
        len(warmed) == len(set(warmed)) == len(DTYPES) * len(tiles.HEAD_DIMS) * 2 * 2 + len(fused) - 2 * len(shared) * 2
    )
    assert set(warmed) <= SHIPPED
    assert {v.path for v in warmed} == {"mma", "large", "wgmma", "pieces", "ws"}
    longest = (tiles.CHAIN_ROWS, tiles.CHAIN_ROWS)
    for v in warmed:
        features = Features.of(
            v.direction,
            np.dtype(v.dtype),
            v.head_dim,
            v.head_dim,
            v.causal,
            lengths=longest if v.fused_backward else (0, 0),
        )
        assert v == tile_policy.dense(features, HOPPER), v


def test_dropout_adds_the_dropout_variants(recorder):
    warmed = [
        v
        for v in cupyflash.warmup(dtypes="bf16", head_dims=128, causal=True, modifiers=True, dropout=True)
        if not v.wide
    ]
    # (mods, dropout): with dropout the modifiers always take the form with the arrays.
    assert [(v.mods, v.dropout) for v in warmed if v.direction == "fwd"] == [
        ("none", False),
        ("none", True),
        ("scalars", False),
        ("all", True),
        ("all", False),
    ]
    assert all(v in SHIPPED for v in warmed)
    assert "dropout" in str(warmed[2]) and warmed[2].dropout


def test_dtype_names_are_the_kernels_dtypes():
    assert DTYPES == ("float16", "bfloat16", "float32", "float64")
    assert {v.dtype for v in SHIPPED} == set(DTYPES) | {FP8}  # FP8: the FP8 forward's e4m3 inputs


@pytest.mark.parametrize("head_dim", sorted(EXPECTED_HEAD_DIM))
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims_round_up_as_the_api_does(recorder, dtype, head_dim):
    warmed = [v for v in cupyflash.warmup(dtypes=dtype, head_dims=head_dim, causal=False) if not v.wide]
    assert {(v.direction, v.head_dim) for v in warmed} == {
        ("fwd", EXPECTED_HEAD_DIM[head_dim]),
        ("bwd", EXPECTED_HEAD_DIM[head_dim]),
    }
    assert all(v.dtype == dtype and not v.causal and v.mods == "none" for v in warmed)
    # the very variant a call of that head dim (D = Dv) selects
    for v in warmed:
        assert v == tile_policy.dense(
            Features.of(v.direction, np.dtype(_dtype(dtype)), head_dim, head_dim, False), AMPERE
        )


def _dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else name


def test_selection_follows_causal_backward_and_modifiers(recorder):
    only_fwd = cupyflash.warmup(dtypes="float16", head_dims=64, causal=True, backward=False)
    assert only_fwd == [Variant("fwd", "float16", 64, "mma", causal=True)]
    with_mods = [
        v
        for v in cupyflash.warmup(dtypes="float16", head_dims=(60, 64), causal=(False, True), modifiers=True)
        if not v.wide
    ]
    # 60 and 64 share HEAD_DIM 64; with modifiers, causal travels in the window: per direction one variant
    # with the modifiers' arrays and one without (window, softcap, ALiBi; the backward's block mask).
    plain = {Variant(d, "float16", 64, "mma", causal=causal) for d in ("fwd", "bwd") for causal in (False, True)}
    modified = {Variant(d, "float16", 64, "mma", mods) for d in ("fwd", "bwd") for mods in ("scalars", "all")}
    assert set(with_mods) == plain | modified
    assert len(with_mods) == len(set(with_mods)) == 8


def test_modifiers_on_hopper_warm_every_form_a_modifier_call_takes():
    """On Hopper, bfloat16 at HEAD_DIM 128 with modifiers: the softcap alone's backward, the window alone's
    forward and backward, the bounded forward, ALiBi's warp-specialized forms, the block mask's walks, and the
    full forms; every one shipped, and each the variant such a call selects."""
    warmed = _warmup.select_variants("bf16", 128, (False, True), True, True, device=HOPPER)
    assert set(warmed) <= SHIPPED
    calls = [
        dict(window=(10, -1), alibi_slopes=np.ones(3, np.float32)),
        dict(window=(10, -1)),
        dict(softcap=1.0),
        dict(bias=np.zeros((100, 120), BF16)),
        dict(block_mask=np.ones((1, 1), bool)),
    ]
    for options in calls:
        for causal in (False, True):
            for direction in ("fwd", "bwd"):
                assert _select(direction, BF16, 128, causal, **options) in warmed, (options, causal, direction)
    assert {v.mods for v in warmed} == {"none", "scalars", "softcap", "window", "all"}


def test_modifiers_include_the_bounded_softcap_forward_on_hopper():
    """On Hopper, bfloat16 with modifiers also warms the forward that a softcap without ALiBi takes (score
    bounded), the one such a call then finds loaded."""
    warmed = _warmup.select_variants("bf16", 128, True, True, True, device=HOPPER)
    bounded = [v for v in warmed if v.score == "bounded" and not v.block_mask]  # (the block mask's: its own test)
    assert len(bounded) == 1 and bounded[0].direction == "fwd" and bounded[0] in SHIPPED
    assert "bounded" in str(bounded[0])
    assert _select("fwd", BF16, 128, False, softcap=30.0) == bounded[0]
    assert not any(
        v.score == "bounded" for v in _warmup.select_variants("fp16", 128, (False, True), True, True, device=HOPPER)
    )
    assert not any(
        v.score == "bounded" for v in _warmup.select_variants("bf16", 128, (False, True), True, True, device=AMPERE)
    )


def test_modifiers_warm_the_alibi_form_each_mask_takes_on_hopper():
    """ALiBi's warp-specialized forward has a form for windows with a right edge (alibi_half_first, causal
    calls among them) and one without: warmup loads the one each warmed mask's ALiBi calls then find."""
    slopes = np.ones(3, np.float32)
    for causal, forms in (
        (True, {"alibi_half_first"}),
        (False, {"alibi"}),
        ((False, True), {"alibi", "alibi_half_first"}),
    ):
        warmed = _warmup.select_variants("bf16", 128, causal, True, False, device=HOPPER)
        alibi = [v for v in warmed if v.score.startswith("alibi") and not v.block_mask]  # (block mask: below)
        assert len(alibi) == len(forms) and {v.score for v in alibi} == forms, causal
    for is_causal in (False, True):
        assert _select("fwd", BF16, 128, is_causal, alibi_slopes=slopes) in alibi
    assert "alibi_half_first" in str(next(v for v in alibi if v.score == "alibi_half_first"))


def test_modifiers_warm_the_block_mask_forms_on_hopper():
    """A block mask without bias or mask takes, in the 16-bit forward on Hopper, the warp-specialized kernel's
    block-mask forms where its key blocks are the mask's tiles (head dims 64 and 128): warmup loads the ones
    such calls (alone, with a softcap, with ALiBi, with a window; causal and not) then find, and none
    elsewhere."""
    on = np.ones((1, 1), bool)
    slopes = np.ones(3, np.float32)
    for name, dtype in (("bf16", BF16), ("fp16", np.dtype(np.float16))):
        for head_dim in (64, 128):
            warmed = _warmup.select_variants(name, head_dim, (False, True), True, True, device=HOPPER)
            walks = {v for v in warmed if v.block_mask}
            wanted = {
                _select("fwd", dtype, head_dim, causal, block_mask=on, **options)
                for causal in (False, True)
                for options in ({}, dict(softcap=30.0), dict(alibi_slopes=slopes), dict(window=(64, 0)))
            }
            assert walks == wanted and all(v.block_mask and v.path == "ws" for v in wanted), (name, head_dim)
            assert all("block mask" in str(v) for v in walks)
    assert not any(
        v.block_mask for v in _warmup.select_variants("bf16", 256, (False, True), True, True, device=HOPPER)
    )  # 64-key blocks
    assert not any(v.block_mask for v in _warmup.select_variants("bf16", 128, (False, True), True, True, device=AMPERE))


@pytest.mark.parametrize("dtype", [np.float16, np.dtype(np.float16), "half", "fp16", "float16"])
def test_accepts_dtypes_in_any_spelling(recorder, dtype):
    assert cupyflash.warmup(dtypes=dtype, head_dims=32) == cupyflash.warmup(dtypes="float16", head_dims=32)


def test_accepts_bfloat16_as_ml_dtypes_or_name(recorder):
    by_type = cupyflash.warmup(dtypes=[ml_dtypes.bfloat16], head_dims=[128])
    assert by_type == cupyflash.warmup(dtypes=("bf16",), head_dims=128) == cupyflash.warmup(dtypes=BF16, head_dims=128)
    assert {v.dtype for v in by_type} == {"bfloat16"}


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(dtypes="flaot16"), ValueError, "unknown dtype 'flaot16'"),
        (dict(dtypes="complex64"), ValueError, "complex64 is not supported"),
        (dict(dtypes=np.int8), ValueError, "int8 is not supported"),
        (dict(dtypes=None), TypeError, "None is not a dtype"),
        (dict(dtypes=()), ValueError, "dtypes must hold at least one value"),
        (dict(head_dims=0), ValueError, "head_dims: 0 is out of range"),
        (dict(head_dims=[64, 257]), ValueError, "head_dims: 257 is out of range; head dims run from 1 to 256"),
        (dict(head_dims=64.0), TypeError, "head_dims must be ints"),
        (dict(head_dims=True), TypeError, "head_dims must be ints"),
        (dict(causal="yes"), TypeError, "causal must be a bool, got 'yes'"),
        (dict(causal=(False, 1)), TypeError, "causal must be a bool, got 1"),
        (dict(modifiers=None), TypeError, "modifiers must be a bool"),
        (dict(backward=1), TypeError, "backward must be a bool"),
        (dict(dropout="no"), TypeError, "dropout must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument(recorder, kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        cupyflash.warmup(**kwargs)
    assert recorder == [], "nothing is loaded before every argument is checked"


def test_verbose_prints_one_line_per_variant(recorder, capsys):
    warmed = cupyflash.warmup(dtypes="float32", head_dims=96, causal=True, verbose=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(warmed) == 2
    assert lines[0].startswith(f"warmup 1/2: {warmed[0]}  ") and " s (" in lines[0]
    assert lines[0].startswith("warmup 1/2: fwd float32 HEAD_DIM=96 causal ")


def test_already_loaded_variants_are_not_loaded_again(recorder, capsys):
    variant = Variant("fwd", "float32", 96, "mma", causal=True)
    compile_.modules[0, variant] = {}
    cupyflash.warmup(dtypes="float32", head_dims=96, causal=True, verbose=True)
    assert variant not in recorder and len(recorder) == 1
    assert "(already loaded)" in capsys.readouterr().out.splitlines()[0]


def test_without_cupy_warmup_raises_runtime_error_naming_cupy(monkeypatch):
    monkeypatch.setattr(_warmup, "cupy", None)
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        cupyflash.warmup(dtypes="float16", head_dims=64)


@pytest.mark.parametrize("count", [RuntimeError("cudaErrorNoDevice"), 0])
def test_no_device_is_a_clear_runtime_error(monkeypatch, count):
    cupy = pytest.importorskip("cupy")

    def device_count():
        if isinstance(count, Exception):
            raise count
        return count

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", device_count)
    with pytest.raises(RuntimeError, match="cupyflash.warmup needs a CUDA device"):
        cupyflash.warmup(dtypes="float16", head_dims=64)


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_warmup_raises_runtime_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cupyflash.warmup()


def test_decode_warms_every_decode_variant_a_call_can_pick(recorder):
    """With decode=True, each dtype and head dim adds the variants attention_with_kvcache's selection can
    pick for it (any number of packed rows, contiguous or paged with any page size), and only those."""
    rng = np.random.default_rng(0)
    warmed = cupyflash.warmup(dtypes=["bf16", "fp64"], head_dims=[40, 200], backward=False, causal=False, decode=True)
    decode = [v for v in warmed if isinstance(v, decode_tiles.DecodeVariant)]
    assert recorder == warmed and len(decode) == len(set(decode))
    assert set(decode) <= set(decode_tiles.shipped_variants())
    for _ in range(200):
        dtype = str(rng.choice(["bfloat16", "float64"]))
        # max(D, Dv) in the kernel head dim that 40 (33-64) or 200 (129-256) rounds up to
        width = int(rng.integers(33, 65)) if rng.random() < 0.5 else int(rng.integers(129, 257))
        d, dv = (width, int(rng.integers(1, width + 1)))[:: int(rng.choice([1, -1]))]
        packed = int(rng.integers(1, 200))
        page_size = None if rng.random() < 0.3 else int(rng.integers(1, 300))
        assert tile_policy.decode(dtype, d, dv, packed, page_size) in decode, (dtype, d, dv, packed, page_size)
    assert not any(isinstance(v, decode_tiles.DecodeVariant) for v in cupyflash.warmup(dtypes="bf16", head_dims=64))


def test_grouped_calls_backward_is_warmed_too():
    """A 16-bit backward whose k and v are broadcast over query heads (GQA, MQA) writes its gradients unrounded
    where that is the rounded call's kernel form (tile_policy.unrounded_alike): warmup loads those variants beside
    the rounded ones, short and long (the fused backward), on Hopper and elsewhere, and no unrounded variant
    where the forms differ (HEAD_DIM 32) or for float32."""
    for device in (HOPPER, AMPERE):
        for name, dtype in (("bf16", BF16), ("fp16", np.dtype(np.float16))):
            warmed = _warmup.select_variants(name, (64, 128, 256), (False, True), False, True, device=device)
            wide = {v for v in warmed if v.wide}
            expected = set()
            for head_dim in (64, 128, 256):
                for causal in (False, True):
                    for lengths in ((0, 0), (tiles.CHAIN_ROWS, tiles.CHAIN_ROWS)):
                        f = Features.of("bwd", dtype, head_dim, head_dim, causal, lengths=lengths)
                        expected.add(tile_policy.unrounded_alike(f, device))
            assert None not in expected and wide == expected and wide <= SHIPPED, (device, name)
        for head_dim in (32, 80, 96):  # padded unrounded; at 65-96 the two passes' fallback differs
            warmed = _warmup.select_variants("bf16", head_dim, (False, True), False, True, device=device)
            assert not any(v.wide for v in warmed), (device, head_dim)
        assert not any(v.wide for v in _warmup.select_variants("fp32", 128, (False, True), False, True, device=device))
