#!/usr/bin/env python3
"""Benchmark the score modifiers: bias, window, softcap, ALiBi and block mask.

    python bench/bench_modifiers.py                      # every row (a few minutes on an H100/H200)
    python bench/bench_modifiers.py --quick              # N = 2k only, every kind of row
    python bench/bench_modifiers.py --rows 'window|plain-causal' --json modifiers.json
    python bench/bench_modifiers.py --dry-run            # list rows, shapes and FLOPs; needs no GPU

bf16, D = 128, FlashAttention's shapes (B = 16384 // N, H = 2048 // D = 16), one run for every row:

1. ``bias-{full,bcast}-n{2k,8k}``: a bf16 bias of shape (B, H, N, N) ("full") or (1, 1, N, N)
   ("bcast"), forward and backward (the backward returns dbias too). Peers: torch SDPA
   ``EFFICIENT_ATTENTION`` and ``CUDNN_ATTENTION`` with the same float ``attn_mask``, which requires grad
   so that torch computes the bias gradient too; a backend that cannot (error, or a wrong gradient) is
   timed without it, and the output says so. Ratio: time(efficient) / time(ours); no target.
   Our plain kernel (``plain-full-*``, no options) is the reference row.
2. ``window-n{2k,8k,16k}``: ``window=(256, 0), causal=True`` against our plain causal kernel. Ratio:
   TFLOP/s / TFLOP/s, both counted on visited tiles (below); target >= 0.85. Since B * N is constant,
   the band's time stays flat in N while the causal kernel's grows with N (the "window vs N" table).
   Peer: torch FlexAttention (``torch.nn.attention.flex_attention``, compiled to Triton kernels), the
   one torch API that runs a sliding window as skipped tiles (SDPA has no window), with the same band as
   its block mask; ratio time(flex) / time(ours), no target. The rows' DRAM floor (dram_floor.py): the
   time of the fastest kernel that only moves the call's bytes (forward: q, k, v in, out out; backward:
   q, k, v, out, dout in, dq, dk, dv out), against the time the target asks; below the floor, the
   target is out of this GPU's reach.
3. ``softcap-{full,causal}-*`` (softcap = 30) and ``alibi-{full,causal}-*`` (slopes 2^(-8 (h + 1) / H),
   shape (H,), which broadcasts against the leading dims (B, H)): TFLOP/s against our plain kernel of the
   same causality; target >= 0.9.
4. ``block-mask-n16k`` (B = 1, H = 16; N = 2k, B = 8 with --quick): a seeded random block mask of shape
   (1, H, N/128, N/128), the diagonal tiles on (no empty row) and off-diagonal tiles on with the
   probability that makes ~10% of the tiles on; against our dense kernel (no mask). Ratio:
   time(dense) / time(block mask); target >= 5.

FLOPs. Dense rows use bench_attention.py's convention: forward 4·B·H·N²·D (halved for causal),
backward 2.5 × forward. The window row and the plain causal row it is compared with are counted on the
tiles our kernels visit, with the tiles of the variant the call runs on this device (``kernel_tiles``: the
wgmma ones on Hopper, and for the window the modifiers' instantiation): a CTA of ``rows = 16·num_warps``
rows streams tiles of ``block`` columns, and the kernels' own loop bounds (mirrored in ``_key_tiles`` /
``_query_tiles``, Nq = Nk) decide which tiles it visits. With A_k the visited area
(rows × block per visited tile, summed over CTAs, heads and batch) of kernel k:

    forward  FLOPs = 4·D·A_fwd                       (S = Q Kᵀ and O += P V on every visited tile)
    backward FLOPs = 2.5 · 4·D · (A_dkdv + A_dq) / 2   (the 5 products of the convention, over the mean
                                                        area of the dK/dV pass and the dQ pass)

For a dense problem A = B·H·N², which gives back the convention. The block-mask row is counted the same
way (its visited area is the area of the tiles left on). The exact band (query i sees min(i, 256) + 1
keys) is listed in --dry-run and the JSON for comparison.

Validation, correctness first: each kind of row runs once on a reduced problem of the same kind (B = 1,
H = 2, N = 512; N = 1024 for the window and the block mask; the softcap problem uses q of std 8 so that
the cap binds) for every backend, forward and backward (dbias included), against cupyflash.reference in
float64. A backend that fails is reported "bad" and never timed. Timing: as bench_attention.py, CUDA
events, --warmup calls, then the median of --repeats (>= 20) calls, L2 flushed before every call
(--timing call, the default: host time beyond the flush counts; --timing gpu: the GPU's work alone); the
backward is timed alone (its forward runs once outside the timed region). Torch is optional: without it
only ours runs.
"""

import argparse
import json
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402  (also finds cupyflash in a checkout that is not installed)
import cupy  # noqa: E402
import dram_floor  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _modifiers, reference  # noqa: E402
from cupyflash._cuda import compile as _compile  # noqa: E402
from cupyflash._cuda import tile_policy  # noqa: E402
from cupyflash._cuda.tiles import WS_WARPGROUP_ROWS  # noqa: E402
from cupyflash._cuda.variants import Features  # noqa: E402

