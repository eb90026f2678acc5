"""cupyflash.warmup: its argument checks and the variants it picks (CPU: the loader is replaced by a
recorder), its error without a GPU, and (gpu) that a call after it compiles nothing."""

import cupy
import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import _config, _kernels, _modifiers, _warmup

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
# Head dim as passed -> the kernel HEAD_DIM that serves it: the smallest shipped one that holds it.
EXPECTED_HEAD_DIM = {1: 16, 8: 16, 16: 16, 17: 32, 40: 64, 64: 64, 80: 96, 100: 128, 129: 160, 192: 192,
                     200: 256, 256: 256}


@pytest.fixture
def recorder(monkeypatch):
    """Replaces the loader with a list of the variants it was asked for, and pretends device 0 exists."""
    calls = []
    monkeypatch.setattr(_kernels, "_functions", lambda variant: calls.append(variant) or {})
    monkeypatch.setattr(_kernels, "_modules", {})
    monkeypatch.setattr(_warmup, "_current_device_id", lambda: 0)
    return calls


def test_default_warms_every_plain_variant_of_the_api(recorder):
    warmed = cupyflash.warmup()
    expected = [v for v in _kernels.shipped_variants()
                if not v.mods and not v.dropout and v.wgmma == _kernels.uses_wgmma(v.itemsize, v.head_dim, v.direction)
                and v.large_smem == _kernels.uses_large_smem(v.itemsize, v.head_dim)]
    assert sorted(warmed, key=repr) == sorted(expected, key=repr)
    assert recorder == warmed, "each variant is loaded once, in the order returned"
    assert len(warmed) == len(DTYPE_NAMES) * len(_config.HEAD_DIMS) * 2 * 2  # causal x direction


def test_dropout_adds_the_dropout_variants(recorder):
    warmed = cupyflash.warmup(dtypes="bf16", head_dims=128, causal=True, modifiers=True, dropout=True)
    # (mods, scalar_mods, dropout): with dropout the modifiers always take the instantiation with the arrays.
    assert [(v.mods, v.scalar_mods, v.dropout) for v in warmed if v.direction == "fwd"] == [
        (False, False, False), (False, False, True), (True, True, False), (True, False, True), (True, False, False)]
    assert all(v in _kernels.shipped_variants() for v in warmed)
    assert "dropout" in _warmup.describe(warmed[2])


def test_dtype_names_are_the_kernels_dtypes():
    assert _warmup.DTYPE_NAMES == tuple(_kernels._CTYPES) == DTYPE_NAMES


@pytest.mark.parametrize("head_dim", sorted(EXPECTED_HEAD_DIM))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_head_dims_round_up_as_the_api_does(recorder, dtype, head_dim):
    warmed = cupyflash.warmup(dtypes=dtype, head_dims=head_dim, causal=False)
    assert {(v.direction, v.head_dim) for v in warmed} == {("fwd", EXPECTED_HEAD_DIM[head_dim]),
                                                           ("bwd", EXPECTED_HEAD_DIM[head_dim])}
    assert all(v.ctype == _kernels._CTYPES[dtype] and not v.causal and not v.mods for v in warmed)


def test_selection_follows_causal_backward_and_modifiers(recorder):
    only_fwd = cupyflash.warmup(dtypes="float16", head_dims=64, causal=True, backward=False)
    wgmma = _kernels.uses_wgmma(2, 64)  # the path this machine's device takes (none: mma.sync)
    assert only_fwd == [_kernels.Variant("fwd", "half_t", 64, True, False, wgmma)]
    with_mods = cupyflash.warmup(dtypes="float16", head_dims=(60, 64), causal=(False, True), modifiers=True)
    # 60 and 64 share HEAD_DIM 64; with modifiers, causal travels in the window: per direction one variant
    # with the modifiers' arrays and one without (window, softcap, ALiBi alone).
    assert set(with_mods) == {_kernels.Variant(d, "half_t", 64, causal, False, wgmma)
                              for d in ("fwd", "bwd") for causal in (False, True)} | \
                             {_kernels.Variant(d, "half_t", 64, False, True, wgmma, scalar_mods=scalars)
                              for d in ("fwd", "bwd") for scalars in (False, True)}
    assert len(with_mods) == len(set(with_mods)) == 8


