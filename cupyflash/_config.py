"""The one table of kernel variants: tile shapes per (path, element size, head dim, kernel).

Every kernel is a template over (dtype, HEAD_DIM, tiles, IS_CAUSAL, MODS, WGMMA, HAS_DROPOUT), MODS being
Mods::none, ::scalars (window, softcap, ALiBi; the backward's block mask), ::softcap (the backward of a softcap
alone), ::window (a window alone; both with the scalars' tiles but where the window has its own) or ::all (also bias, mask, block mask); the score
modifiers' kernels use the same tiles as the plain ones unless noted. A problem's head dims D and Dv are padded up to
the smallest HEAD_DIM in ``HEAD_DIMS`` that holds both (the padding is zero-filled inside the kernel,
never read from memory). fp16 and bf16 share tiles; float32 needs twice the shared memory per element
and gets smaller ones, float64 (FP64 tensor cores, float64 accumulators) twice that again. The float64
backward at HEAD_DIM 256 needs about 200 KiB of shared memory per block: Hopper's 227 KiB hold it, an
sm_80 CTA's 163 KiB do not (that call then raises, naming both numbers).

Two tensor-core paths:
  mma.sync (``_TABLE``): every GPU from sm_80 on; warp-level products, padded shared tiles.
  wgmma (``_WGMMA_TABLE``): Hopper (compute capability 9.0 exactly, compiled for sm_90a), fp16/bf16;
        warpgroup-level products from swizzled shared tiles, so NUM_WARPS is a multiple of 4 and every
        D_CHUNK a whole number of swizzle atoms (64 columns; 32 at HEAD_DIM 96 and 160, 16 at 16).

Each entry was chosen so that (a) no variant spills registers (checked for sm_80 and sm_90 by
tests/test_compile.py with the CUDA 12 NVRTC; the wgmma entries also with CUDA 13.0's ptxas, which the
CUDA 13 CuPy uses and which needs more registers for some of them: bench/check_wgmma_ptxas.py) and (b) shared
memory stays within the 163 KiB an sm_80 CTA can have (227 KiB on sm_90: the wgmma tiles, the float64
``_LARGE_SMEM_TABLE`` and the ``_LARGE_SMEM_ONLY`` variants, all built for sm_90 alone). Tile names:
  fwd:  NUM_WARPS (16 query rows each: BLOCK_M = 16 * NUM_WARPS), BLOCK_N keys per streamed tile,
        D_CHUNK output columns per CTA.
  dkdv: NUM_WARPS (16 keys each), BLOCK_M queries per streamed tile, D_CHUNK gradient columns per CTA.
  dq:   NUM_WARPS (16 queries each), BLOCK_N keys per streamed tile, D_CHUNK gradient columns per CTA.
  ctas_per_sm (wgmma forward; 1 unless listed): the resident CTAs per SM its launch bounds ask for.
"""
from __future__ import annotations

from dataclasses import dataclass

PREPROCESS_WARPS = 8  # warps per CTA of the backward preprocess (delta = rowsum(dout * out))
SMEM_PAD_BYTES = {2: 16, 4: 16, 8: 32}  # per shared-memory row of a padded tile, by element size; cuda_src/common.cuh
SMEM_ALIGN = 1024  # wgmma kernels align their swizzled tiles to this (cuda_src/copy.cuh, smem_aligned)
# The most rows one launch of a backward pass sums a gradient over (queries for dK/dV, keys for dQ). The
# tensor cores' float32 accumulation truncates, ~2e-8 relative per 16-row step: 1.5e-4 over 2^17 rows,
# below the rounding of a float16 result, but percents over millions. Longer sequences run the pass in
# chunks of CHAIN_ROWS rows whose results are summed in float32 (_kernels.attention_backward).
CHAIN_ROWS = 131072


@dataclass(frozen=True)
class Tiles:
    num_warps: int
    block: int  # the streamed tile: BLOCK_N keys (fwd, dq) or BLOCK_M queries (dkdv)
    d_chunk: int  # output (fwd) or gradient (dkdv, dq) columns per CTA
    split: bool = False  # dkdv, dq: pairs of warps share 16 rows, dividing the work (attention_bwd.cu)
    # The CTAs per SM the kernel is compiled for (its launch bounds' minimum): ptxas then keeps the
    # registers within 65536 / (threads * ctas_per_sm). 1: no bound beyond the 255 registers of a thread.
    ctas_per_sm: int = 1
    copy_warps: int = 0  # warps that only copy and own no rows (the warp-specialized forward's first warpgroup)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows(self) -> int:
        """Rows owned by the CTA: 16 per computing warp (per pair of warps when split)."""
        return (8 if self.split else 16) * (self.num_warps - self.copy_warps)


