"""Context parallelism: attention over a sequence sharded across GPUs (ring attention over NCCL).

One process per GPU (``python -m cupyflash.distributed.launch --nproc 2 script.py``); each holds a shard of
q, k, v along the sequence axis, and the key/value shards travel around a ring. ``InProcessGroup`` runs the
same ring over threads of one process (NumPy or CuPy arrays). ``python -m cupyflash --docs distributed``
explains.
"""

from cupyflash.distributed._comm import Communicator, InProcessGroup, init
from cupyflash.distributed._layout import LAYOUTS, shard, unshard
from cupyflash.distributed._ring import ring_attention, ring_attention_backward, ring_attention_forward

__all__ = [
    "init",
    "Communicator",
    "InProcessGroup",
    "shard",
    "unshard",
    "ring_attention",
    "ring_attention_forward",
    "ring_attention_backward",
    "LAYOUTS",
]
