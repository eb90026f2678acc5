"""FP8 caches with CuPy arrays, until the decode kernel reads e4m3: the call raises NotImplementedError naming the
CuPy arrays (nothing is written, nothing silently computed), and quantize_kvcache / dequantize, plain array code,
give NumPy's bits. Needs a GPU:

    python -m pytest -m gpu tests/gpu/test_gpu_kvcache_fp8.py
"""

import ml_dtypes
import numpy as np
import pytest

import cupyflash

cupy = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu


def test_attention_on_fp8_caches_raises_not_implemented(rng):
    k8, v8 = (cupyflash.quantize_kvcache(cupy.asarray(rng.standard_normal((2, 2, 64, 32), np.float32))) for _ in "kv")
    q = cupy.asarray(rng.standard_normal((2, 4, 1, 32), np.float32))
    k, v = (cupy.asarray(rng.standard_normal((2, 2, 1, 32), np.float32)) for _ in "kv")
    codes, scales = k8.data.copy(), k8.scale.copy()
    with pytest.raises(NotImplementedError, match="no GPU kernel for FP8 caches yet"):
        cupyflash.attention_with_kvcache(q, k8, v8, k, v, cache_seqlens=3)
    assert bool((k8.data == codes).all()) and bool((k8.scale == scales).all())


@pytest.mark.parametrize("scaling", ["tensor", "head", "block"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=["float16", "bfloat16", "float32"])
def test_quantize_and_dequantize_give_numpy_bits(rng, dtype, scaling):
    x = rng.standard_normal((3, 2, 300, 40), dtype=np.float32).astype(dtype)
    on_host, on_gpu = cupyflash.quantize_kvcache(x, scaling), cupyflash.quantize_kvcache(cupy.asarray(x), scaling)
    np.testing.assert_array_equal(on_gpu.data.get(), on_host.data)
    np.testing.assert_array_equal(on_gpu.scale.get(), on_host.scale)
    for out_dtype in (np.float32, np.float64):
        np.testing.assert_array_equal(on_gpu.dequantize(out_dtype).get(), on_host.dequantize(out_dtype))