# (element bytes, HEAD_DIM): fwd (warps, BLOCK_N, D_CHUNK), dkdv (warps, BLOCK_M, D_CHUNK[, split]), dq (warps,
# BLOCK_N, D_CHUNK). A split dkdv entry (plain and causal only) gives each 16 keys a pair of warps, one
# accumulating dV and one dK (each over D_CHUNK columns), where an unsplit one holds both and needs twice
# the chunks, each recomputing S and dP; the modifiers' and dropout instantiations take _UNSPLIT's.
_TABLE = {
    (2, 16): ((4, 128, 16), (4, 64, 16), (4, 64, 16)),
    (2, 32): ((4, 128, 32), (4, 64, 32), (4, 64, 32)),
    (2, 64): ((4, 128, 64), (4, 64, 64), (4, 64, 64)),
    (2, 96): ((4, 64, 96), (4, 32, 96), (4, 32, 96)),
    (2, 128): ((4, 128, 128), (4, 32, 128), (4, 32, 128)),
    (2, 160): ((8, 64, 160), (8, 32, 160, True), (4, 32, 80)),
    (2, 192): ((8, 64, 192), (8, 32, 192, True), (4, 32, 96)),
    (2, 256): ((4, 64, 256), (8, 32, 256, True), (4, 32, 128)),
    (4, 16): ((4, 64, 16), (4, 32, 16), (4, 32, 16)),
    (4, 32): ((4, 64, 32), (4, 32, 32), (4, 32, 32)),
    (4, 64): ((4, 64, 64), (8, 32, 64, True), (4, 32, 64)),
    (4, 96): ((4, 32, 96), (4, 16, 48), (4, 16, 96)),
    (4, 128): ((4, 32, 128), (8, 16, 128, True), (4, 16, 128)),
    (4, 160): ((4, 16, 160), (2, 16, 32), (2, 16, 80)),
    (4, 192): ((4, 16, 192), (2, 16, 48), (2, 16, 96)),
    (4, 256): ((4, 16, 128), (2, 16, 32), (2, 16, 128)),
    # float64: twice float32's bytes and registers per element; padded rows of HEAD_DIM + 4 elements.
    (8, 16): ((4, 64, 16), (4, 32, 16), (4, 32, 16)),
    (8, 32): ((4, 64, 32), (4, 32, 32), (4, 32, 32)),
    (8, 64): ((8, 64, 64), (4, 16, 64), (4, 32, 64)),
    (8, 96): ((8, 32, 96), (8, 16, 96, True), (4, 16, 96)),
    (8, 128): ((4, 32, 128), (4, 16, 128, True), (2, 16, 128)),
    (8, 160): ((4, 16, 80), (2, 16, 160, True), (1, 16, 80)),
    (8, 192): ((4, 16, 96), (2, 16, 96, True), (1, 16, 96)),
    (8, 256): ((2, 16, 128), (2, 16, 128, True), (1, 16, 128)),
}
# The score modifiers' kernels hold a few more registers per score (bounds, bias, softcap derivative); where
# the plain tiles would spill there, they get these instead. (They also serve variable-length batches; the
# sequence lengths they then read from cu_seqlens sit in shared memory, not in registers: block_info.cuh.)
_MODS_TABLE = {
    (2, 64, "dkdv"): (4, 32, 64),
    (2, 256, "fwd"): (4, 32, 256),
    (4, 192, "fwd"): (4, 16, 96),
    (2, 256, "dkdv"): (4, 16, 128),
    (8, 64, "fwd"): (8, 32, 64),
    (8, 128, "fwd"): (4, 32, 64),
    (8, 128, "dkdv"): (2, 16, 32),
    (8, 256, "dkdv"): (1, 16, 32),
}
# float64 tiles that need more shared memory than an sm_80 CTA has (up to 227 KiB: Hopper, compute capability
# 9.0 and up), so twice the warps; (element bytes, HEAD_DIM) -> same fields as _TABLE, and the modifiers'.
_LARGE_SMEM_TABLE = {
    (8, 128): ((8, 32, 128), (8, 16, 128, True), (4, 16, 128)),
}
# The element sizes that have the scalar modifiers' instantiation (no bias, mask or block mask compiled in):
# 16-bit and float32. Not float64: two of its backward passes (HEAD_DIM 32 and 64, same tiles as the full
# instantiation's) spilled on sm_90, and float64 has no speed target with modifiers.
SCALAR_MODS_ITEMSIZES = (2, 4)
# The window-alone forward's own tiles, by HEAD_DIM (same fields as _TABLE, then split and ctas_per_sm).
# A short band leaves each CTA a few key blocks, so its fixed costs (setup, the first copies' latency,
# the epilogue: over a third of a window CTA's cycles at HEAD_DIM 128) are hidden by the other CTAs of its
# SM, not by its own loop; and 128-key tiles spend more on the band's edges. Against the scalars' tiles
# (window (256, 0) forward, bench/NOTES.md, v18): 64-key tiles at four CTAs per SM -28% at HEAD_DIM 16
# (128-key tiles at two before), -13% at 32 and -25% at 64 (likewise); 64-key at three -13% at 96 (two
# before; 32-key at four: -9%); 32-key at four -4% at 128 (64-key at two before). Wider heads keep the
# scalars' tiles.
_WGMMA_WINDOW_FWD = {
    16: (4, 64, 16, False, 4),
    32: (4, 64, 32, False, 4),
    64: (4, 64, 64, False, 4),
    96: (4, 64, 96, False, 3),
    128: (4, 32, 128, False, 4),
}
# The window-alone backward's own tiles, by HEAD_DIM: (dkdv, dq), same fields as _TABLE. At HEAD_DIM 64 the
# scalars' passes stream 128-wide tiles (their dQ pass on them spilled 4 bytes in this instantiation with
# NVRTC 12.9); a band of 256 keys leaves such a tile mostly masked. 64-wide tiles: -17% (window (256, 0)
# backward, bench/NOTES.md, v19). 32-wide ones were slower or level at every head dim (16 to 128).
_WGMMA_WINDOW_BWD = {
    64: ((4, 64, 64), (4, 64, 64)),
}
# The warp-specialized forward (cuda_src/attention_fwd_ws.cu: one warpgroup copying with TMA for two that
# compute, 128 rows per tile, one persistent CTA per SM) by HEAD_DIM: (BLOCK_N, STAGES), the keys of a
# K/V tile and the slots of their ring. The host sends the plain, causal and scalar-modifier (window,
# softcap, ALiBi) forwards there (16-bit, Hopper, no dropout, dense batches whose q, k, v a tensor map can
# describe: cupyflash/_tma.py).
# At HEAD_DIM 128 (bench/NOTES.md, v19, v20), against the wgmma forward's tiles: window (256, 0) -6 to -10%
# (2k to 16k), causal -18 to -22% and full -12 to -16% (2k, 8k). 128-key tiles in 2 slots, whose K is
# released apart from V (v26), against 64-key tiles in 4 (causal 2k / 8k, full 2k / 8k): plain and causal
# -1.6 to -5.7%, softcap -0.1 to -7.2%, ALiBi -4.8 to -8.8% but for causal 2k (+1.6%: a warpgroup's
# diagonal block is half masked). The window alone (WS_WINDOW_FWD), whose tiles visit a few key blocks
# each, keeps 64-key tiles in 4 slots: 8-9% faster than 128-key ones.
WS_FWD = {128: (128, 2)}
WS_WINDOW_FWD = {128: (64, 4)}
WS_WARPS, WS_COPY_WARPS = 12, 4  # three warpgroups, the first of which copies
WS_ROWS = 16 * (WS_WARPS - WS_COPY_WARPS)  # query rows per tile: Tiles.rows of those warps (128)
# The key tiles of 128 a warp-specialized forward's block-mask walk holds per tile, as bits in shared memory
# (cuda_src: TILE_BITMAP_WORDS * 32, 262,144 keys); a block mask with more takes the Mods::all forward.
WS_BLOCK_MASK_TILES = 2048
WS_WARPGROUP_ROWS = 64  # each computing warpgroup's rows, which visit their own key blocks
# Where that instantiation fits the plain tiles that the modifiers' tables replace: (path, element bytes,
# HEAD_DIM, kernel). Every 16-bit and float32 entry of those tables was tried; these compile with zero
# spills (NVRTC 12.9 for sm_80 and sm_90, CUDA 13.0 ptxas for sm_90a); the others still spill: mma
# (4, 192, fwd), (2, 256, dkdv); wgmma (2, 192, fwd), (2, 96, dkdv).
_SCALAR_MODS_PLAIN = frozenset({
    ("mma", 2, 64, "dkdv"), ("mma", 2, 256, "fwd"),
    ("wgmma", 2, 16, "fwd"), ("wgmma", 2, 32, "fwd"), ("wgmma", 2, 64, "fwd"), ("wgmma", 2, 256, "fwd"),
    ("wgmma", 2, 64, "dkdv"), ("wgmma", 2, 128, "dkdv"), ("wgmma", 2, 64, "dq"),
})
# The tiles of the modifiers' and dropout instantiations where the table's are split: (path, element bytes,
# HEAD_DIM, kernel) -> tiles (the modifiers' own table may still override them).
_UNSPLIT = {
    ("mma", 2, 160, "dkdv"): (4, 32, 80),
    ("mma", 2, 192, "dkdv"): (4, 32, 96),
    ("mma", 2, 256, "dkdv"): (4, 32, 128),
    ("wgmma", 2, 192, "dkdv"): (4, 32, 64),
    ("wgmma", 2, 256, "dq"): (4, 32, 128),
    ("mma", 4, 64, "dkdv"): (4, 32, 32),
    ("mma", 4, 128, "dkdv"): (4, 16, 64),
    ("mma", 8, 96, "dkdv"): (4, 16, 48),
    ("mma", 8, 128, "dkdv"): (2, 16, 64),
    ("mma", 8, 160, "dkdv"): (1, 16, 32),
    ("mma", 8, 192, "dkdv"): (1, 16, 48),
    ("mma", 8, 256, "dkdv"): (1, 16, 64),
    ("large", 8, 128, "dkdv"): (4, 16, 64),
    ("wgmma", 2, 256, "dkdv"): (4, 16, 128),
}
_LARGE_SMEM_MODS_TABLE = {
    (8, 128, "fwd"): (8, 32, 64),
    (8, 128, "dkdv"): (4, 16, 32),
}
LARGE_SMEM_CC = 90  # compute capabilities from here on give a CTA 227 KiB of shared memory
# (element bytes, HEAD_DIM, direction) whose plain tiles need more than sm_80's 163 KiB (the float64 backward
# at HEAD_DIM 256: about 200 KiB even with one warp per CTA): built for sm_90 only; elsewhere the launch
# raises, naming the shared memory it needs and the device's.
_LARGE_SMEM_ONLY = {(8, 256, "bwd")}
# wgmma (sm_90a) tiles for 16-bit elements, by HEAD_DIM; same fields as _TABLE.
_WGMMA_TABLE = {
    16: ((4, 128, 16), (4, 64, 16), (4, 64, 16)),
    32: ((4, 128, 32), (4, 64, 32), (4, 64, 32)),
    64: ((4, 128, 64), (4, 128, 64), (4, 128, 64)),
    96: ((4, 64, 96), (4, 64, 96), (4, 64, 96)),
    128: ((4, 64, 128), (4, 64, 128), (4, 64, 128)),
    160: ((8, 64, 160), (4, 16, 160), (4, 32, 160)),
    192: ((8, 64, 192), (8, 32, 192, True), (4, 32, 192)),
    256: ((8, 64, 256), (8, 64, 256, True), (8, 64, 256, True)),
}
# float32 on the wgmma path (plain and causal, forward and backward): q, k, v (and dout) split into float16
# pieces (cuda_src/split_f32.cu, pieces.cuh; the forward splits its q tiles itself), so the tiles hold rows of 2 * HEAD_DIM float16 elements, the
# bytes of a float32 row; same fields as _TABLE. The lo pieces (and column chunks) must start on a swizzle
# atom (64 float16 columns): HEAD_DIM 64 and 128. The backward adds each product of a register operand
# into a fresh accumulator (gemm_pb_pieces), so at HEAD_DIM 128 its dK/dV pass takes two column chunks
# (one spilled). HEAD_DIM 128's 8-warp tiles ran the backward at 76 / 70 TFLOP/s (full / causal, N = 4k,
# H100) against 60 / 56 with 4 warps; at 64 the 4-warp ones were as fast as any (bench/NOTES.md, v9).
_WGMMA_PIECES = {
    64: ((4, 64, 64), (4, 64, 64), (4, 64, 64)),
    128: ((8, 32, 128), (8, 32, 64), (8, 32, 128)),
}
# The modifiers' extra registers per score (bounds, bias, softcap derivative) make these spill with the
# plain tiles above (whose blocks must also divide the block mask's BLOCK_MASK_TILE = 128).
_WGMMA_MODS_TABLE = {
    (2, 16, "fwd"): (4, 64, 16),
    (2, 64, "fwd"): (4, 64, 64),
    (2, 32, "fwd"): (4, 64, 32),
    (2, 192, "fwd"): (8, 32, 192),
    (2, 256, "fwd"): (8, 32, 256),
    (2, 64, "dkdv"): (4, 32, 64),
    (2, 96, "dkdv"): (4, 32, 96),
    (2, 128, "dkdv"): (4, 32, 128),
    (2, 64, "dq"): (4, 64, 64),
}
# The dropout kernels also hold the Philox state and a tile's keep bits; where that makes a variant spill,
# (path, modifiers, element bytes, HEAD_DIM, kernel) -> its tiles (path "mma", "wgmma" or "large": the
# large-shared-memory float64 tiles).
_DROPOUT_TABLE = {
    ("mma", True, 2, 16, "dkdv"): (4, 32, 16),
    ("mma", True, 2, 32, "dkdv"): (4, 32, 32),
    ("mma", True, 2, 128, "fwd"): (4, 64, 128),
    ("mma", True, 2, 96, "dkdv"): (4, 16, 96),
    ("mma", True, 2, 128, "dkdv"): (4, 16, 128),
    ("mma", True, 2, 192, "dkdv"): (4, 16, 96),
    ("mma", True, 8, 32, "dkdv"): (4, 16, 32),
    ("mma", False, 8, 256, "dkdv"): (1, 16, 32),
    # 16-bit D = 256 (sm_80: causal spilled 44 bytes with BLOCK_M 32 once Z went into P^T and dS in one step).
    ("mma", False, 2, 256, "dkdv"): (4, 16, 128),
    # float64 D = 64 and 128 dK/dV with dropout: Philox's round keys, read from the parameters, spilled
    # 32-60 bytes on sm_90 with the gradient columns in one chunk; two chunks.
    ("mma", False, 8, 64, "dkdv"): (4, 16, 32),
    ("mma", False, 8, 128, "dkdv"): (2, 16, 32),
    ("large", False, 8, 128, "dkdv"): (4, 16, 32),
    ("wgmma", False, 2, 64, "dkdv"): (4, 64, 64),
    ("wgmma", False, 2, 96, "dkdv"): (4, 32, 96),
    ("wgmma", True, 2, 16, "dkdv"): (4, 32, 16),
    ("wgmma", True, 2, 32, "dkdv"): (4, 32, 32),
    ("wgmma", True, 2, 96, "dkdv"): (4, 16, 96),
    ("wgmma", True, 2, 128, "dkdv"): (4, 16, 128),
    ("wgmma", True, 2, 160, "dkdv"): (4, 16, 32),
    ("wgmma", True, 2, 32, "fwd"): (4, 64, 32),
    ("wgmma", True, 2, 64, "fwd"): (4, 64, 64),
}
HEAD_DIMS = tuple(sorted({head_dim for _, head_dim in _TABLE}))
MAX_HEAD_DIM = HEAD_DIMS[-1]
_KERNELS = ("fwd", "dkdv", "dq")
# attention_probs_kernel reuses the forward's row and key tiles (its D_CHUNK is unused).
_SHARES_TILES = {"probs": "fwd"}


