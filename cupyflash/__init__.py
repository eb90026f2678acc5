"""cupyflash: FlashAttention forward and backward as our own CUDA kernels, compiled at run time by CuPy."""

from cupyflash import reference
from cupyflash._api import attention, attention_backward, attention_forward

__version__ = "0.1.0"

__all__ = ["attention", "attention_forward", "attention_backward", "reference", "__version__"]
