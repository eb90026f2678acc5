"""The host's mirror of the decode kernels' parameter struct ``KVCacheParams`` (cuda_src/kvcache.cuh): its
dtype, the bytes a launch passes, and the word of each address a call fills in.
"""

from __future__ import annotations

import numpy

LOG2E = 1.4426950408889634
POINTERS = (
    "q",
    "k_cache",
    "v_cache",
    "k_new",
    "v_new",
    "out",
    "lse",
    "out_part",
    "lse_part",
    "cache_seqlens",
    "block_table",
    "rotary_cos",
    "rotary_sin",
    "alibi_slopes",
    "q_rot",
    "split_counters",
    "k_scale",
    "v_scale",
)
# Host mirror of `struct KVCacheParams` (cuda_src/kvcache.cuh): same field order, C alignment.
PARAMS_DTYPE = numpy.dtype(
    [(name, numpy.uint64) for name in POINTERS]
    + [
        (name, numpy.int64, (3,))
        for name in (
            "q_stride",
            "q_in_stride",
            "k_stride",
            "v_stride",
            "k_new_stride",
            "v_new_stride",
            "out_stride",
            "k_scale_stride",
            "v_scale_stride",
        )
    ]
    + [("block_table_stride", numpy.int64), ("alibi_stride", numpy.int64, (2,))]
    + [
        (name, numpy.int32)
        for name in (
            "batch",
            "hq",
            "hk",
            "group",
            "nq",
            "nnew",
            "d",
            "dv",
            "page_size",
            "num_pages",
            "capacity",
            "paged",
            "rotary_half",
            "max_pos",
            "rotary_interleaved",
            "rotary_q_advance",
            "window_left",
            "window_right",
            "softcap_on",
            "alibi_on",
            "vec_ok",
            "max_splits",
            "min_tiles_per_split",
            "row_tiles",
            "seqlen_all",
            "k_scale_block",
            "v_scale_block",
            "k_scale_set",
            "v_scale_set",
        )
    ]
    + [(name, numpy.float32) for name in ("scale", "scale_log2", "softcap", "softcap_inv")]
    + [(name, numpy.float64) for name in ("scale_f64", "scale_log2_f64", "softcap_f64", "softcap_inv_f64")],
    align=True,
)
PARAMS_BYTES = numpy.dtype((numpy.void, PARAMS_DTYPE.itemsize))
WORD = {name: PARAMS_DTYPE.fields[name][1] // 8 for name in POINTERS}  # each pointer's uint64 word
SEQLEN_ALL = PARAMS_DTYPE.fields["seqlen_all"][1] // 4  # its int32 word
(Q, K_CACHE, V_CACHE, K_NEW, V_NEW, OUT, LSE, SEQLENS, BLOCK_TABLE, COS, SIN, ALIBI, K_SCALE, V_SCALE) = (
    WORD[name]
    for name in (
        "q",
        "k_cache",
        "v_cache",
        "k_new",
        "v_new",
        "out",
        "lse",
        "cache_seqlens",
        "block_table",
        "rotary_cos",
        "rotary_sin",
        "alibi_slopes",
        "k_scale",
        "v_scale",
    )
)
