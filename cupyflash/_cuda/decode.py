"""The GPU back end of ``attention_with_kvcache``: a plan per layout (variant, grids, the split count, the
parameter words and the per-stream workspace), then one or two launches: the append/rotary step when there
is something to append or rotate, and the split decode, whose last split to finish merges the splits.

A plan is kept in the plan cache (plans.py) under everything but the arrays' addresses, so a serving loop's
repeated calls (every layer of every step has the same layout) only fill in the addresses and launch; a call
whose arguments have the layout of an earlier checked call finds its plan under its call key (call_key) and
skips the checks too. Workspaces belong to the plan and
the stream, never to a call: a call captured in a CUDA graph keeps pointing at memory that stays alive.
"""

from __future__ import annotations

import math
import threading

import numpy

from cupyflash._arrays import cupy, lse_dtype
from cupyflash._checks import MAX_SPLITS
from cupyflash._cuda import compile as _compile
from cupyflash._cuda import decode_tiles, plans, tile_policy
from cupyflash._cuda.decode_params import (
    ALIBI,
    BLOCK_TABLE,
    COS,
    K_CACHE,
    K_NEW,
    K_SCALE,
    LOG2E,
    LSE,
    OUT,
    PARAMS_BYTES,
    PARAMS_DTYPE,
    SEQLEN_ALL,
    SEQLENS,
    SIN,
    V_CACHE,
    V_NEW,
    V_SCALE,
    WORD,
    Q,
)
from cupyflash._cuda.source import MAX_GRID_Y
from cupyflash._kvcache.fp8 import FP8KVCache

MIN_TILES_PER_SPLIT = 1
FP8_ROW_STRIDE_LIMIT = 2**27  # bytes: attention_decode_fp8.cu's pass of up to 16 rows stays within an int
APPEND_E4M3_POSITIONS = 128  # kvcache_append.cu: positions per CTA of an e4m3 append that sets no scale
_PER_THREAD_STREAM = 2  # cudaStreamPerThread: CuPy's Stream.ptds
WAVES = 1.0  # waves of CTAs the split count aims for