def has_wgmma(itemsize: int, head_dim: int) -> bool:
    """Whether (element size, HEAD_DIM) has wgmma tiles: the path taken on compute capability 9.0."""
    return itemsize == 2 and head_dim in _WGMMA_TABLE


def has_wgmma_pieces(itemsize: int, head_dim: int, mods: bool = False, dropout: bool = False) -> bool:
    """Whether float32 kernels have wgmma tiles over float16 pieces: plain or causal, without dropout."""
    return itemsize == 4 and head_dim in _WGMMA_PIECES and not mods and not dropout


def has_large_smem_tiles(itemsize: int, head_dim: int) -> bool:
    """Whether (element size, HEAD_DIM) has tiles for GPUs of compute capability >= LARGE_SMEM_CC."""
    return (itemsize, head_dim) in _LARGE_SMEM_TABLE


def needs_large_smem(itemsize: int, head_dim: int, direction: str) -> bool:
    """Whether a variant's plain tiles fit only GPUs of compute capability >= LARGE_SMEM_CC."""
    return (itemsize, head_dim, direction) in _LARGE_SMEM_ONLY


def ws_blocks(head_dim: int, window_alone: bool = False) -> tuple[int, int]:
    """(BLOCK_N, STAGES) of the warp-specialized forward at ``head_dim`` (one of WS_FWD's): the window-alone
    instantiation's from WS_WINDOW_FWD, every other one's from WS_FWD."""
    return (WS_WINDOW_FWD if window_alone else WS_FWD)[head_dim]


