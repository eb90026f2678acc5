"""Context parallelism: attention over a sequence sharded across GPUs (ring attention over NCCL).

One process per GPU (``python -m cupyflash.distributed.launch --nproc 2 script.py``); each holds a shard of
q, k, v along the sequence axis (or of every sequence of a packed batch: the ``_varlen`` functions), and the
key/value shards travel around a ring. ``InProcessGroup`` runs the
same ring over threads of one process (NumPy or CuPy arrays). ``python -m cupyflash --docs distributed``
explains.
"""

from cupyflash.distributed._comm import Communicator, InProcessGroup, init
from cupyflash.distributed._layout import LAYOUTS, shard, unshard
from cupyflash.distributed._ring import ring_attention, ring_attention_backward, ring_attention_forward
from cupyflash.distributed._ring_varlen import (
    ring_attention_varlen,
    ring_attention_varlen_backward,
    ring_attention_varlen_forward,
)
from cupyflash.distributed._varlen_layout import shard_varlen, unshard_varlen

__all__ = [
    "init",
    "Communicator",
    "InProcessGroup",
    "shard",
    "unshard",
    "ring_attention",
    "ring_attention_forward",
    "ring_attention_backward",
    "shard_varlen",
    "unshard_varlen",
    "ring_attention_varlen",
    "ring_attention_varlen_forward",
    "ring_attention_varlen_backward",
    "LAYOUTS",
]