def _elements(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _codes(cache):
    """A cache argument's element array: the array itself, or an FP8KVCache's codes."""
    return cache.data if isinstance(cache, FP8KVCache) else cache


def _scale_strides(holder) -> tuple[int, ...]:
    """An FP8KVCache's scale strides in elements, 0 along a dim of size 1 (kvcache.cuh, scale_at)."""
    return tuple(0 if n == 1 else s // 4 for n, s in zip(holder.scale.shape, holder.scale.strides))


def _aligned_rows(x, width: int) -> bool:
    """Rows of ``width`` elements that start on 16-byte boundaries and are whole 16-byte chunks."""
    return (
        x.data.ptr % 16 == 0
        and (width * x.itemsize) % 16 == 0
        and all(s % 16 == 0 for n, s in zip(x.shape[:3], x.strides[:3]) if n > 1)
    )


def split_count(batch: int, hk: int, row_tiles: int, capacity: int, variant, device_id: int) -> int:
    """Splits per sequence (at most): the fewest that give at least WAVES waves of CTAs, 90 % full on
    average over the waves (a wave is every SM running as many CTAs as fit), or else the count whose waves
    are fullest; never more than the longest sequence the cache can hold has tiles. Each sequence then takes
    as many of them as its own length fills (kvcache.cuh, split_plan)."""
    work = batch * hk * row_tiles
    slots = _compile.sm_count(device_id) * _ctas_per_sm(variant, device_id)
    limit = max(1, min(MAX_SPLITS, math.ceil(math.ceil(capacity / variant.block_n) / MIN_TILES_PER_SPLIT)))
    fill = {}
    for splits in range(1, limit + 1):
        waves = work * splits / slots
        fill[splits] = waves / math.ceil(waves)
        if waves >= 0.9 * WAVES and fill[splits] >= 0.9:
            return splits
    return max(fill, key=lambda s: (fill[s], -s))


def _ctas_per_sm(variant, device_id: int) -> int:
    """CTAs of the decode kernel that fit one SM at once: by shared memory, threads and registers."""
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    threads = variant.threads("decode")
    smem = variant.smem("decode") + 1024  # the runtime reserves 1 KiB per CTA
    by_smem = props["sharedMemPerMultiprocessor"] // smem
    by_threads = props["maxThreadsPerMultiProcessor"] // threads
    registers = -(-_compile.functions(variant)["decode"].num_regs // 8) * 8  # allocated in units of 8 per thread
    by_registers = props["regsPerMultiprocessor"] // (registers * threads)
    return max(1, min(by_smem, by_threads, by_registers))


class Plan:
    """Everything about a call but its arrays' addresses."""

    def __init__(self, call, vec_ok: bool):
        device = cupy.cuda.Device().id
        self.out_shape = (call.batch, call.hq, call.nq, call.dv)
        self.dtype = call.dtype
        self.acc = lse_dtype(call.dtype)
        # The largest int cache_seqlens this layout takes: the cache's room, and the rotary tables' positions.
        self.seqlen_limit = call.capacity - call.nnew
        if call.rotary_cos is not None:
            self.seqlen_limit = min(self.seqlen_limit, call.rotary_cos.shape[0] - call.rotary_span())
        packed = call.group * call.nq
        self.fp8 = call.fp8
        page_size = call.page_size if call.paged else None
        cache = "e4m3" if call.fp8 else None
        # The keys-as-rows kernel steps between a pass's rows by an int: row strides below 2^27 bytes either way.
        rows_ok = vec_ok and all(abs(_codes(x).strides[2]) < FP8_ROW_STRIDE_LIMIT for x in (call.k_cache, call.v_cache))
        self.variant = tile_policy.decode(call.dtype.name, call.d, call.dv, packed, page_size, cache, rows_ok)
        self.functions = _compile.functions(self.variant)
        # The launch's pieces, looked up once: a decode call's host time is a few microseconds.
        self._decode, self._append = self.functions["decode"], self.functions["append"]
        self._decode_block = (self.variant.threads("decode"),)
        self._append_block = (self.variant.threads("append"),)
        self._smem = self.variant.smem("decode")
        row_tiles = max(1, math.ceil(packed / self.variant.rows))
        self.max_splits = call.num_splits or split_count(
            call.batch, call.hk, row_tiles, call.capacity, self.variant, device
        )
        self.max_splits = min(self.max_splits, MAX_SPLITS)
        self.rotary = call.rotary_cos is not None
        self.append = call.nnew > 0 or self.rotary
        words = numpy.zeros(1, PARAMS_DTYPE)
        w = words[0]
        w["q_in_stride"] = _elements(call.q)[:3]
        w["q_stride"] = (call.hq * call.nq * call.d, call.nq * call.d, call.d) if self.rotary else _elements(call.q)[:3]
        w["k_stride"] = _elements(_codes(call.k_cache))[:3]
        w["v_stride"] = _elements(_codes(call.v_cache))[:3]
        spans = []  # e4m3: positions per CTA of the append, k's and v's
        if call.fp8:
            for part, holder in (("k", call.k_cache), ("v", call.v_cache)):
                sets = holder.scaling == "block"
                w[f"{part}_scale_stride"] = _scale_strides(holder)
                w[f"{part}_scale_block"] = holder.block
                w[f"{part}_scale_set"] = sets
                spans.append(holder.block if sets else APPEND_E4M3_POSITIONS)
        if call.k is not None:
            w["k_new_stride"] = _elements(call.k)[:3]
            w["v_new_stride"] = _elements(call.v)[:3]
        w["out_stride"] = (call.hq * call.nq * call.dv, call.nq * call.dv, call.dv)
        if call.paged:
            w["block_table_stride"] = _elements(call.block_table)[0]
        if call.alibi_slopes is not None:
            w["alibi_stride"] = _elements(call.alibi_slopes)
        # A window wider than any sequence hides nothing: clamped, its edges stay in int32 in the kernels.
        reach = call.capacity + call.nq
        left, right = (min(edge, reach) for edge in call.window_with_causal())
        for name, value in dict(
            batch=call.batch,
            hq=call.hq,
            hk=call.hk,
            group=call.group,
            nq=call.nq,
            nnew=call.nnew,
            d=call.d,
            dv=call.dv,
            page_size=call.page_size,
            num_pages=call.k_cache.shape[0],
            capacity=call.capacity,
            paged=call.paged,
            rotary_half=call.rotary_dim // 2,
            max_pos=call.rotary_cos.shape[0] if self.rotary else 0,
            rotary_interleaved=call.rotary_interleaved,
            rotary_q_advance=call.rotary_query_positions_advance(),
            window_left=left,
            window_right=right,
            softcap_on=call.softcap > 0,
            alibi_on=call.alibi_slopes is not None,
            vec_ok=vec_ok,
            max_splits=self.max_splits,
            min_tiles_per_split=MIN_TILES_PER_SPLIT,
            row_tiles=row_tiles,
        ).items():
            w[name] = int(value)
        # The real numbers as the dense parameters carry them (params.py), each in float32 and float64.
        softcap_inv = 1.0 / call.softcap if call.softcap > 0 else 0.0
        reals = {
            "scale": call.scale,
            "scale_log2": call.scale * LOG2E,
            "softcap": call.softcap,
            "softcap_inv": softcap_inv,
        }
        for name, value in reals.items():
            w[name] = w[name + "_f64"] = value
        # Kept as plain words: copying a structured array costs microseconds a call, a plain one a fraction.
        self.words = words.view(numpy.uint64).copy()
        self.decode_grid = (self.max_splits, call.hk * row_tiles, call.batch)
        if self.decode_grid[1] > MAX_GRID_Y or self.decode_grid[2] > MAX_GRID_Y:
            raise ValueError(
                f"attention_with_kvcache takes at most {MAX_GRID_Y} sequences (B = {call.batch}) and "
                f"{MAX_GRID_Y} tiles of {self.variant.rows} packed query rows per sequence (Hk * "
                f"ceil(G * Nq / {self.variant.rows}) = {self.decode_grid[1]}); split the call"
            )
        parts = (2 if call.nnew else 0) + (1 if self.rotary else 0)
        if call.fp8:  # kvcache_append_e4m3: x = blocks of positions an append touches, z = (b, hk)
            blocks = max(1, max(math.ceil(max(call.nnew - 1, 0) / span) + 1 for span in spans))
            self.append_grid = (blocks, parts, call.batch * call.hk)
            if self.append and call.batch * call.hk > MAX_GRID_Y:
                raise ValueError(
                    f"attention_with_kvcache's append and rotary step for FP8 caches takes at most {MAX_GRID_Y} "
                    f"sequences x key/value heads (B * Hk = {call.batch * call.hk}); split the call"
                )
        else:
            units = max(
                call.batch * call.hk * call.nnew * max(call.d, call.dv), call.batch * call.hq * call.nq * call.d
            )
            blocks = min(math.ceil(units / decode_tiles.APPEND_THREADS), 8 * _compile.sm_count(device))
            self.append_grid = (max(1, blocks), parts, 1)
        self.workspace_shapes = dict(
            out_part=((self.max_splits, call.batch * call.hq * call.nq, call.dv) if self.max_splits > 1 else None),
            lse_part=((self.max_splits, call.batch * call.hq * call.nq) if self.max_splits > 1 else None),
            q_rot=((call.batch, call.hq, call.nq, call.d) if self.rotary else None),
            split_counters=((call.batch * call.hk * row_tiles,) if self.max_splits > 1 else None),
        )
        self._workspaces: dict = {}  # stream (and thread, for the per-thread default stream) -> workspace
        self.pinned = False  # ran inside a CUDA-graph capture (workspace)

    def workspace(self) -> tuple[dict, numpy.ndarray]:
        """This plan's scratch arrays on the current stream (made on its first call there), and the
        parameter words with their addresses filled in. A plan that runs inside a CUDA-graph capture is
        pinned: its workspace must live as long as the graph, so the plan cache never evicts it. (Only a created
        stream can capture, so the default streams skip the test.)"""
        current = cupy.cuda.get_current_stream()
        stream = current.ptr
        capturing = stream not in (0, _PER_THREAD_STREAM) and current.is_capturing()
        if stream == _PER_THREAD_STREAM:  # one pointer, but each thread's own stream
            stream = (stream, threading.get_ident())
        found = self._workspaces.get(stream)
        if capturing:
            self.pinned = True
        if found is None:
            if capturing:
                raise RuntimeError(
                    "attention_with_kvcache: call once on this stream with this layout before "
                    "capturing it in a CUDA graph (the first call allocates the workspace)"
                )
            arrays = {}
            for name, shape in self.workspace_shapes.items():
                if name == "split_counters" and shape is not None:  # zero between calls: the kernel resets them
                    arrays[name] = cupy.zeros(shape, dtype=numpy.int32)
                elif shape is not None:
                    arrays[name] = cupy.empty(shape, dtype=self.dtype if name == "q_rot" else self.acc)
            words = self.words.copy()
            for name, array in arrays.items():
                words[WORD[name]] = array.data.ptr
            found = self._workspaces[stream] = (arrays, words)
        return found

    def run(
        self,
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        block_table,
        cos,
        sin,
        alibi_slopes,
        want_lse: bool = True,
        append_only: bool = False,
    ):
        """Launch on these arrays (of this plan's layout; cache_seqlens an int32 array or one int); returns
        out and lse (None unless want_lse), or nothing with append_only."""
        out = None if append_only else cupy.empty(self.out_shape, dtype=self.dtype)
        lse = cupy.empty(self.out_shape[:3], dtype=self.acc) if want_lse and not append_only else None
        scratch, template = self.workspace()
        u64 = template.copy()
        if self.fp8:  # FP8KVCache holders: codes and descales
            u64[K_SCALE], u64[V_SCALE] = k_cache.scale.data.ptr, v_cache.scale.data.ptr
            k_cache, v_cache = k_cache.data, v_cache.data
        u64[Q], u64[K_CACHE], u64[V_CACHE] = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr
        for word, array in (
            (K_NEW, k),
            (V_NEW, v),
            (OUT, out),
            (LSE, lse),
            (BLOCK_TABLE, block_table),
            (COS, cos),
            (SIN, sin),
            (ALIBI, alibi_slopes),
        ):
            if array is not None:
                u64[word] = array.data.ptr
        if type(cache_seqlens) is int:
            u64.view(numpy.int32)[SEQLEN_ALL] = cache_seqlens
        else:
            u64[SEQLENS] = cache_seqlens.data.ptr
        if self.append:  # kvcache_append reads the caller's q (its q_rot word holds the rotated copy)
            self._append(self.append_grid, self._append_block, (u64.view(PARAMS_BYTES),))
        if append_only:
            return None
        if self.rotary:
            u64[Q] = scratch["q_rot"].data.ptr
        self._decode(self.decode_grid, self._decode_block, (u64.view(PARAMS_BYTES),), shared_mem=self._smem)
        return out, lse


def plan_for(call) -> Plan:
    """The plan of a checked call's layout, from the plan cache (made on its first call)."""
    vec_ok = _aligned_rows(_codes(call.k_cache), call.d) and _aligned_rows(_codes(call.v_cache), call.dv)
    (k_arrays, k_layout), (v_arrays, v_layout) = cache_layout(call.k_cache), cache_layout(call.v_cache)
    key = plans.key(
        "plan",
        "decode",
        (call.q, *k_arrays, *v_arrays, call.k, call.v, call.block_table, call.rotary_cos, call.alibi_slopes),
        (call.rotary_interleaved, call.causal, call.scale, call.window, call.softcap, call.num_splits, vec_ok)
        + k_layout
        + v_layout,
    )
    return plans.get_or_make(key, lambda: Plan(call, vec_ok))


def cache_layout(cache) -> tuple[tuple, tuple]:
    """A cache argument's arrays and the options a key adds for it: an array alone, or an FP8KVCache's codes and
    scales with its scaling and block (which the shapes alone do not tell)."""
    if isinstance(cache, FP8KVCache):
        return (cache.data, cache.scale), (cache.scaling, cache.block)
    return (cache, None), (None, None)


def call_key(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    block_table,
    rotary_cos,
    rotary_sin,
    rotary_interleaved,
    causal,
    scale,
    window,
    softcap,
    alibi_slopes,
    num_splits,
    return_lse,
):
    """The plan cache's call key of these arguments as the caller passed them (plans.py): everything the
    checks and the plan depend on but the addresses and an int cache_seqlens' value; None where a call cannot
    take the fast path (NumPy arrays, index sequences)."""
    given_int = type(cache_seqlens) is int
    (k_arrays, k_layout), (v_arrays, v_layout) = cache_layout(k_cache), cache_layout(v_cache)
    return plans.key(
        "call",
        "decode",
        (
            q,
            *k_arrays,
            *v_arrays,
            k,
            v,
            None if given_int else cache_seqlens,
            block_table,
            rotary_cos,
            rotary_sin,
            alibi_slopes,
        ),
        (given_int, rotary_interleaved, causal, scale, window, softcap, num_splits, return_lse) + k_layout + v_layout,
    )


def keep_call(key, call, q, k, v, block_table, rotary_cos, rotary_sin, alibi_slopes, cache_seqlens) -> None:
    """Let later calls with this call key skip the checks, where the checked call launched on the caller's
    own arrays (no cast or copy of rotary tables, slopes or lengths that the fast path would have to redo)."""
    if key is None:
        return
    if rotary_cos is not None and (call.rotary_cos is not rotary_cos or call.rotary_sin is not rotary_sin):
        return
    if alibi_slopes is not None and alibi_slopes.dtype != numpy.float32:
        return
    if call.q is not q or call.k is not k or call.v is not v:  # copied to a unit last stride
        return
    if type(cache_seqlens) is not int and call.cache_seqlens is not cache_seqlens:  # cast or copied
        return
    if call.block_table is not block_table:  # copied to contiguous columns
        return
    plans.put(key, plan_for(call))


def run_call(
    plan: Plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes, return_lse
):
    """(out, lse) of a call found under its call key, or None where an int cache_seqlens is out of range (the
    checked path raises the error)."""
    if type(cache_seqlens) is int and not 0 <= cache_seqlens <= plan.seqlen_limit:
        return None
    return plan.run(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin, alibi_slopes, want_lse=return_lse
    )


def _seqlens(call):
    return call.seqlen_all if call.cache_seqlens is None else call.cache_seqlens


def attention_with_kvcache(call):
    """out (B, Hq, Nq, Dv) in the inputs' dtype and lse (B, Hq, Nq) in the accumulator dtype (None unless
    call.return_lse)."""
    plan = plan_for(call)
    return plan.run(
        call.q,
        call.k_cache,
        call.v_cache,
        call.k,
        call.v,
        _seqlens(call),
        call.block_table,
        call.rotary_cos,
        call.rotary_sin,
        call.alibi_slopes,
        want_lse=call.return_lse,
    )


def append(call) -> None:
    """Only the append (and nothing to attend: Nq == 0)."""
    plan_for(call).run(
        call.q,
        call.k_cache,
        call.v_cache,
        call.k,
        call.v,
        _seqlens(call),
        call.block_table,
        call.rotary_cos,
        call.rotary_sin,
        call.alibi_slopes,
        append_only=True,
    )