def tiles(itemsize: int, head_dim: int, kernel: str, mods: bool = False, wgmma: bool = False,
          dropout: bool = False, large_smem: bool = False, scalar_mods: bool = False,
          window_alone: bool = False, warp_specialized: bool = False) -> Tiles:
    """Tile shape for one kernel ("fwd", "dkdv", "dq" or "probs") of one variant; ``mods``: the
    score modifiers' instantiation; ``wgmma``: the Hopper path; ``dropout``: the dropout instantiation;
    ``large_smem``: the float64 tiles for GPUs with 227 KiB of shared memory per CTA; ``scalar_mods``
    (with ``mods``): the instantiation without the modifiers' arrays (``_SCALAR_MODS_PLAIN``);
    ``window_alone`` (with ``scalar_mods``, wgmma): the window-alone instantiation (``_WGMMA_WINDOW_FWD``,
    ``_WGMMA_WINDOW_BWD``); ``warp_specialized`` (its forward, plain or with ``scalar_mods``): the
    warp-specialized kernel (``WS_FWD``: WS_WARPS warps, BLOCK_N keys per K/V tile)."""
    if warp_specialized:
        if kernel != "fwd" or itemsize != 2 or dropout or (mods and not scalar_mods) or head_dim not in WS_FWD:
            raise ValueError(f"no warp-specialized {kernel} for {itemsize}-byte elements at head_dim {head_dim} with "
                             f"these options: it serves the 16-bit plain, causal and scalar-modifier forwards "
                             f"at head dims {tuple(WS_FWD)}")
        return Tiles(WS_WARPS, ws_blocks(head_dim, window_alone)[0], head_dim, copy_warps=WS_COPY_WARPS)
    if (itemsize, head_dim) not in _TABLE:
        raise ValueError(f"no tiles for {itemsize}-byte elements and head_dim {head_dim}; head dims: {HEAD_DIMS}")
    kernel = _SHARES_TILES.get(kernel, kernel)
    if window_alone and wgmma and kernel == "fwd" and head_dim in _WGMMA_WINDOW_FWD:
        return Tiles(*_WGMMA_WINDOW_FWD[head_dim])
    if window_alone and wgmma and kernel in ("dkdv", "dq") and head_dim in _WGMMA_WINDOW_BWD:
        return Tiles(*_WGMMA_WINDOW_BWD[head_dim][kernel == "dq"])
    if wgmma and has_wgmma_pieces(itemsize, head_dim, mods, dropout):
        return Tiles(*_WGMMA_PIECES[head_dim][_KERNELS.index(kernel)])
    if wgmma and not has_wgmma(itemsize, head_dim):
        raise ValueError(f"no wgmma tiles for {itemsize}-byte elements and head_dim {head_dim}")
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {_KERNELS + tuple(_SHARES_TILES)}, got {kernel!r}")
    if large_smem and not has_large_smem_tiles(itemsize, head_dim):
        raise ValueError(f"no large-shared-memory tiles for {itemsize}-byte elements and head_dim {head_dim}")
    if large_smem:
        table, mods_table = _LARGE_SMEM_TABLE[itemsize, head_dim], _LARGE_SMEM_MODS_TABLE
    elif wgmma:
        table, mods_table = _WGMMA_TABLE[head_dim], _WGMMA_MODS_TABLE
    else:
        table, mods_table = _TABLE[itemsize, head_dim], _MODS_TABLE
    dropout_key = ("large" if large_smem else "wgmma" if wgmma else "mma", bool(mods), itemsize, head_dim, kernel)
    if dropout and dropout_key in _DROPOUT_TABLE:
        return Tiles(*_DROPOUT_TABLE[dropout_key])
    if mods and (itemsize, head_dim, kernel) in mods_table and (
            not scalar_mods or (dropout_key[0], itemsize, head_dim, kernel) not in _SCALAR_MODS_PLAIN):
        return Tiles(*mods_table[itemsize, head_dim, kernel])
    found = Tiles(*table[_KERNELS.index(kernel)])
    if found.split and (mods or dropout):
        return Tiles(*_UNSPLIT[dropout_key[0], itemsize, head_dim, kernel])
    return found


