"""Which kernel variant serves a call, with the thresholds behind each choice: one function per kernel family, in
the manner of FlashAttention-3's hopper/tile_size.h.

    dense(f, device)                              the dense forward, backward and attention_probs
    fp8(head_dim, causal, out_dtype)              the FP8 forward
    decode(dtype, d, dv, packed_rows, page_size)  attention_with_kvcache's split-KV kernels
    fused_backward_by_arrival(...)                the fused backward's order of dq adds (a launch argument)
    shipped_variants(), variants_for(arch)        the catalogue: every dense and FP8 variant the library ships
    wide_form(...), wide_variants()               unrounded results: the form a call takes, and what ships

Each decision is one named expression with its reason beside it. The tile shapes a variant compiles with are
in the tables (tiles.py: dense and FP8; decode_tiles.py: decoding); the measurements behind the thresholds
here are in docs/design/tiles.md. Every function is pure: the call's Features and the device's abilities in,
a variant out; tests/cpu/test_select.py pins the choices.
"""

from __future__ import annotations

import dataclasses
import functools

from cupyflash._cuda import decode_tiles, tiles
from cupyflash._cuda.decode_tiles import DecodeVariant
from cupyflash._cuda.variants import (
    BOUNDED_SOFTCAP_MAX,
    DTYPES,
    FP8,
    FP8_OUT_DTYPES,
    ITEMSIZES,
    WIDE,
    Device,
    Features,
    Variant,
)
from cupyflash._modifiers import BLOCK_MASK_TILE

# The shortest min(Nq, Nk) the fused backward serves, in either dq order: below it the two passes are faster
# (dq_accum's per-row cost and the ordered adds weigh more on short loops).
WS_BWD_MIN_LENGTH = {64: 1024, 128: 1024, 192: 1024, 256: 1024}
# ... and the least work, batch entries x Nq x Nk x HEAD_DIM (2^34: about 0.4 ms of GPU time), set when the fused
# backward was launched unplanned; it now has a plan like the two passes', and the threshold stays until the two
# are timed against each other below it (docs/design/backward.md).
WS_BWD_MIN_WORK = 1 << 34
# From how many keys an ordered call without a causal mask adds dq in key-block order rather than by arrival
# (unordered adds always walk as by arrival): there every CTA walks the query blocks in one order, which is faster
# from these lengths on (docs/design/tiles.md). Where a batch entry's key blocks outnumber the SMs, the index
# order serves whatever the length (fused_backward_by_arrival): at HEAD_DIM 256 that comes before 16384 keys.
WS_BWD_INDEX_ORDER_KEYS = {64: 8192, 128: 16384, 192: 16384, 256: 16384}
# Unrounded results (WIDE: out, or dq, dk, dv, in float32 from 16-bit inputs) ship at these HEAD_DIMs, a narrower
# head dim padded to the next (zero columns cost time, not accuracy), and in the forms that serve the ring's calls:
# plain and causal, the scalars, all and all+dropout on the mma.sync and wgmma paths; the warp-specialized forward
# plain, causal, a window alone and the scalars' plain scores; the fused backward in order. Every other call runs on
# one of those (wide_form), so that the catalogue grows by a fifth rather than doubling.
WIDE_HEAD_DIMS = (64, 128, 192, 256)
WIDE_16BIT = ("float16", "bfloat16")  # the inputs whose results can be wider (float32 and float64 already are)