DTYPE, HEAD_DIM = "bf16", 128
BF16 = ba.DTYPES[DTYPE]
SEQLENS, WINDOW_SEQLENS, BLOCK_MASK_SEQLEN = (2048, 8192), (2048, 8192, 16384), 16384
QUICK_SEQLEN = 2048
WINDOW = (256, 0)  # with causal=True
SOFTCAP = 30.0
BLOCK_MASK_DENSITY = 0.10
BLOCK_MASK_TILE = cupyflash.BLOCK_MASK_TILE
TARGETS = {"bias": None, "window": 0.85, "softcap": 0.9, "alibi": 0.9, "block-mask": 5.0}
PEERS = ("efficient", "cudnn")  # torch SDPA backends for the bias rows
WINDOW_PEERS = ("flex",)  # torch FlexAttention for the window rows
VALIDATION_HEADS, VALIDATION_N, VALIDATION_N_BANDED = 2, 512, 1024
SOFTCAP_VALIDATION_Q_STD = 8.0  # scores of std ~8, so that softcap = 30 changes them
SEED = 0


# ---------------------------------------------------------------------------------------------------------
# Rows: what to run, and how many FLOPs it counts. Everything here is host-only (no GPU).


@dataclass
class Row:
    name: str
    group: str  # plain, bias, window, softcap, alibi, block-mask
    kind: str  # the validation problem: plain-full, bias-bcast, window, softcap-causal, ...
    case: ba.Case
    flops_fwd: float
    flops_bwd: float
    counted: str  # "convention" or "visited tiles"
    compare: list = field(default_factory=list)  # (against, how, flops_fwd, flops_bwd): see ratio()
    target: float = None
    peers: tuple = ()
    block_mask: np.ndarray = None  # host copy, block-mask rows only
    info: dict = field(default_factory=dict)  # extra numbers for --dry-run and the JSON

    @property
    def options(self):
        """The score-modifier options, as words (the arrays are made by make_options)."""
        b, h, n = self.case.b, self.case.h, self.case.n
        return {
            "plain": "-",
            "bias": f"bias {(b, h, n, n) if self.kind == 'bias-full' else (1, 1, n, n)} bf16",
            "window": f"window={WINDOW}",
            "softcap": f"softcap={SOFTCAP}",
            "alibi": f"alibi_slopes ({h},) float32",
            "block-mask": f"block_mask {self.block_mask.shape if self.block_mask is not None else ''}, "
            f"{self.info.get('density', 0):.1%} on",
        }[self.group]


def seqlen_tag(n):
    return f"n{n // 1024}k" if n >= 1024 else f"n{n}"


def build_rows(args):
    """Every row of this run, baselines first; those not matching --rows (and not needed) dropped."""
    quick = args.quick
    seqlens = (QUICK_SEQLEN,) if quick else SEQLENS
    window_seqlens = (QUICK_SEQLEN,) if quick else WINDOW_SEQLENS
    rows, plain = [], {}

    def plain_row(n, causal):
        name = f"plain-{'causal' if causal else 'full'}-{seqlen_tag(n)}"
        if name not in plain:
            case = ba.Case(DTYPE, HEAD_DIM, n, causal)
            plain[name] = Row(
                name,
                "plain",
                f"plain-{'causal' if causal else 'full'}",
                case,
                case.flops_fwd,
                case.flops_bwd,
                "convention",
            )
            rows.append(plain[name])
        return plain[name]

    for n in seqlens:
        base = plain_row(n, False)
        for shape in ("full", "bcast"):
            case = ba.Case(DTYPE, HEAD_DIM, n, False)
            compare = [(peer, "peer", case.flops_fwd, case.flops_bwd) for peer in PEERS]
            compare.append((base.name, "time", base.flops_fwd, base.flops_bwd))
            rows.append(
                Row(
                    f"bias-{shape}-{seqlen_tag(n)}",
                    "bias",
                    f"bias-{shape}",
                    case,
                    case.flops_fwd,
                    case.flops_bwd,
                    "convention",
                    compare,
                    TARGETS["bias"],
                    PEERS,
                )
            )
    for n in window_seqlens:
        case = ba.Case(DTYPE, HEAD_DIM, n, True)
        base = plain_row(n, True)
        base_fwd, base_bwd, base_areas = visited_flops(case, window=None)
        fwd, bwd, areas = visited_flops(case, window=WINDOW)
        pairs = band_pairs(n, WINDOW) * case.b * case.h
        info = {
            "visited_area": areas,
            "plain_causal_visited_area": base_areas,
            "band_pairs": pairs,
            "band_flops_fwd": 4 * HEAD_DIM * pairs,
            "band_flops_bwd": 10 * HEAD_DIM * pairs,
            "plain_causal_visited_flops_fwd": base_fwd,
            "plain_causal_visited_flops_bwd": base_bwd,
        }
        compare = [(base.name, "tflops", base_fwd, base_bwd)] + [(peer, "peer", fwd, bwd) for peer in WINDOW_PEERS]
        rows.append(
            Row(
                f"window-{seqlen_tag(n)}",
                "window",
                "window",
                case,
                fwd,
                bwd,
                "visited tiles",
                compare,
                TARGETS["window"],
                WINDOW_PEERS,
                info=info,
            )
        )
    for group in ("softcap", "alibi"):
        for causal in (False, True):
            for n in seqlens:
                case = ba.Case(DTYPE, HEAD_DIM, n, causal)
                base = plain_row(n, causal)
                mode = "causal" if causal else "full"
                rows.append(
                    Row(
                        f"{group}-{mode}-{seqlen_tag(n)}",
                        group,
                        f"{group}-{mode}",
                        case,
                        case.flops_fwd,
                        case.flops_bwd,
                        "convention",
                        [(base.name, "tflops", base.flops_fwd, base.flops_bwd)],
                        TARGETS[group],
                    )
                )
    n = QUICK_SEQLEN if quick else BLOCK_MASK_SEQLEN
    case = ba.Case(DTYPE, HEAD_DIM, n, False)
    base = plain_row(n, False)
    mask, p_off = random_block_mask(case.h, n, BLOCK_MASK_DENSITY, SEED)
    fwd, bwd, areas = visited_flops(case, window=(-1, -1), block_mask=mask)
    info = {"density": float(mask.mean()), "offdiagonal_probability": p_off, "visited_area": areas}
    rows.append(
        Row(
            f"block-mask-{seqlen_tag(n)}",
            "block-mask",
            "block-mask",
            case,
            fwd,
            bwd,
            "visited tiles",
            [(base.name, "time", base.flops_fwd, base.flops_bwd)],
            TARGETS["block-mask"],
            block_mask=mask,
            info=info,
        )
    )
    if args.rows:
        keep = {r.name for r in rows if re.search(args.rows, r.name)}
        keep |= {against for r in rows if r.name in keep for against, how, *_ in r.compare if how != "peer"}
        rows = [r for r in rows if r.name in keep]
    return rows