def test_modifiers_include_the_bounded_softcap_forward_on_hopper(recorder, monkeypatch):
    """On the wgmma path, bfloat16 with modifiers also warms the forward that a softcap without ALiBi takes
    (Variant.bounded), the one such a call then finds loaded."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    warmed = cupyflash.warmup(dtypes="bf16", head_dims=128, causal=True, modifiers=True)
    bounded = [v for v in warmed if v.bounded and not v.block_mask]  # (the block mask's: its own test)
    assert len(bounded) == 1 and bounded[0].direction == "fwd" and bounded[0] in _kernels.shipped_variants()
    assert "softcap without ALiBi" in _warmup.describe(bounded[0])
    mods = _modifiers.resolve(np, np.dtype(ml_dtypes.bfloat16), (2, 3), 100, 120, softcap=30.0)
    assert _kernels._variant("fwd", ml_dtypes.bfloat16, 128, 128, False, mods) == bounded[0]
    assert not any(v.bounded for v in cupyflash.warmup(dtypes="fp16", head_dims=128, modifiers=True))


def test_modifiers_warm_the_alibi_form_each_mask_takes_on_hopper(recorder, monkeypatch):
    """ALiBi's warp-specialized forward has a form for windows with a right edge (Variant.half_first, causal
    calls among them) and one without: warmup loads the one each warmed mask's ALiBi calls then find."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    slopes = np.ones(3, np.float32)
    for causal, forms in ((True, {True}), (False, {False}), ((False, True), {False, True})):
        warmed = cupyflash.warmup(dtypes="bf16", head_dims=128, causal=causal, modifiers=True, backward=False)
        alibi = [v for v in warmed if v.alibi and not v.block_mask]  # (the block mask's: its own test)
        assert len(alibi) == len(forms) and {v.half_first for v in alibi} == forms, causal
    for is_causal in (False, True):
        mods = _modifiers.resolve(np, np.dtype(ml_dtypes.bfloat16), (2, 3), 100, 120, alibi_slopes=slopes)
        assert _kernels._variant("fwd", ml_dtypes.bfloat16, 128, 128, is_causal, mods) in alibi
    assert "the window with a right edge" in _warmup.describe(next(v for v in alibi if v.half_first))
    assert "right edge" not in _warmup.describe(next(v for v in alibi if not v.half_first))


def test_modifiers_warm_the_block_mask_forms_on_hopper(recorder, monkeypatch):
    """A block mask without bias or mask takes, in the 16-bit forward on Hopper, the warp-specialized kernel's
    block-mask forms: warmup loads the ones such calls (alone, with a softcap, with ALiBi; causal and not)
    then find, and none elsewhere."""
    monkeypatch.setattr(_kernels, "_wgmma_device", lambda: True)
    on = np.ones((1, 1), bool)
    slopes = np.ones(3, np.float32)
    for dtype in ("bf16", "fp16"):
        warmed = cupyflash.warmup(dtypes=dtype, head_dims=128, causal=(False, True), modifiers=True)
        walks = {v for v in warmed if v.block_mask}
        wanted = {_kernels._variant("fwd", np.dtype(ml_dtypes.bfloat16 if dtype == "bf16" else np.float16), 128, 128,
                                    causal, _modifiers.resolve(np, np.dtype(np.float16), (2, 3), 100, 120, block_mask=on,
                                                               **options))
                  for causal in (False, True) for options in ({}, dict(softcap=30.0), dict(alibi_slopes=slopes),
                                                             dict(window=(64, 0)))}
        assert walks == wanted and all(v.block_mask and v.warp_specialized for v in wanted), dtype
        assert all("block mask" in _warmup.describe(v) for v in walks)
    assert not any(v.block_mask for v in cupyflash.warmup(dtypes="bf16", head_dims=64, modifiers=True))


@pytest.mark.parametrize("dtype", [np.float16, np.dtype(np.float16), "half", "fp16", cupy.float16])
def test_accepts_dtypes_in_any_spelling(recorder, dtype):
    assert cupyflash.warmup(dtypes=dtype, head_dims=32) == cupyflash.warmup(dtypes="float16", head_dims=32)


def test_accepts_bfloat16_as_ml_dtypes_or_name(recorder):
    by_type = cupyflash.warmup(dtypes=[ml_dtypes.bfloat16], head_dims=[128])
    assert by_type == cupyflash.warmup(dtypes=("bf16",), head_dims=128)
    assert {v.ctype for v in by_type} == {"bfloat16_t"}