def dense(f: Features, device: Device) -> Variant:
    """The variant that serves a dense call with features ``f`` on a device with abilities ``device``."""
    itemsize, head_dim = ITEMSIZES[f.dtype], tiles.padded_head_dim(f.head_dim)
    wide = f.out_dtype == WIDE
    if wide:
        head_dim = next(d for d in WIDE_HEAD_DIMS if d >= head_dim)
    # Packed batches and attention_probs read cu_seqlens or every option at run time: the modifiers' kernels.
    has_mods = f.has_mods or f.direction == "probs" or f.packed
    # float32 on Hopper runs on float16 pieces, for plain calls only (the pieces are made per call).
    pieces = f.direction != "probs" and not has_mods and not f.dropout and tiles.has("pieces", itemsize, head_dim)
    # Hopper's warpgroup products, where the table has cells for this element size and head dim.
    wgmma = device.wgmma and (tiles.has("wgmma", itemsize, head_dim) or pieces)
    ws_fwd = _warp_specialized_forward(f, itemsize, wgmma)  # its HEAD_DIM, or None where it does not serve
    # A block mask with no bias or mask: the warp-specialized forward walks it; other forwards with a block mask
    # take the ``all`` form, whose walk costs the scalars' forwards time; the backward's scalars walk it.
    ws_block_mask = (
        ws_fwd is not None and f.block_mask and not f.arrays and not wide and ws_walks_block_mask(itemsize, ws_fwd)
    )
    mods = _mods_form(f, itemsize, head_dim, has_mods, wgmma, ws_block_mask)
    warp_specialized = ws_fwd is not None and mods != "all"
    if wide:
        mods = wide_form(f, mods, warp_specialized)
    fused = _fused_backward(f, itemsize, wgmma, has_mods)  # its HEAD_DIM, or None
    if warp_specialized or fused is not None:
        path, head_dim = "ws", ws_fwd if f.direction == "fwd" else fused
    elif wgmma:
        path = "pieces" if itemsize == 4 else "wgmma"
    elif device.large_smem and tiles.has("large", itemsize, head_dim):
        path = "large"  # 227 KiB of shared memory holds the larger tiles
    else:
        path = "mma"
    return Variant(
        f.direction,
        f.dtype,
        head_dim,
        path,
        mods,
        f.causal and mods in ("none", "softcap"),  # other forms take causal as the window's right edge
        f.dropout,
        "plain" if wide else _score_form(f, mods, wgmma, warp_specialized),
        warp_specialized and ws_block_mask,
        out_dtype=f.out_dtype,
        # only the fused backward adds dq in any order (its unrounded gradients: in order)
        deterministic=f.deterministic or fused is None or wide,
    )


@functools.lru_cache(maxsize=4096)  # four dense() choices: ~75 us, paid by every checked GQA backward
def unrounded_alike(f: Features, device: Device) -> Variant | None:
    """The variant with unrounded results (WIDE) of a 16-bit backward where it is the rounded call's kernel form
    but for the results' type (HEAD_DIM, path, modifiers' form, the order of dq's adds); None where they differ
    (WIDE_HEAD_DIMS' padding, wide_form's forms, in-order dq adds). A backward whose gradients its caller sums
    over broadcast dims (GQA's dk, dv) takes it, so that the sum is rounded once, not each part first. Asked
    before the inputs' layout is read, so it must hold with tensor maps and without (the two passes the fused
    backward falls back to where maps cannot describe the inputs): None unless both are alike. Kept per (f, device):
    a test that patches this module's thresholds calls ``unrounded_alike.cache_clear()``."""
    if f.direction != "bwd" or f.dtype not in WIDE_16BIT or f.out_dtype:
        return None
    for tma in (True, False):
        form = dataclasses.replace(f, tma=tma)
        rounded = dense(form, device)
        unrounded = dense(dataclasses.replace(form, out_dtype=WIDE), device)
        if dataclasses.replace(unrounded, out_dtype=rounded.out_dtype) != rounded:
            return None
    return dense(dataclasses.replace(f, out_dtype=WIDE), device)


def wide_form(f: Features, mods: str, warp_specialized: bool) -> str:
    """The modifiers' form of a call with unrounded results: the one ``_mods_form`` chose where it ships WIDE, else
    the scalars (a window alone, off the warp-specialized forward; a softcap alone's backward) or all (dropout
    without modifiers)."""
    if mods == "softcap" or (mods == "window" and not warp_specialized):
        return "scalars"
    if f.dropout and mods == "none":
        return "all"
    return mods


