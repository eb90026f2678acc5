"""cupyflash: FlashAttention forward and backward as our own CUDA kernels, compiled at run time by CuPy."""

from cupyflash import reference
from cupyflash._api import (
    attention,
    attention_backward,
    attention_forward,
    attention_probs,
    attention_varlen,
    attention_varlen_backward,
    attention_varlen_forward,
)
from cupyflash._fp8.hadamard import hadamard_rotate
from cupyflash._fp8.tensor import FP8Tensor, quantize_fp8
from cupyflash._kvcache.api import attention_with_kvcache
from cupyflash._kvcache.fp8 import FP8KVCache, quantize_kvcache
from cupyflash._merge import merge_attention_states, merge_attention_states_stacked
from cupyflash._modifiers import BLOCK_MASK_TILE, block_mask_from_dense
from cupyflash._warmup import warmup

__version__ = "0.8.2"

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "attention_probs",
    "attention_varlen",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "quantize_kvcache",
    "FP8KVCache",
    "merge_attention_states",
    "merge_attention_states_stacked",
    "quantize_fp8",
    "FP8Tensor",
    "hadamard_rotate",
    "block_mask_from_dense",
    "BLOCK_MASK_TILE",
    "warmup",
    "reference",
    "__version__",
]