def preprocess_lanes(itemsize: int, head_dim: int) -> int:
    """Lanes that share one row in the backward preprocess: one per 16-byte chunk of a HEAD_DIM-wide row,
    rounded up to a power of two, at most a warp (the rest of the warp takes further rows)."""
    chunks = head_dim * itemsize // 16
    lanes = 1
    while lanes < min(chunks, 32):
        lanes *= 2
    return lanes


def padded_head_dim(d: int) -> int:
    """The smallest shipped HEAD_DIM that holds a head dim of d elements."""
    for head_dim in HEAD_DIMS:
        if d <= head_dim:
            return head_dim
    raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {d}")


def smem_bytes(itemsize: int, head_dim: int, kernel: str, mods: bool = False, wgmma: bool = False,
               dropout: bool = False, large_smem: bool = False, scalar_mods: bool = False,
               window_alone: bool = False, warp_specialized: bool = False) -> int:
    """Dynamic shared memory of a kernel; mirrors the carve-up at the top of each kernel (swizzled wgmma
    tiles have unpadded rows and start on a SMEM_ALIGN boundary the kernel finds itself)."""
    if warp_specialized:  # two q buffers of WS_ROWS rows, STAGES slots of a K and a V tile
        block_n, stages = ws_blocks(head_dim, window_alone)
        return SMEM_ALIGN + itemsize * head_dim * (2 * WS_ROWS + 2 * stages * block_n)
    t = tiles(itemsize, head_dim, kernel, mods, wgmma, dropout, large_smem, scalar_mods, window_alone)
    row = head_dim * itemsize + (0 if wgmma else SMEM_PAD_BYTES[itemsize])
    return (SMEM_ALIGN if wgmma else 0) + _tile_bytes(kernel, t, row, wgmma, 8 if itemsize == 8 else 4)


