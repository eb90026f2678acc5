"""The decode kernels' variants: one table of tile shapes per (element bytes, HEAD, packed rows), the
``DecodeVariant`` that names, sizes and compiles one of them (the interface of ``variants.Variant`` that
compile.py and ptxas_report.py read), and the choice of a variant for a call.

A variant's module holds two kernels: ``decode`` (cuda_src/attention_decode.cu, attention_decode, which
merges its own splits; for e4m3 caches and at most 8 packed query rows, cuda_src/attention_decode_fp8.cu, whose
products take the keys as their rows) and the append/rotary step ``append`` (cuda_src/kvcache_append.cu;
kvcache_append_e4m3 for e4m3 caches). HEAD is the head dim the tiles are built for, at least max(D, Dv): columns
past D and Dv are zero-filled in shared memory and never read from global memory. A variant's ``dtype`` is q's (and
out's); its ``cache`` is "e4m3" for FP8 caches (cupyflash._kvcache.fp8), read as 1-byte codes and widened to
float16 (in shared memory by the tiled kernel, in registers by the keys-as-rows one), else None (the cache has q's
dtype).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cupyflash._checks import MAX_SPLITS
from cupyflash._cuda.source import OPTIONS, module_code, source_dir
from cupyflash._cuda.tiles import SM80_SMEM_BYTES
from cupyflash._cuda.variants import CTYPES, ITEMSIZES

HEADS = (32, 64, 128, 256)
SOURCE = "attention_decode.cu"
FP8_SOURCE = "attention_decode_fp8.cu"
APPEND_SOURCE = "kvcache_append.cu"
APPEND_THREADS = 256

# (cache element bytes, HEAD, rows per CTA) -> (WARPS_M, WARPS_N, WARPS_DV, BLOCK_N, STAGES, MIN_CTAS). STAGES = 1 is
# one buffer each for k and v whose copies interleave with the products (v of a tile lands while its scores
# are computed, k of the next while P v is): half the shared memory of two stages, and the faster shape for bf16
# D = 64 (its measurement: docs/design/decode.md). 16-bit D = 128 and 256 run two CTAs per SM, which keeps twice
# the bytes in flight, the faster shape for them (docs/design/decode.md, Loads).
# Rows are packed query rows (G query heads x Nq queries of one key/value head). 16 rows: four warps split
# each tile's keys (a decode step's few rows would leave three of four m16 tiles empty); 64 rows: four row
# blocks (speculative decoding, chunks). WARPS_DV > 1 splits v's columns where the accumulators of a whole
# row would not fit the registers. MIN_CTAS: the CTAs per SM the kernel's registers are budgeted for
# (__launch_bounds__), which split_count then fills. Tiles and stages keep every module inside an sm_80 CTA's
# shared memory.
# e4m3 caches (1 byte): a stage holds half a 16-bit one's bytes, and the widened k and v tiles take one 16-bit
# stage more; at D = 128 three stages (two tiles in flight of 16 KB each) at two CTAs per SM keep as many bytes in
# flight as the 16-bit tile's two stages (one 32 KB tile ahead); D = 256 takes 32-key tiles to stay at two CTAs.
TABLE = {
    (1, 32, 16): (1, 4, 1, 64, 4, 2),
    (1, 64, 16): (1, 4, 1, 64, 4, 2),
    (1, 128, 16): (1, 4, 2, 64, 3, 2),
    (1, 256, 16): (1, 2, 2, 32, 3, 2),
    (1, 32, 64): (4, 1, 1, 64, 3, 1),
    (1, 64, 64): (4, 1, 1, 64, 3, 1),
    (1, 128, 64): (4, 1, 1, 64, 2, 1),
    (1, 256, 64): (4, 1, 2, 32, 2, 1),
    (2, 32, 16): (1, 4, 1, 64, 4, 1),
    (2, 64, 16): (1, 4, 2, 128, 1, 1),
    (2, 128, 16): (1, 4, 2, 64, 2, 2),
    (2, 256, 16): (1, 4, 2, 64, 1, 2),
    (2, 32, 64): (4, 1, 1, 64, 3, 1),
    (2, 64, 64): (4, 1, 1, 64, 3, 1),
    (2, 128, 64): (4, 1, 1, 64, 2, 1),
    (2, 256, 64): (4, 1, 2, 32, 2, 1),
    (4, 32, 16): (1, 4, 1, 64, 3, 1),
    (4, 64, 16): (1, 4, 1, 64, 3, 1),
    (4, 128, 16): (1, 4, 1, 64, 2, 1),
    (4, 256, 16): (1, 2, 2, 32, 2, 1),
    (4, 32, 64): (4, 1, 1, 64, 2, 1),
    (4, 64, 64): (4, 1, 1, 32, 2, 1),
    (4, 128, 64): (4, 1, 1, 32, 2, 1),
    (4, 256, 64): (4, 1, 2, 16, 2, 1),
    (8, 32, 16): (1, 4, 1, 64, 2, 1),
    (8, 64, 16): (1, 4, 1, 64, 2, 1),
    (8, 128, 16): (1, 2, 2, 32, 2, 1),
    (8, 256, 16): (1, 1, 4, 16, 2, 1),
    (8, 32, 64): (4, 1, 1, 32, 2, 1),
    (8, 64, 64): (4, 1, 2, 32, 2, 1),
    (8, 128, 64): (4, 1, 2, 16, 2, 1),
}
# attention_decode_fp8.cu (e4m3 caches, at most FP8_ROWS packed query rows, the keys as the products' rows): HEAD ->
# (STAGES, MIN_CTAS). 4 warps of 16 keys per 64-key tile, each warp with a ring of its own; a stage per warp is 16
# rows of k and of v codes. At D = 128, two stages at four CTAs per SM (registers for 128 per thread: at five ptxas
# keeps to 96 and recomputes the copies' addresses every tile) beat (2, 5) by 1-4% and (3, 4) by 3-5%
# (docs/design/fp8_kvcache.md). The other head dims keep about the same shared memory per SM.
FP8_ROWS = 8
FP8_KEYS_AS_ROWS = {32: (4, 6), 64: (4, 5), 128: (2, 4), 256: (3, 2)}
FP8_PAGE_MULTIPLE = 16  # a warp's 16 keys never straddle pages of a multiple of 16 positions
# Paged caches whose pages are not a multiple of BLOCK_N positions: their tiles' rows are looked up and
# addressed one by one, and a ring of more threads issues those copies faster than the interleaved tile
# (docs/design/decode.md).
TABLE_ROWWISE = {(2, 64, 16): (1, 8, 1, 128, 2, 1), (2, 128, 16): (1, 8, 2, 128, 2, 1)}
DTYPES_BY_BYTES = {2: ("float16", "bfloat16"), 4: ("float32",), 8: ("float64",)}
CACHES = ("e4m3",)  # cache element formats other than q's dtype
E4M3_DTYPES = ("float16", "bfloat16")  # q's dtypes with e4m3 caches: the products run in 16 bits
CACHE_ITEMSIZES = {"e4m3": 1}
CACHE_CTYPES = {"e4m3": "e4m3_t"}
APPEND_KERNELS = {None: "kvcache_append", "e4m3": "kvcache_append_e4m3"}


def _padded_row(itemsize: int, cols: int) -> int:
    """Bytes of one padded shared-memory row (copy.cuh, PaddedTile: 16 bytes more, 32 for float64)."""
    return cols * itemsize + (32 if itemsize == 8 else 16)


@dataclass(frozen=True)
class DecodeVariant:
    dtype: str
    head_dim: int  # HEAD
    rows: int  # packed query rows per CTA: 16 or 64
    rowwise: bool = False  # TABLE_ROWWISE's tile: paged caches whose pages do not hold whole tiles
    cache: str | None = None  # "e4m3": FP8 caches (codes and descales); None: the cache has q's dtype
    keys_as_rows: bool = False  # attention_decode_fp8.cu (rows = FP8_ROWS): the products' rows are keys

    direction = "decode"
    path = "decode"
    kernels = ("decode", "append")
    modules = (("decode", "append"),)
    sources = modules  # the kernels grouped by the source they compile from (``code``): the one module

    @property
    def itemsize(self) -> int:
        """Bytes of one cache element (the table's key)."""
        return CACHE_ITEMSIZES[self.cache] if self.cache else ITEMSIZES[self.dtype]

    @property
    def q_itemsize(self) -> int:
        return ITEMSIZES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(WARPS_M, WARPS_N, WARPS_DV, BLOCK_N, STAGES, MIN_CTAS); keys as rows: 4 warps along the keys, 16 each."""
        if self.keys_as_rows:
            return (1, 4, 1, 64, *FP8_KEYS_AS_ROWS[self.head_dim])
        key = (self.itemsize, self.head_dim, self.rows)
        return TABLE_ROWWISE[key] if self.rowwise else TABLE[key]

    @property
    def block_n(self) -> int:
        return self.shape[3]

    def threads(self, kernel: str) -> int:
        if kernel == "append":
            return APPEND_THREADS
        warps_m, warps_n, warps_dv, *_ = self.shape
        return 32 * warps_m * warps_n * warps_dv

    def smem(self, kernel: str) -> int:
        """Dynamic shared memory (attention_decode.cu, DecodeTraits::SMEM), bytes."""
        if kernel != "decode":
            return 0
        warps_m, warps_n, _, block_n, stages, _ = self.shape
        if self.keys_as_rows:  # attention_decode_fp8.cu, Fp8DecodeTraits::SMEM
            ring = stages * 2 * block_n * (self.head_dim + 16)
            merge = max(self.rows * (self.head_dim + 1) * 4, self.rows * MAX_SPLITS * 4)
            return max(ring, merge) + 3 * warps_n * self.rows * 4
        acc = 8 if self.q_itemsize == 8 else 4
        q = self.rows * _padded_row(self.q_itemsize, self.head_dim)
        stage = 2 * block_n * _padded_row(self.itemsize, self.head_dim)
        if self.cache:  # each key's two descales; the widened k and v tiles
            stage += 2 * block_n * 4
        ring = stages * stage + (2 * block_n * _padded_row(self.q_itemsize, self.head_dim) if self.cache else 0)
        merged = self.rows * (self.head_dim + 1) * acc
        weights = self.rows * MAX_SPLITS * acc
        states = max(3 * warps_n * self.rows * acc, 2 * block_n * 8)  # row states, or the row lookups
        return q + max(ring, merged, weights) + states

    def name_expression(self, kernel: str) -> str:
        c = CTYPES[self.dtype]
        if kernel == "append":
            return f"{APPEND_KERNELS[self.cache]}<{c}>"
        warps_m, warps_n, warps_dv, block_n, stages, min_ctas = self.shape
        if self.keys_as_rows:
            return f"attention_decode_fp8<{c}, {self.head_dim}, {stages}, {min_ctas}>"
        cached = CACHE_CTYPES[self.cache] if self.cache else c
        return (
            f"attention_decode<{c}, {cached}, {self.head_dim}, {warps_m}, {warps_n}, {warps_dv}, {block_n}, {stages}, "
            f"{min_ctas}>"
        )

    def code(self, kernels: tuple[str, ...] | None = None) -> str:
        names = [self.name_expression(k) for k in (kernels or self.kernels)]
        # Both sources share kvcache.cuh and the element helpers: one module, each header pasted once.
        return module_code(FP8_SOURCE if self.keys_as_rows else SOURCE, names) + "\n" + _append_source()

    @property
    def options(self) -> tuple[str, ...]:
        return OPTIONS

    def compile_targets(self) -> dict[str, str]:
        return {"sm_80": "sm_80", "sm_90": "sm_90"}

    def __str__(self) -> str:
        return (
            f"decode {self.dtype} HEAD_DIM={self.head_dim} rows={self.rows}"
            + (" rowwise" if self.rowwise else "")
            + (" keys-as-rows" if self.keys_as_rows else "")
            + (f" cache={self.cache}" if self.cache else "")
        )


@functools.lru_cache(maxsize=None)
def _append_source() -> str:
    """kvcache_append.cu without the headers attention_decode.cu already brought."""
    text = (source_dir() / APPEND_SOURCE).read_text()
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#include"))


def shipped_variants() -> list[DecodeVariant]:
    return (
        [
            DecodeVariant(dtype, head, rows)
            for (itemsize, head, rows) in TABLE
            for dtype in DTYPES_BY_BYTES.get(itemsize, ())
        ]
        + [
            DecodeVariant(dtype, head, rows, cache=cache)
            for cache in CACHES
            for (itemsize, head, rows) in TABLE
            if itemsize == CACHE_ITEMSIZES[cache]
            for dtype in E4M3_DTYPES
        ]
        + [
            DecodeVariant(dtype, head, rows, rowwise=True)
            for (itemsize, head, rows) in TABLE_ROWWISE
            for dtype in DTYPES_BY_BYTES[itemsize]
        ]
        + [
            DecodeVariant(dtype, head, FP8_ROWS, cache="e4m3", keys_as_rows=True)
            for head in FP8_KEYS_AS_ROWS
            for dtype in E4M3_DTYPES
        ]
    )


def variants_for(arch: str) -> list[DecodeVariant]:
    """The decode variants built for architecture family ``arch`` ("sm_80" or "sm_90"): all of them."""
    return [v for v in shipped_variants() if arch in v.compile_targets()]


def variants_for_call(dtype: str, width: int, cache: str | None = None) -> list[DecodeVariant]:
    """Every variant ``tile_policy.decode`` may pick for calls of this dtype (and cache format) with max(D, Dv) =
    ``width``: 16- and 64-row tiles, the row-wise tile for small pages where the table has one, and for e4m3
    caches the keys-as-rows kernel."""
    head = head_bucket(width, width)
    if cache:
        return [DecodeVariant(dtype, head, rows, cache=cache) for rows in (16, 64)] + [
            DecodeVariant(dtype, head, FP8_ROWS, cache=cache, keys_as_rows=True)
        ]
    itemsize = ITEMSIZES[dtype]
    return [DecodeVariant(dtype, head, rows) for rows in (16, 64) if (itemsize, head, rows) in TABLE] + [
        DecodeVariant(dtype, head, rows, rowwise=True) for rows in (16, 64) if (itemsize, head, rows) in TABLE_ROWWISE
    ]


def head_bucket(d: int, dv: int) -> int:
    width = max(d, dv)
    return next(h for h in HEADS if h >= width)


STATIC_SMEM_BYTES = 64  # the kernel's own __shared__ variables (the merge's arrival count), with room to spare
assert all(v.smem("decode") + STATIC_SMEM_BYTES <= SM80_SMEM_BYTES for v in shipped_variants())