def random_block_mask(h, n, density, seed):
    """(1, h, nb, nb) bool, nb = ceil(n / 128): the diagonal on, other tiles on with probability p such that
    the expected fraction on is ``density``. Returns (mask, p)."""
    nb = math.ceil(n / BLOCK_MASK_TILE)
    p = max(0.0, (density * nb * nb - nb) / (nb * nb - nb)) if nb > 1 else 0.0
    mask = np.random.default_rng(seed).random((1, h, nb, nb)) < p
    mask[..., np.arange(nb), np.arange(nb)] = True
    return mask, p


def band_pairs(n, window):
    """(i, j) pairs a causal band window=(left, 0) keeps in one N x N problem: sum_i min(i, left) + 1."""
    left = window[0]
    return int(np.minimum(np.arange(n), left).sum() + n)


# Visited tiles: which streamed tiles each CTA of each kernel visits, mirroring the loop bounds of
# cuda_src/attention_fwd.cu and attention_bwd.cu for Nq = Nk = n (offset 0). ``window`` None = the plain
# kernel (IS_CAUSAL decides); otherwise the HAS_MODS kernel with the window already folded with causal.


def _key_tiles(m0, n, rows, block, causal, window):
    """fwd and dq: the key tiles [first, end) that the CTA of query rows [m0, m0 + rows) visits."""
    if window is None:
        key_end = np.minimum(n, m0 + rows) if causal else np.full_like(m0, n)
        return np.zeros_like(m0), -(-key_end // block)
    left, right = window
    last_row = np.minimum(m0 + rows, n) - 1
    k_first = np.zeros_like(m0) if left < 0 else np.maximum(0, m0 - left)
    k_last = np.full_like(m0, n - 1) if right < 0 else np.minimum(n - 1, last_row + right)
    return k_first // block, np.where(k_last >= k_first, k_last // block + 1, 0)


def _query_tiles(n0, n, rows, block, causal, window):
    """dkdv: the query tiles [first, end) that the CTA of keys [n0, n0 + rows) visits."""
    if window is None:
        first = n0 // block if causal else np.zeros_like(n0)
        return first, np.full_like(n0, -(-n // block))
    left, right = window
    last_key = np.minimum(n0 + rows, n) - 1
    i_first = np.zeros_like(n0) if right < 0 else np.maximum(0, n0 - right)
    i_last = np.full_like(n0, n - 1) if left < 0 else np.minimum(n - 1, last_key + left)
    return i_first // block, np.where(i_last >= i_first, i_last // block + 1, 0)


def kernel_tiles(case, kernel, *, window=None, block_mask=None):
    """(rows, block) of ``kernel`` ("fwd", "dkdv", "dq") in the variant cupyflash picks for this row on the
    current device: the rows that visit a band together and the streamed tile's width. The wgmma tiles on
    Hopper, the mma.sync ones elsewhere (and without a GPU, as in --dry-run); the modifiers' instantiation
    for a window or block mask, the plain one otherwise. The warp-specialized forward's computing
    warpgroups each visit their own 64 rows' key tiles (attention_fwd_ws.cu)."""
    mods = (
        None
        if window is None
        else _modifiers.resolve(np, BF16, (case.b, case.h), case.n, case.n, window=window, block_mask=block_mask)
    )
    features = Features.of("fwd" if kernel == "fwd" else "bwd", BF16, case.d, case.d, case.causal, mods)
    variant = tile_policy.dense(features, _compile.current_device())
    t = variant.tiles(kernel)
    return (WS_WARPGROUP_ROWS if variant.path == "ws" else t.rows), t.block


def visited_area(case, kernel, *, window=None, block_mask=None):
    """Score elements (rows x block per visited tile) kernel ``kernel`` covers, summed over B and H."""
    rows, block = kernel_tiles(case, kernel, window=window, block_mask=block_mask)
    n = case.n
    starts = np.arange(0, n, rows)
    ranges = _query_tiles if kernel == "dkdv" else _key_tiles
    first, end = ranges(starts, n, rows, block, case.causal, window)
    tiles = np.arange(-(-n // block))
    visit = (tiles[None, :] >= first[:, None]) & (tiles[None, :] < end[:, None])  # (CTAs, tiles)
    if block_mask is None:
        return int(visit.sum()) * rows * block * case.b * case.h
    r, c = starts // BLOCK_MASK_TILE, tiles * block // BLOCK_MASK_TILE
    # tile_on(row block of the CTA, column of the tile); the dK/dV pass's CTAs own keys, its tiles queries
    grid = np.swapaxes(block_mask, -1, -2) if kernel == "dkdv" else block_mask
    on = grid[..., r[:, None], c[None, :]]
    entries = math.prod(block_mask.shape[:-2])
    return int((visit & on).sum()) * rows * block * (case.b * case.h // entries)


def band(window, causal):
    """``window`` with causal folded in as its right edge, as the modifiers' kernels take it (the library's
    own rule: _modifiers.Modifiers.window_with_causal)."""
    return _modifiers.Modifiers(tuple(window), 0.0, None, None, None, None, None).window_with_causal(causal)


def visited_flops(case, *, window=None, block_mask=None):
    """(forward FLOPs, backward FLOPs, areas per kernel) counted on visited tiles (module docstring)."""
    if window is not None:  # the HAS_MODS kernels get causal as the window's right edge
        window = band(window, case.causal)
    areas = {k: visited_area(case, k, window=window, block_mask=block_mask) for k in ("fwd", "dkdv", "dq")}
    d = case.d
    return 4 * d * areas["fwd"], ba.BWD_FLOPS_FACTOR * 4 * d * (areas["dkdv"] + areas["dq"]) / 2, areas


# ---------------------------------------------------------------------------------------------------------
# Options and backends


def alibi_slopes(h):
    return (2.0 ** (-8.0 * (np.arange(h) + 1) / h)).astype(np.float32)


def random_bf16(shape, xp, seed):
    """Standard-normal bf16 values; on the GPU drawn one (N, N) plane at a time (no huge float32 copy)."""
    if xp is np:
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(BF16)
    bits = cupy.empty(shape, dtype=cupy.uint16)
    planes = bits.reshape(-1, shape[-2] * shape[-1])
    rng = cupy.random.default_rng(seed)
    x = cupy.empty(planes.shape[1], dtype=cupy.float32)
    for i in range(planes.shape[0]):  # float32 -> bfloat16 by its upper 16 bits (rounds toward zero)
        rng.standard_normal(x.size, dtype=cupy.float32, out=x)
        planes[i] = (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
    return bits.view(BF16)


def make_options(row, b, h, n, xp, seed=SEED):
    """The score-modifier keywords of ``row``'s kind for a (b, h, n, n) problem, arrays of module xp."""
    if row.group == "bias":
        shape = (b, h, n, n) if row.kind == "bias-full" else (1, 1, n, n)
        return {"bias": random_bf16(shape, xp, seed + 1)}
    if row.group == "window":
        return {"window": WINDOW}
    if row.group == "softcap":
        return {"softcap": SOFTCAP}
    if row.group == "alibi":
        return {"alibi_slopes": xp.asarray(alibi_slopes(h))}
    if row.group == "block-mask":
        p = row.info["offdiagonal_probability"]
        if n == row.case.n and h == row.case.h:
            mask = row.block_mask
        else:  # the reduced validation problem: the same tile probability
            nb = math.ceil(n / BLOCK_MASK_TILE)
            mask = np.random.default_rng(seed).random((1, h, nb, nb)) < p
            mask[..., np.arange(nb), np.arange(nb)] = True
        return {"block_mask": xp.asarray(mask)}
    return {}


class Ours:
    """cupyflash with score-modifier options (bench_attention.Ours takes none)."""

    def __init__(self, q, k, v, dout, causal, scale, options):
        self.q, self.k, self.v, self.dout = q, k, v, dout
        self.kw = dict(causal=causal, scale=scale, **options)

    def forward(self):
        return cupyflash.attention(self.q, self.k, self.v, **self.kw)

    def prepare_backward(self):
        self.saved = cupyflash.attention_forward(self.q, self.k, self.v, **self.kw)

    def backward(self):  # (dq, dk, dv) or (dq, dk, dv, dbias)
        return cupyflash.attention_backward(self.dout, self.q, self.k, self.v, *self.saved, **self.kw)


def torch_bias_backend(peer, q, k, v, dout, causal, scale, bias, bias_grad):
    """torch SDPA backend ``peer`` with ``bias`` as its float attn_mask (bench_attention.TorchSDPA plus a
    mask); with ``bias_grad`` the mask requires grad and backward() returns its gradient fourth."""

    class TorchBias(ba.TorchSDPA):
        def __init__(self):
            super().__init__(peer, q, k, v, dout, causal, scale)
            self.bias = ba.torch.from_dlpack(bias)

        def _sdpa(self, q, k, v, bias=None):
            with ba.sdpa_kernel([self.backend]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return ba.F.scaled_dot_product_attention(
                    q, k, v, attn_mask=self.bias if bias is None else bias, is_causal=self.causal, scale=self.scale
                )

        def prepare_backward(self):
            self.leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
            mask = self.bias
            if bias_grad:
                mask = self.bias.detach().requires_grad_()
                self.leaves.append(mask)
            self.out = self._sdpa(*self.leaves[:3], mask)

    return TorchBias()


class FlexWindow(ba.TorchSDPA if ba.torch is not None else object):
    """torch FlexAttention with ``window`` (and ``causal``, its right edge) as a mask_mod, turned into a block
    mask, so that tiles outside the band are skipped as ours are; compiled (torch.compile) as FlexAttention
    is meant to run. forward() / prepare_backward() / backward() are bench_attention.TorchSDPA's, around
    _sdpa."""

    _compiled = None

    def __init__(self, q, k, v, dout, causal, scale, window):  # (not TorchSDPA's: no SDPA backend here)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch = ba.torch
        if FlexWindow._compiled is None:
            FlexWindow._compiled = torch.compile(flex_attention, dynamic=False)
        self.q, self.k, self.v, self.dout = (torch.from_dlpack(x) for x in (q, k, v, dout))
        nq, nk = self.q.shape[-2], self.k.shape[-2]
        left, right = band(window, causal)
        offset = nk - nq  # bottom-right alignment, as cupyflash's window and causal

        def keep(b, h, i, j):  # key j of query i: i + offset - left <= j <= i + offset + right
            rel = j - i - offset
            seen = rel == rel
            if left >= 0:
                seen = seen & (rel >= -left)
            if right >= 0:
                seen = seen & (rel <= right)
            return seen

        self.block_mask = create_block_mask(keep, None, None, nq, nk, device=self.q.device)
        self.scale = scale

    def _sdpa(self, q, k, v):
        return FlexWindow._compiled(q, k, v, block_mask=self.block_mask, scale=self.scale)


def make_backend(name, q, k, v, dout, causal, scale, options, bias_grad=True):
    if name == "ours":
        return Ours(q, k, v, dout, causal, scale, options)
    if ba.torch is None:
        raise RuntimeError("torch is not importable")
    if name == "flex":
        return FlexWindow(q, k, v, dout, causal, scale, options["window"])
    return torch_bias_backend(name, q, k, v, dout, causal, scale, options["bias"], bias_grad)


# ---------------------------------------------------------------------------------------------------------
# Validation: once per (kind of row, backend), on a reduced problem, against the float64 reference


def validation_problem(row):
    """Host q, k, v, dout (1, 2, n, D) bf16 and the row kind's options (NumPy), for the reduced problem."""
    n = VALIDATION_N_BANDED if row.group in ("window", "block-mask") else VALIDATION_N
    rng = np.random.default_rng(SEED + 2)
    shape = (1, VALIDATION_HEADS, n, HEAD_DIM)
    q, k, v, dout = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    if row.group == "softcap":
        q *= SOFTCAP_VALIDATION_Q_STD
    arrays = [x.astype(BF16) for x in (q, k, v, dout)]
    return arrays, make_options(row, 1, VALIDATION_HEADS, n, np)


def validate(row, name, cache):
    """{"status": ok | bad | n/a | OOM, fwd/bwd errors, "bias_grad", "note"}, cached per (kind, backend).

    Torch peers are tried with the bias gradient first and, if that raises or is wrong, without it."""
    key = (row.kind, name)
    if key in cache:
        return cache[key]
    (q, k, v, dout), options = validation_problem(row)
    scale = HEAD_DIM**-0.5
    causal = row.case.causal
    want_out = reference.attention(q, k, v, causal=causal, scale=scale, **options)
    want_grads = reference.attention_backward(dout, q, k, v, causal=causal, scale=scale, **options)
    device = [cupy.asarray(x) for x in (q, k, v, dout)]
    dev_options = {key_: cupy.asarray(x) if isinstance(x, np.ndarray) else x for key_, x in options.items()}
    tol = ba.TOLERANCES[DTYPE]
    notes = []
    result = None
    for bias_grad in (True, False) if name in PEERS else (True,):  # the bias peers: with dbias, else without
        attempt = f"{'with' if bias_grad else 'without'} the bias gradient: " if name in PEERS else ""
        try:
            backend = make_backend(name, *device, causal, scale, dev_options, bias_grad)
            fwd_err = ba.rel_err(ba.to_float64(backend.forward()), want_out)
            backend.prepare_backward()
            grads = [ba.to_float64(g) for g in backend.backward()]
            if len(grads) != len(want_grads) and not (name in PEERS and not bias_grad):
                raise RuntimeError(f"backward returned {len(grads)} gradients, expected {len(want_grads)}")
            bwd_err = max(ba.rel_err(g, w) for g, w in zip(grads, want_grads))
        except Exception as exc:
            status = "OOM" if ba.is_oom(exc) else "n/a"
            result = {"status": status, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            notes.append(attempt + result["error"])
            continue
        finally:
            backend = None
            ba.release_memory()
        ok = fwd_err <= tol and bwd_err <= tol * ba.GRAD_TOLERANCE_FACTOR
        result = {"status": "ok" if ok else "bad", "fwd_err": fwd_err, "bwd_err": bwd_err, "bias_grad": bias_grad}
        if ok or fwd_err > tol:
            break
        notes.append(f"{attempt}gradient error {bwd_err:.2e}")
    if name != "ours" and result.get("status") == "ok" and not result["bias_grad"]:
        result["note"] = (
            f"torch {name} on {row.kind}: backward timed WITHOUT the bias gradient ("
            f"{notes[0].replace('with the bias gradient: ', 'with it: ', 1)})"
        )
    elif notes:
        result["note"] = f"{name} on {row.kind}: " + "; ".join(notes)
    cache[key] = result
    errs = f"fwd {result['fwd_err']:.1e} bwd {result['bwd_err']:.1e}" if "fwd_err" in result else result.get("error")
    print(f"  validate {row.kind:15} {name:10} {result['status']:4} ({errs})", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------------
# Speed


def run_row(row, args, flush, cache):
    case = row.case
    q, k, v, dout = ba.inputs_for(case)
    scale = case.d**-0.5
    result = describe(row)
    result.update(validation={}, fwd={}, bwd={})
    names = ["ours"] + [p for p in row.peers if ba.torch is not None and not args.no_torch]
    options = None
    for name in names:
        check = result["validation"][name] = validate(row, name, cache)
        if check["status"] != "ok":
            result["fwd"][name] = result["bwd"][name] = {"status": check["status"]}
            continue
        if options is None:
            options = make_options(row, case.b, case.h, case.n, cupy)
        for phase in ("fwd", "bwd"):
            backend = None
            try:
                backend = make_backend(name, q, k, v, dout, case.causal, scale, options, check["bias_grad"])
                if phase == "fwd":
                    ms = ba.median_ms(backend.forward, args, flush)
                else:
                    backend.prepare_backward()
                    ms = ba.median_ms(backend.backward, args, flush)
                flops = row.flops_fwd if phase == "fwd" else row.flops_bwd
                result[phase][name] = {"status": "ok", "ms": ms, "tflops": flops / ms / 1e9}
            except Exception as exc:
                result[phase][name] = {
                    "status": "OOM" if ba.is_oom(exc) else "n/a",
                    "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                }
            finally:
                backend = None
                ba.release_memory()
    options = None
    ba.release_memory()
    cells = "  ".join(f"{n} {_ms(result['fwd'][n])}/{_ms(result['bwd'][n])}" for n in names)
    print(f"{row.name:22} fwd/bwd ms: {cells}", flush=True)
    return result


def describe(row):
    c = row.case
    return {
        "name": row.name,
        "group": row.group,
        "kind": row.kind,
        "dtype": DTYPE,
        "b": c.b,
        "h": c.h,
        "n": c.n,
        "d": c.d,
        "causal": c.causal,
        "options": row.options,
        "flops_fwd": row.flops_fwd,
        "flops_bwd": row.flops_bwd,
        "flops_counted_on": row.counted,
        "target": row.target,
        "compare": [{"against": a, "how": how, "flops_fwd": ff, "flops_bwd": fb} for a, how, ff, fb in row.compare],
        **_jsonable(row.info),
    }


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return x


def add_ratios(results):
    """Each row's ratios against what it is compared with (same order as Row.compare):

    peer    time(peer) / time(ours)               > 1: ours faster
    time    time(baseline row) / time(ours)        block mask: dense / sparse
    tflops  ours TFLOP/s / baseline TFLOP/s, the baseline's FLOPs counted as given (visited tiles for
            the window row), so that both sides are counted alike
    """
    by_name = {r["name"]: r for r in results}
    for r in results:
        r["ratios"] = []
        for i, comp in enumerate(r["compare"]):
            entry = {"against": comp["against"], "how": comp["how"], "target": r["target"] if i == 0 else None}
            for phase in ("fwd", "bwd"):
                ours = r[phase].get("ours", {})
                if comp["how"] == "peer":
                    other = r[phase].get(comp["against"], {"status": "-"})
                else:
                    base = by_name.get(comp["against"])
                    other = base[phase].get("ours", {"status": "-"}) if base else {"status": "-"}
                entry[f"{phase}_against"] = other
                value = None
                if ours.get("status") == "ok" and other.get("status") == "ok":
                    if comp["how"] == "tflops":
                        mine = r[f"flops_{phase}"] / ours["ms"]
                        theirs = comp[f"flops_{phase}"] / other["ms"]
                        value = mine / theirs
                        entry[f"{phase}_against_tflops"] = theirs / 1e9
                    else:
                        value = other["ms"] / ours["ms"]
                        entry[f"{phase}_against_tflops"] = other.get("tflops")
                entry[phase] = value
                if entry["target"] is not None and value is not None:
                    entry[f"{phase}_verdict"] = "PASS" if value >= entry["target"] else "MISS"
            r["ratios"].append(entry)


def _ms(entry):
    return f"{entry['ms']:.3f}" if entry.get("status") == "ok" else entry.get("status", "?")


def _pair(entry, tflops=None):
    """'ms TFLOP/s' for the table, or the status."""
    if entry.get("status") != "ok":
        return f"{entry.get('status', '-'):>16}"
    tf = entry["tflops"] if tflops is None else tflops
    return f"{entry['ms']:8.3f} {tf:7.1f}" if tf is not None else f"{entry['ms']:8.3f} {'':>7}"


def _ratio(entry, phase):
    value = entry.get(phase)
    if value is None:
        return f"{'-':>10}"
    verdict = entry.get(f"{phase}_verdict")
    return f"{value:5.2f} {verdict}" if verdict else f"{value:10.2f}"


def print_table(results):
    print(
        "\nms and TFLOP/s (window and block-mask rows, and the plain causal kernel in the window ratio, "
        "counted on visited tiles)"
    )
    header = (
        f"{'row':20} | {'ours fwd ms  TF/s':>16} | {'ours bwd ms  TF/s':>16} | {'against':18} | "
        f"{'its fwd ms  TF/s':>16} | {'its bwd ms  TF/s':>16} | {'ratio fwd':>10} | {'ratio bwd':>10} | "
        "target"
    )
    print(header)
    print("-" * len(header))
    blank = " " * 16
    for r in results:
        ours = [_pair(r[p].get("ours", {"status": "-"})) for p in ("fwd", "bwd")]
        if not r["ratios"]:
            print(f"{r['name']:20} | {ours[0]} | {ours[1]} |")
        for i, e in enumerate(r["ratios"]):
            first = i == 0
            theirs = [_pair(e[f"{p}_against"], e.get(f"{p}_against_tflops")) for p in ("fwd", "bwd")]
            label = e["against"]
            if e["how"] == "peer" and not r["validation"].get(label, {}).get("bias_grad", True):
                label += " no dbias"
            target = f">= {e['target']:g}" if e["target"] is not None else ""
            mine = ours if first else [blank, blank]
            print(
                f"{r['name'] if first else '':20} | {mine[0]} | {mine[1]} | {label[:18]:18} | {theirs[0]} | "
                f"{theirs[1]} | {_ratio(e, 'fwd')} | {_ratio(e, 'bwd')} | {target}"
            )
    print("'no dbias': that torch backend's backward was timed without the bias gradient (see the notes)")
    print(
        "ratios: vs a torch peer time(peer)/time(ours); vs plain rows time(plain)/time(ours), except window, "
        "softcap and alibi: TFLOP/s / TFLOP/s (window: both counted on visited tiles); block mask: "
        "time(dense)/time(sparse)"
    )


def print_window_scaling(results):
    windows = [r for r in results if r["group"] == "window"]
    by_name = {r["name"]: r for r in results}
    if not windows:
        return
    print(f"\nwindow {WINDOW} causal vs N (B·N = 16384 tokens in all: the band's cost stays flat, causal grows with N)")
    print(
        f"{'N':>6} {'B':>3} | {'window fwd ms':>13} {'bwd ms':>8} | {'causal fwd ms':>13} {'bwd ms':>8} | "
        f"{'visited GFLOP fwd/bwd':>22} | {'band pairs/visited':>18}"
    )
    for r in windows:
        base = by_name.get(r["compare"][0]["against"], {"fwd": {}, "bwd": {}})
        cells = [_ms(x.get("ours", {"status": "-"})) for x in (r["fwd"], r["bwd"], base["fwd"], base["bwd"])]
        share = r["band_pairs"] / r["visited_area"]["fwd"]
        print(
            f"{r['n']:>6} {r['b']:>3} | {cells[0]:>13} {cells[1]:>8} | {cells[2]:>13} {cells[3]:>8} | "
            f"{r['flops_fwd'] / 1e9:10.1f} / {r['flops_bwd'] / 1e9:9.1f} | {share:18.2f}"
        )


def add_window_floors(results, args):
    """Each window row's DRAM floor (dram_floor.py: the fastest kernel that only reads the call's inputs
    and writes its outputs, GPU time after an L2 flush whatever --timing says, so the floor is never
    overstated) and the time its target asks (the row's time scaled by ratio / target). Below the floor,
    no kernel meets the target on this GPU. One measurement per problem size."""
    floors = {}
    for r in results:
        if r["group"] != "window" or not r["ratios"]:
            continue
        elements = r["b"] * r["h"] * r["n"] * r["d"]
        if elements not in floors:
            flush = ba.L2Flush("gpu")
            floors[elements] = dram_floor.attention_floors(
                elements, np.dtype(BF16).itemsize, lambda fn: ba.median_ms(fn, args, flush)
            )
        entry, r["dram_floor"] = r["ratios"][0], {}
        for phase in ("fwd", "bwd"):
            ours, ratio = r[phase].get("ours", {}), entry.get(phase)
            floor = dict(floors[elements][phase])
            if ours.get("status") == "ok" and ratio is not None:
                floor["target_ms"] = dram_floor.time_at_target(ours["ms"], ratio, entry["target"])
                floor["target_over_floor"] = floor["target_ms"] / floor["ms"]
                floor["ours_over_floor"] = ours["ms"] / floor["ms"]
            r["dram_floor"][phase] = floor


def print_window_floors(results):
    windows = [r for r in results if r.get("dram_floor")]
    if not windows:
        return
    print(
        "\nwindow rows against this GPU's DRAM: floor = the fastest kernel that only reads q, k, v and writes "
        "out (fwd), or reads q, k, v, out, dout and writes dq, dk, dv (bwd); target = the time the row's "
        "target asks"
    )
    print(
        f"{'N':>6} | {'fwd MB':>6} {'floor ms':>8} {'TB/s':>5} {'target ms':>9} {'target/floor':>12} "
        f"{'ours/floor':>10} | {'bwd MB':>6} {'floor ms':>8} {'TB/s':>5} {'target ms':>9} {'target/floor':>12} "
        f"{'ours/floor':>10}"
    )
    below = False
    for r in windows:
        cells = []
        for phase in ("fwd", "bwd"):
            f = r["dram_floor"][phase]
            if "target_ms" in f:
                below |= f["target_over_floor"] < 1
                tail = f"{f['target_ms']:9.4f} {f['target_over_floor']:12.2f} {f['ours_over_floor']:10.2f}"
            else:
                tail = f"{'-':>9} {'-':>12} {'-':>10}"
            cells.append(f"{f['bytes'] / 1e6:6.0f} {f['ms']:8.4f} {f['tb_per_s']:5.2f} {tail}")
        print(f"{r['n']:>6} | {cells[0]} | {cells[1]}")
    if below:
        print("target/floor < 1: the target asks for less time than moving the call's bytes takes on this GPU")


def print_notes(cache):
    notes = [check["note"] for check in cache.values() if check.get("note")]
    for note in notes:
        print(f"note: {note}")
    return notes


# ---------------------------------------------------------------------------------------------------------
# Dry run and main


def dry_run(rows):
    window_case = ba.Case(DTYPE, HEAD_DIM, WINDOW_SEQLENS[0], True)
    print(
        f"{len(rows)} rows, bf16, D = {HEAD_DIM}; tiles (rows x block) on this device, plain causal / window: "
        + ", ".join(
            f"{k} {t[0]}x{t[1]} / {w[0]}x{w[1]}"
            for k in ("fwd", "dkdv", "dq")
            for t, w in [(kernel_tiles(window_case, k), kernel_tiles(window_case, k, window=WINDOW))]
        )
    )
    header = (
        f"{'row':20} {'B':>3} {'H':>3} {'N':>6} {'causal':>6}  {'options':40} {'fwd GFLOP':>10} "
        f"{'bwd GFLOP':>10}  {'counted on':13} against (target)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        c = r.case
        against = ", ".join(a for a, *_ in r.compare) or "-"
        target = f" (>= {r.target:g})" if r.target is not None else ""
        print(
            f"{r.name:20} {c.b:>3} {c.h:>3} {c.n:>6} {'yes' if c.causal else 'no':>6}  {r.options:40} "
            f"{r.flops_fwd / 1e9:10.1f} {r.flops_bwd / 1e9:10.1f}  {r.counted:13} {against}{target}"
        )
    for r in rows:
        if r.group == "window":
            i = r.info
            base_fwd, base_bwd = i["plain_causal_visited_flops_fwd"], i["plain_causal_visited_flops_bwd"]
            print(
                f"{r.name}: visited area fwd/dkdv/dq {i['visited_area']} (band's exact pairs "
                f"{i['band_pairs']}); its plain causal baseline counted on visited tiles: "
                f"{base_fwd / 1e9:.1f} / {base_bwd / 1e9:.1f} GFLOP (convention: "
                f"{r.case.flops_fwd / 1e9:.1f} / {r.case.flops_bwd / 1e9:.1f})"
            )
        if r.group == "block-mask":
            print(
                f"{r.name}: {r.info['density']:.2%} of tiles on (off-diagonal p = "
                f"{r.info['offdiagonal_probability']:.4f}), visited area {r.info['visited_area']}"
            )


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 2k only (block mask too: B = 8, H = 16)")
    parser.add_argument(
        "--rows",
        metavar="REGEX",
        help="only rows whose name matches (re.search), plus the plain rows they are compared with",
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (>= 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--timing",
        choices=ba.TIMINGS,
        default="call",
        help="as bench_attention.py: call (host time beyond the L2 flush counts) or gpu",
    )
    parser.add_argument("--no-torch", action="store_true", help="time ours only, even when torch is importable")
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the rows, shapes and FLOP counts, then stop (no GPU needed)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error("--repeats must be >= 20")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = build_rows(args)
    if args.dry_run:
        dry_run(rows)
        return
    results = {
        "environment": ba.environment(),
        "settings": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "timing": args.timing,
            "quick": args.quick,
            "rows": args.rows,
            "torch": ba.torch is not None and not args.no_torch,
        },
    }
    for key, value in results["environment"].items():
        print(f"{key:10} {value}")
    if ba.torch is None or args.no_torch:
        print("torch not used: ours only")
    print(
        f"\n{len(rows)} rows, {args.repeats} repeats after {args.warmup} warm-up calls, L2 flushed before each, "
        f"timing {args.timing}"
    )
    flush = ba.L2Flush(args.timing)
    cache = {}
    results["rows"] = [run_row(row, args, flush, cache) for row in rows]
    add_ratios(results["rows"])
    print_table(results["rows"])
    print_window_scaling(results["rows"])
    add_window_floors(results["rows"], args)
    print_window_floors(results["rows"])
    results["notes"] = print_notes(cache)
    results["validation"] = [{"kind": kind, "backend": name, **check} for (kind, name), check in cache.items()]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=_jsonable))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