def _tile_bytes(kernel: str, t: Tiles, row: int, wgmma: bool, acc_bytes: int) -> int:
    if kernel == "fwd":  # sQ[BLOCK_M] + sK, sV[BLOCK_N] (double-buffered on the wgmma path)
        return (t.rows + (4 if wgmma else 2) * t.block) * row
    if kernel == "dkdv":  # sK, sV[BLOCK_N] + sQ, sdO[2][BLOCK_M] + lse, delta[2][BLOCK_M] (accumulator type)
        # + split: P^T for each pair of warps, BLOCK_M / 8 * 4 * 32 accumulators
        pairs = t.num_warps // 2 if t.split else 0
        return (2 * t.rows + 4 * t.block) * row + 4 * t.block * acc_bytes + pairs * (t.block // 8) * 128 * acc_bytes
    if kernel == "dq":  # sQ, sdO[BLOCK_M] + sK, sV[2][BLOCK_N] + split: P, then dS, for each pair of warps
        pairs = t.num_warps // 2 if t.split else 0
        return (2 * t.rows + 4 * t.block) * row + pairs * (t.block // 8) * 128 * acc_bytes
    if kernel == "probs":  # sQ[BLOCK_M] + sK[BLOCK_N]
        return (t.rows + t.block) * row
    raise ValueError(f"kernel must be 'fwd', 'dkdv', 'dq' or 'probs', got {kernel!r}")