@pytest.mark.parametrize("kwargs, error, words", [
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
])
def test_bad_arguments_name_the_argument(recorder, kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        cupyflash.warmup(**kwargs)
    assert recorder == [], "nothing is loaded before every argument is checked"


def test_verbose_prints_one_line_per_variant(recorder, capsys):
    warmed = cupyflash.warmup(dtypes="float32", head_dims=96, causal=True, verbose=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(warmed) == 2
    assert lines[0].startswith("warmup 1/2: fwd float32 HEAD_DIM=96 causal ") and " s (" in lines[0]


def test_already_loaded_variants_are_not_loaded_again(recorder, capsys):
    variant = _kernels.Variant("fwd", "float", 96, True)
    _kernels._modules[0, variant] = {}
    cupyflash.warmup(dtypes="float32", head_dims=96, causal=True, verbose=True)
    assert variant not in recorder and len(recorder) == 1
    assert "(already loaded)" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("count", [RuntimeError("cudaErrorNoDevice"), 0])
def test_no_device_is_a_clear_runtime_error(monkeypatch, count):
    def device_count():
        if isinstance(count, Exception):
            raise count
        return count

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", device_count)
    with pytest.raises(RuntimeError, match="cupyflash.warmup needs a CUDA device"):
        cupyflash.warmup(dtypes="float16", head_dims=64)


@pytest.mark.skipif(cupy.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_warmup_raises_runtime_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cupyflash.warmup()


def _no_compiling(*args, **kwargs):
    raise AssertionError("a kernel was compiled after warmup")


@pytest.mark.gpu
def test_after_warmup_with_modifiers_their_forwards_compile_nothing(monkeypatch):
    """warmup(modifiers=True) loads the forwards that window, softcap, ALiBi and block-mask calls pick, causal
    and not: on Hopper at HEAD_DIM 128 the warp-specialized forms, ALiBi's two (with and without a right edge)
    and the block mask's among them."""
    monkeypatch.setattr(_kernels, "_modules", {})
    cupyflash.warmup(dtypes="bfloat16", head_dims=128, causal=(False, True), modifiers=True, backward=False)
    monkeypatch.setattr(cupy, "RawModule", _no_compiling)
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((1, 2, 200, 128), dtype=np.float32).astype(ml_dtypes.bfloat16))
               for _ in range(3))
    slopes = cupy.asarray([0.5, 0.25], dtype=cupy.float32)
    block_mask = cupy.asarray([[True, False], [True, True]])
    for causal in (False, True):
        for options in ({"alibi_slopes": slopes}, {"alibi_slopes": slopes, "window": (64, 16)},
                        {"alibi_slopes": slopes, "window": (64, -1)}, {"softcap": 30.0}, {"window": (64, 0)},
                        {"softcap": 30.0, "window": (64, -1)}, {"block_mask": block_mask},
                        {"block_mask": block_mask, "softcap": 30.0}, {"block_mask": block_mask, "alibi_slopes": slopes},
                        {"block_mask": block_mask, "window": (64, 0)}):
            cupyflash.attention_forward(q, k, v, causal=causal, **options)
    cupy.cuda.Device().synchronize()


@pytest.mark.gpu
def test_after_warmup_calls_compile_nothing(monkeypatch, capsys):
    monkeypatch.setattr(_kernels, "_modules", {})  # start cold in this process (CuPy's disk cache may be warm)
    warmed = cupyflash.warmup(dtypes="float16", head_dims=40, causal=(False, True), verbose=True)
    first = capsys.readouterr().out
    device = cupy.cuda.Device().id
    assert all((device, v) in _kernels._modules for v in warmed)
    assert first.count("(compiled)") + first.count("(disk cache)") == len(warmed) == 4
    monkeypatch.setattr(cupy, "RawModule", _no_compiling)
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((1, 2, 70, 36), dtype=np.float32).astype(np.float16))
               for _ in range(3))  # D = 36 and 40 both run on HEAD_DIM 64
    for causal in (False, True):
        out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
        cupyflash.attention_backward(out, q, k, v, out, lse, causal=causal)
    cupy.cuda.Device().synchronize()
    assert cupyflash.warmup(dtypes="float16", head_dims=40, verbose=True) == warmed
    assert capsys.readouterr().out.count("(already loaded)") == len(warmed)
