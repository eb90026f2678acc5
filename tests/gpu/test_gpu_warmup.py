"""cupyflash.warmup on a GPU: after it, the calls it stands for compile nothing. Needs a GPU:

python -m pytest -m gpu tests/gpu/test_gpu_warmup.py
"""

import os

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash._cuda import compile as compile_
from cupyflash._cuda import fused_backward, plans

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


def _no_compiling(*args, **kwargs):
    raise AssertionError("a kernel was compiled after warmup")


@pytest.fixture
def cold(monkeypatch):
    """Start cold in this process (CuPy's disk cache may be warm): no module loaded, no launch plan (a plan
    holds its kernels)."""
    monkeypatch.setattr(compile_, "modules", {})
    saved = plans.entries()
    plans.clear()
    yield
    for key, entry in saved.items():
        plans.put(key, entry)


def test_after_warmup_with_modifiers_their_forwards_compile_nothing(monkeypatch, cold):
    """warmup(modifiers=True) loads the forwards that window, softcap, ALiBi and block-mask calls pick, causal
    and not: on Hopper at HEAD_DIM 128 the warp-specialized forms, ALiBi's two (with and without a right edge)
    and the block mask's among them."""
    cupyflash.warmup(dtypes="bfloat16", head_dims=128, causal=(False, True), modifiers=True, backward=False)
    monkeypatch.setattr(cupy, "RawModule", _no_compiling)
    rng = np.random.default_rng(0)
    q, k, v = (
        cupy.asarray(rng.standard_normal((1, 2, 200, 128), dtype=np.float32).astype(ml_dtypes.bfloat16))
        for _ in range(3)
    )
    slopes = cupy.asarray([0.5, 0.25], dtype=cupy.float32)
    block_mask = cupy.asarray([[True, False], [True, True]])
    for causal in (False, True):
        for options in (
            {"alibi_slopes": slopes},
            {"alibi_slopes": slopes, "window": (64, 16)},
            {"alibi_slopes": slopes, "window": (64, -1)},
            {"softcap": 30.0},
            {"window": (64, 0)},
            {"softcap": 30.0, "window": (64, -1)},
            {"block_mask": block_mask},
            {"block_mask": block_mask, "softcap": 30.0},
            {"block_mask": block_mask, "alibi_slopes": slopes},
            {"block_mask": block_mask, "window": (64, 0)},
        ):
            cupyflash.attention_forward(q, k, v, causal=causal, **options)
    cupy.cuda.Device().synchronize()


def test_after_warmup_calls_compile_nothing(monkeypatch, capsys, cold):
    warmed = cupyflash.warmup(dtypes="float16", head_dims=40, causal=(False, True), verbose=True)
    first = capsys.readouterr().out
    device = cupy.cuda.Device().id
    assert all((device, v) in compile_.modules for v in warmed)
    # a forward and a backward for each causal, and on Hopper the fused backward of long sequences besides
    fused_variants = [v for v in warmed if v.fused_backward]
    assert len(fused_variants) == (2 if compile_.current_device().wgmma else 0)
    assert first.count("(compiled)") + first.count("(disk cache)") == len(warmed) == 4 + len(fused_variants)
    monkeypatch.setattr(cupy, "RawModule", _no_compiling)
    launched, real_launch = [], fused_backward.FusedBackwardPlan._launch_locked

    def launch_fused(plan, *args, **kwargs):
        launched.append(plan.variant)
        real_launch(plan, *args, **kwargs)

    monkeypatch.setattr(fused_backward.FusedBackwardPlan, "_launch_locked", launch_fused)
    rng = np.random.default_rng(0)
    # D = 36 and 40 both run on HEAD_DIM 64 (rows 40 wide); 8 heads of 8192 rows are enough work for the fused
    # backward (8 x 8192^2 x 40 >= WS_BWD_MIN_WORK)
    for shape in ((1, 2, 70, 36), (1, 8, 8192, 36)):
        q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(np.float16)) for _ in range(3))
        for causal in (False, True):
            out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
            cupyflash.attention_backward(out, q, k, v, out, lse, causal=causal)
    cupy.cuda.Device().synchronize()
    assert launched == fused_variants  # the long calls took the warmed fused variants
    assert cupyflash.warmup(dtypes="float16", head_dims=40, verbose=True) == warmed
    assert capsys.readouterr().out.count("(already loaded)") == len(warmed)


def test_warmup_selects_for_the_current_device():
    """What warmup loads is what the current device's calls select (select_variants with its abilities)."""
    from cupyflash import _warmup

    device = compile_.current_device()
    assert _warmup.select_variants("bf16", 128, True, True, True) == _warmup.select_variants(
        "bf16", 128, True, True, True, device=device
    )
    cc = int(cupy.cuda.Device().compute_capability)
    no_wgmma = os.environ.get("CUPYFLASH_NO_WGMMA", "0") not in ("", "0")
    assert device.wgmma == (cc == 90 and not no_wgmma) and device.large_smem == (cc >= 90)


def test_after_warmup_with_decode_kvcache_calls_compile_nothing(monkeypatch, cold):
    """warmup(decode=True) loads the decode kernels of a decode step, of a speculative step (more than 16 packed
    rows) and of a paged cache with small pages: such calls then compile nothing."""
    cupyflash.warmup(dtypes="bfloat16", head_dims=128, causal=False, backward=False, decode=True)
    monkeypatch.setattr(cupy, "RawModule", _no_compiling)
    rng = np.random.default_rng(0)

    def array(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16))

    k_cache, v_cache = array(2, 2, 256, 128), array(2, 2, 256, 128)
    for nq in (1, 12):  # 8 query heads over 2: 4 and 48 packed rows
        cupyflash.attention_with_kvcache(array(2, 8, nq, 128), k_cache, v_cache, cache_seqlens=100, causal=True)
    pages = array(40, 2, 16, 128), array(40, 2, 16, 128)
    table = cupy.asarray(rng.permutation(40)[:32].reshape(2, 16).astype(np.int32))
    cupyflash.attention_with_kvcache(array(2, 8, 1, 128), *pages, cache_seqlens=200, block_table=table)
    cupy.cuda.Device().synchronize()