def _warp_specialized_forward(f: Features, itemsize: int, wgmma: bool) -> int | None:
    """The warp-specialized forward's HEAD_DIM for this call, or None: 16-bit forwards on Hopper whose tensor maps
    describe the inputs, without dropout or packed batches (it has neither)."""
    if f.direction != "fwd" or not wgmma or itemsize != 2 or not f.tma or f.dropout or f.packed:
        return None
    if f.out_dtype == WIDE and f.alibi:  # its ALiBi forms do not ship unrounded
        return None
    head_dim = tiles.ws_head_dim(f.head_dim, "fwd")
    return head_dim if head_dim is not None and tiles.has("ws", itemsize, head_dim) else None


def _mods_form(f: Features, itemsize: int, head_dim: int, has_mods: bool, wgmma: bool, ws_block_mask: bool) -> str:
    """The modifiers' compiled form: none; the scalars' (window, softcap, ALiBi read as numbers), or one of them
    alone with the others fixed at compile time; or ``all`` (per-element arrays, dropout with modifiers, probs)."""
    if not has_mods:
        return "none"
    # The scalars' form exists where the table has its cells (not for float64: two of its passes spilled).
    scalars = (
        f.direction != "probs"
        and not f.dropout
        and tiles.has("mma", itemsize, head_dim, "scalars")
        and (not f.has_mods or ws_block_mask or (not f.arrays and (not f.block_mask or f.direction == "bwd")))
    )
    if not scalars:
        return "all"
    # One option alone, every other off: the forms that fix the others at compile time (16-bit, Hopper).
    single = (
        wgmma
        and tiles.has("wgmma", itemsize, head_dim, "window")
        and not f.packed
        and f.has_mods
        and not f.alibi
        and not f.block_mask
    )
    if single and f.direction == "bwd" and f.softcap > 0 and f.window == (-1, -1):
        return "softcap"  # the backward's softcap alone: its derivative without the window's tests
    if single and f.softcap == 0:
        return "window"
    return "scalars"


def _fused_backward(f: Features, itemsize: int, wgmma: bool, has_mods: bool) -> int | None:
    """The fused backward's HEAD_DIM, or None: plain or causal 16-bit backwards on Hopper, on tensor maps, for
    sequences from WS_BWD_MIN_LENGTH to CHAIN_ROWS (longer ones chain the two passes)."""
    if f.direction != "bwd" or not wgmma or itemsize != 2 or has_mods or f.dropout or not f.tma:
        return None
    head_dim = tiles.ws_head_dim(f.head_dim, "bwd")
    if head_dim is None or max(f.lengths) > tiles.CHAIN_ROWS or min(f.lengths) < WS_BWD_MIN_LENGTH[head_dim]:
        return None
    return head_dim


def _score_form(f: Features, mods: str, wgmma: bool, warp_specialized: bool) -> str:
    """How the forward's scores are formed: bounded (a bf16 softcap whose exponent range lets the exponential skip
    its range reduction), ALiBi's warp-specialized forms, or plain."""
    if f.direction == "fwd" and mods == "scalars" and wgmma and f.dtype == "bfloat16" and not f.alibi:
        if 0.0 < f.softcap <= BOUNDED_SOFTCAP_MAX:
            return "bounded"
    if warp_specialized and f.alibi:
        return "alibi_half_first" if f.right_edge else "alibi"  # a right edge leaves half the keys of a tile
    return "plain"


def ws_walks_block_mask(itemsize: int, head_dim: int) -> bool:
    """Whether the warp-specialized forward at this head dim walks a block mask itself: its key blocks must be
    the block mask's tiles (attention_fwd_ws.cu, BLOCK_MASK); elsewhere a block mask takes the ``all`` form."""
    return tiles.lookup("ws", itemsize, head_dim, "fwd", "scalars").block == BLOCK_MASK_TILE


def backward_lengths(batch: int, nq: int, nk: int, head_dim: int) -> tuple[int, int]:
    """What a dense backward's Features carry as its lengths: (Nq, Nk) where its work (batch entries x Nq x Nk x
    HEAD_DIM) reaches WS_BWD_MIN_WORK, else (0, 0), which keeps it on the two passes."""
    return (nq, nk) if batch * nq * nk * head_dim >= WS_BWD_MIN_WORK else (0, 0)


def fused_backward_by_arrival(
    nk: int, head_dim: int, causal: bool, sms: int, deterministic: bool = True, *, keys: int
) -> bool:
    """Whether key blocks take their turn at a query block in the order they reach it (attention_bwd_ws.cu), else
    in the order of their index. In order: by arrival only where all of a batch entry's CTAs can be resident at
    once (one per SM: a CTA may wait for one launched after it), and without a causal mask below
    WS_BWD_INDEX_ORDER_KEYS keys, from where the index order was faster. Unordered adds wait for nothing, so their
    key blocks always walk as by arrival, each from its own query block: in index order every CTA would add into
    the same query block's accumulator at once (docs/design/backward.md). ``keys``: a CTA's key block."""
    if not deterministic:
        return True
    if -(-nk // keys) > sms:
        return False
    return causal or nk < WS_BWD_INDEX_ORDER_KEYS[head_dim]


def fp8(head_dim: int, causal: bool, out_dtype: str) -> Variant:
    """The FP8 forward's variant: e4m3 q, k, v on the warp-specialized path (the only one with FP8 products),
    out in ``out_dtype``; its HEAD_DIM is the narrowest of tiles.FP8_HEAD_DIMS that holds the head dim."""
    return Variant("fwd", FP8, head_dim, "ws", causal=causal, out_dtype=out_dtype)


def decode(
    dtype: str,
    d: int,
    dv: int,
    packed_rows: int,
    page_size: int | None = None,
    cache: str | None = None,
    aligned: bool = True,
) -> DecodeVariant:
    """The decode variant for a call (``cache``: "e4m3" for FP8 caches): the narrowest HEAD that holds D and Dv;
    for e4m3 caches of at most 8 packed rows, in whole aligned 16-byte rows (``aligned``), contiguous or in pages
    of a multiple of 16 positions, the keys-as-rows kernel (attention_decode_fp8.cu); else 64-row tiles when more
    than 16 rows are packed and the table has them (fewer CTAs re-read the cache), else 16-row tiles (several per
    key/value head if need be); for a paged cache whose pages do not hold whole tiles, TABLE_ROWWISE's tile where
    it has one (a row's keys then never straddle a page within a tile)."""
    head = decode_tiles.head_bucket(d, dv)
    if (
        cache == "e4m3"
        and packed_rows <= decode_tiles.FP8_ROWS
        and aligned
        and (page_size is None or page_size % decode_tiles.FP8_PAGE_MULTIPLE == 0)
    ):
        return DecodeVariant(dtype, head, decode_tiles.FP8_ROWS, cache=cache, keys_as_rows=True)
    itemsize = decode_tiles.CACHE_ITEMSIZES[cache] if cache else ITEMSIZES[dtype]
    rows = 64 if packed_rows > 16 and (itemsize, head, 64) in decode_tiles.TABLE else 16
    variant = DecodeVariant(dtype, head, rows, cache=cache)
    if page_size is not None and page_size % variant.block_n and (itemsize, head, rows) in decode_tiles.TABLE_ROWWISE:
        return DecodeVariant(dtype, head, rows, rowwise=True)
    return variant


# ---------------------------------------------------------------------------------------------------
# The catalogue: every dense and FP8 variant the library ships (decoding's: decode_tiles.shipped_variants)
# ---------------------------------------------------------------------------------------------------


def shipped_variants() -> list[Variant]:
    """Every variant the library can compile: on every path of the tile table, each of its forms, causal
    and not where the kernel tells them apart, and the forward's score forms where they exist; then the FP8
    forward's, and those with unrounded results (wide_variants)."""
    found = []
    for dtype in DTYPES:
        itemsize = ITEMSIZES[dtype]
        for head_dim in tiles.HEAD_DIMS:
            for path in ("mma", "large", "wgmma", "pieces"):
                if not tiles.has(path, itemsize, head_dim):
                    continue
                for direction in ("fwd", "bwd"):
                    base = Variant(direction, dtype, head_dim, path)
                    for dropout in (False, True):
                        if dropout and not tiles.has(path, itemsize, head_dim, "dropout"):
                            continue
                        for causal in (False, True):
                            found.append(dataclasses.replace(base, causal=causal, dropout=dropout))
                        if tiles.has(path, itemsize, head_dim, "all"):
                            found.append(dataclasses.replace(base, mods="all", dropout=dropout))
                    if not tiles.has(path, itemsize, head_dim, "scalars"):
                        continue
                    found.append(dataclasses.replace(base, mods="scalars"))
                    if direction == "fwd" and path == "wgmma" and dtype == "bfloat16":
                        found.append(dataclasses.replace(base, mods="scalars", score="bounded"))
                    if direction == "bwd" and path == "wgmma":
                        found += [dataclasses.replace(base, mods="softcap", causal=c) for c in (False, True)]
                    if tiles.has(path, itemsize, head_dim, "window"):
                        found.append(dataclasses.replace(base, mods="window"))
                if tiles.has(path, itemsize, head_dim, "all"):
                    found.append(Variant("probs", dtype, head_dim, path, "all"))
            if tiles.has("ws", itemsize, head_dim, kernel="bwd"):
                found += [
                    Variant("bwd", dtype, head_dim, "ws", causal=c, deterministic=ordered)
                    for ordered in (True, False)
                    for c in (False, True)
                ]
            if tiles.has("ws", itemsize, head_dim):
                ws = Variant("fwd", dtype, head_dim, "ws")
                found += [dataclasses.replace(ws, causal=c) for c in (False, True)]
                found.append(dataclasses.replace(ws, mods="window"))
                scores = ("plain", "alibi", "alibi_half_first") + (("bounded",) if dtype == "bfloat16" else ())
                block_masks = (False, True) if ws_walks_block_mask(itemsize, head_dim) else (False,)
                found += [
                    dataclasses.replace(ws, mods="scalars", score=score, block_mask=block_mask)
                    for score in scores
                    for block_mask in block_masks
                ]
    found += [
        fp8(head_dim, causal, out)
        for head_dim in tiles.FP8_HEAD_DIMS
        for causal in (False, True)
        for out in FP8_OUT_DTYPES
    ]
    return found + wide_variants()


def wide_variants() -> list[Variant]:
    """The variants with unrounded results (WIDE_HEAD_DIMS' comment says which)."""
    found = []
    for dtype in WIDE_16BIT:
        for head_dim in WIDE_HEAD_DIMS:
            for path in ("mma", "wgmma"):
                for direction in ("fwd", "bwd"):
                    base = Variant(direction, dtype, head_dim, path, out_dtype=WIDE)
                    found += [dataclasses.replace(base, causal=c) for c in (False, True)]
                    found += [dataclasses.replace(base, mods="scalars"), dataclasses.replace(base, mods="all")]
                    found.append(dataclasses.replace(base, mods="all", dropout=True))
            ws = Variant("fwd", dtype, head_dim, "ws", out_dtype=WIDE)
            found += [dataclasses.replace(ws, causal=c) for c in (False, True)]
            found += [dataclasses.replace(ws, mods="window"), dataclasses.replace(ws, mods="scalars")]
            found += [Variant("bwd", dtype, head_dim, "ws", causal=c, out_dtype=WIDE) for c in (False, True)]
    return found


def variants_for(arch: str) -> list[Variant]:
    """The shipped variants built for architecture family ``arch`` ("sm_80" or "sm_90")."""
    return [v for v in shipped_variants() if arch in v.compile_targets()]
