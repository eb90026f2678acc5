"""The records of kernel choice: ``Variant`` (one NVRTC module, or the backward's two), ``Features`` (what of a
call decides its variant) and ``Device`` (what the device offers). Which variant serves a call, and which ship:
cupyflash/_cuda/tile_policy.py.

A variant's kernels are template instantiations whose parameters come from the variant and from its
cells of the tile table (``tiles.py``); ``name_expression`` spells them for NVRTC's ``name_expressions``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from cupyflash._arrays import round_up
from cupyflash._cuda import tiles
from cupyflash._cuda.source import OPTIONS, WGMMA_ARCH, module_code
from cupyflash._cuda.tiles import Tiles

DTYPES = ("float16", "bfloat16", "float32", "float64")
CTYPES = {
    "float16": "half_t",
    "bfloat16": "bfloat16_t",
    "float32": "float",
    "float64": "double",
    "float8_e4m3": "e4m3_t",
}
ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3": 1}
FP8 = "float8_e4m3"  # the FP8 forward's inputs (cupyflash/_cuda/fp8.py); its out is one of FP8_OUT_DTYPES
FP8_OUT_DTYPES = ("bfloat16", "float16")
# Unrounded results: out (forward) or dq, dk, dv (backward) of 16-bit inputs in float32, the accumulator's dtype
# (attention_forward(out_dtype=...), attention_backward(grad_dtype=...)), stored from the registers.
WIDE = "float32"
_SOURCES = {"fwd": "attention_fwd.cu", "bwd": "attention_bwd.cu", "probs": "attention_probs.cu"}
_WS_SOURCE = "attention_fwd_ws.cu"
_WS_BWD_SOURCE = "attention_bwd_ws.cu"  # the fused backward and its dq conversion; its preprocess is the two passes'
DQ_CONVERT_THREADS = 256  # attention_bwd_dq_convert_kernel: a thread per accumulator thread of two warpgroups
PATHS = ("mma", "large", "wgmma", "pieces", "ws")
HOPPER_PATHS = ("wgmma", "pieces", "ws")  # compiled for sm_90a: compute capability 9.0 alone
# The score modifiers a kernel is compiled for (cuda_src/mods.cuh, enum Mods): none; scalars (window,
# softcap, ALiBi, the backward's block mask: a few numbers per batch entry); softcap (the backward of a
# softcap alone) and window (a window alone), where every other option is a compile-time constant; all
# (also bias, mask and the forward's block mask; packed batches and attention_probs).
MODS = ("none", "scalars", "softcap", "window", "all")
# The forward's forms of the scores: bounded (bfloat16, a softcap without ALiBi: 1 is every row's max),
# alibi (the warp-specialized forward's ALiBi, its slope split into row and column terms) and
# alibi_half_first (that, where the window has a right edge: a tile's first key block over half its keys).
SCORES = ("plain", "bounded", "alibi", "alibi_half_first")
# Softcapped scores are tanh values in [-1, 1]. Without ALiBi, exp2(c * (t - 1)) with c = softcap * log2(e)
# is at least 2^(-2c), a normal float for c <= 62 (exponentials flush to zero below 2^-126), which leaves a
# factor 2^2 for the rounding of c and of tanh: up to this softcap the bfloat16 forward is ``bounded``.
BOUNDED_SOFTCAP_MAX = 62.0 * math.log(2.0)
_BOOL = {True: "true", False: "false"}


@dataclass(frozen=True)
class Variant:
    """One compiled module (the backward: two). ``path``: one of PATHS (tiles.py). ``mods``: one of MODS;
    with modifiers ``causal`` travels as the window's right edge and is False here, except in the softcap's
    own backward, which takes it as the plain kernels do. ``score``: one of SCORES (forwards).
    ``block_mask``: the warp-specialized forward's walk of a block mask (other kernels skip block-mask
    tiles in their ``all`` form, and the backward in ``scalars`` too). ``deterministic``: False for the fused
    backward whose dq adds land in any order (``attention_backward(deterministic=False)``); True elsewhere.
    ``out_dtype``: the FP8 forward's out, or WIDE (16-bit inputs, out or dq, dk, dv unrounded in float32:
    ``attention_forward(out_dtype=...)``, ``attention_backward(grad_dtype=...)``); "" where the results are in
    the inputs' dtype."""

    direction: str  # "fwd", "bwd" or "probs"
    dtype: str  # one of DTYPES
    head_dim: int  # HEAD_DIM: one of tiles.HEAD_DIMS
    path: str = "mma"
    mods: str = "none"
    causal: bool = False
    dropout: bool = False
    score: str = "plain"
    block_mask: bool = False
    out_dtype: str = ""  # the results' dtype where it is not the inputs' (the FP8 forward's out; WIDE's)
    deterministic: bool = True

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype]

    @property
    def wide(self) -> bool:
        """Whether its results are unrounded: float32 from 16-bit inputs."""
        return self.out_dtype == WIDE

    @property
    def results(self) -> str:
        """The C++ type of its results: out (forward) or dq, dk, dv (backward)."""
        return CTYPES[self.out_dtype or self.dtype]

    @property
    def form(self) -> str:
        """The tile table's column."""
        base = {"none": "plain", "all": "all", "scalars": "scalars", "softcap": "scalars", "window": "window"}[
            self.mods
        ]
        if self.dropout:
            return "dropout" if base == "plain" else base + "+dropout"
        return base

    @property
    def fused_backward(self) -> bool:
        """The warp-specialized fused backward (one pass over the queries, dq through a float32 accumulator)."""
        return self.direction == "bwd" and self.path == "ws"

    @property
    def kernels(self) -> tuple[str, ...]:
        if self.fused_backward:
            return ("preprocess", "bwd", "dq_convert")
        return {"fwd": ("fwd",), "probs": ("probs",)}.get(self.direction, ("preprocess", "dkdv", "dq"))

    @property
    def modules(self) -> tuple[tuple[str, ...], ...]:
        """The kernels grouped into the modules NVRTC compiles: the backward's passes in two modules that
        compile concurrently (NVRTC runs without the GIL), which shortens its first call."""
        if self.fused_backward:  # the preprocess is attention_bwd.cu's
            return (("preprocess",), ("bwd", "dq_convert"))
        return {"fwd": (("fwd",),), "probs": (("probs",),)}.get(self.direction, (("preprocess", "dkdv"), ("dq",)))

    @property
    def sources(self) -> tuple[tuple[str, ...], ...]:
        """The kernels grouped by the source file they come from (``code``): one group, except the fused
        backward's, whose preprocess is the two passes'."""
        return self.modules if self.fused_backward else (self.kernels,)

    def tiles(self, kernel: str) -> Tiles:
        return tiles.lookup(self.path, self.itemsize, self.head_dim, kernel, self.form)

    def smem(self, kernel: str) -> int:
        """Dynamic shared memory of one kernel, in bytes."""
        if kernel == "preprocess":
            return 0
        return tiles.smem_bytes(self.path, self.itemsize, self.head_dim, kernel, self.tiles(kernel))

    def threads(self, kernel: str) -> int:
        if kernel == "dq_convert":
            return DQ_CONVERT_THREADS
        return 32 * tiles.PREPROCESS_WARPS if kernel == "preprocess" else self.tiles(kernel).threads

    def name_expression(self, kernel: str) -> str:
        """The kernel's template instantiation, as NVRTC's name_expressions take it."""
        c, hd, b = CTYPES[self.dtype], self.head_dim, _BOOL
        if kernel == "preprocess":
            lanes = tiles.preprocess_lanes(self.itemsize, hd)
            return f"attention_bwd_preprocess_kernel<{c}, {tiles.PREPROCESS_WARPS}, {lanes}>"
        t = self.tiles(kernel)
        wgmma = self.path in HOPPER_PATHS
        mods = f"Mods::{self.mods}"
        if kernel == "probs":
            return f"attention_probs_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {b[wgmma]}>"
        if kernel == "bwd":  # the fused backward: its dq adds in a fixed order per query block, or in any
            return (
                f"attention_bwd_ws_kernel<{c}, {hd}, {t.block}, {t.stages}, {b[self.causal]}, "
                f"{b[self.deterministic]}, {tiles.ws_bwd_dq_chains(t, self.deterministic)}, {b[t.paired]}, "
                f"{self.results}>"
            )
        if kernel == "dq_convert":
            chains = tiles.ws_bwd_dq_chains(t, self.deterministic)
            return (
                f"attention_bwd_dq_convert_kernel<{c}, {hd}, {t.block}, {b[self.causal]}, {chains}, {b[t.paired]}, "
                f"{self.results}>"
            )
        if kernel == "fwd" and self.path == "ws":  # the scalars there are a dense batch's (no cu_seqlens)
            mods = "Mods::dense_scalars" if self.mods == "scalars" else mods
            return (
                f"attention_fwd_ws_kernel<{c}, {hd}, {t.block}, {t.stages}, {b[self.causal]}, {mods}, "
                f"{b[self.score == 'bounded']}, {b[self.score.startswith('alibi')]}, "
                f"{b[self.score == 'alibi_half_first']}, {b[self.block_mask]}, {b[t.pack_after_wait]}, "
                f"{b[t.store_warps and not self.wide]}, {self.results}, {t.rows // tiles.WS_WARPGROUP_ROWS}, "
                f"{t.pv_cols}, {b[t.scores_first]}>"
            )
        if kernel == "fwd" and wgmma:  # no column chunks: the whole head dim per CTA
            return (
                f"attention_fwd_wgmma_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {b[self.causal]}, {mods}, "
                f"{b[self.dropout]}, {b[self.score == 'bounded']}, {t.ctas_per_sm}, {self.results}>"
            )
        if kernel == "fwd":
            return (
                f"attention_fwd_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {t.d_chunk}, {b[self.causal]}, "
                f"{mods}, {b[self.dropout]}, {self.results}>"
            )
        lse = f", {b[t.lse_by_copy]}" if kernel == "dkdv" else ""
        return (
            f"attention_bwd_{kernel}_kernel<{c}, {hd}, {t.num_warps}, {t.block}, {t.d_chunk}, {b[self.causal]}, "
            f"{mods}, {b[wgmma]}, {b[self.dropout]}, {b[t.paired]}, {b[t.pipelined]}, {b[t.across_turn]}{lse}, "
            f"{self.results}>"
        )

    def code(self, kernels: tuple[str, ...] | None = None) -> str:
        """The source of the module holding ``kernels`` (default: all of the variant's)."""
        kernels = kernels or self.kernels
        if self.fused_backward and "preprocess" not in kernels:
            filename = _WS_BWD_SOURCE
        else:
            filename = _WS_SOURCE if self.path == "ws" and self.direction == "fwd" else _SOURCES[self.direction]
        return module_code(filename, [self.name_expression(k) for k in kernels])

    @property
    def options(self) -> tuple[str, ...]:
        """NVRTC options. Hopper's modules name sm_90a; CuPy appends its own -arch=sm_90 after it, and
        NVRTC keeps the architecture-specific target."""
        return OPTIONS + ((f"-arch={WGMMA_ARCH}",) if self.path in HOPPER_PATHS else ())

    def compile_targets(self) -> dict[str, str]:
        """Architecture family -> the NVRTC target the variant is built for: Hopper's paths for sm_90a alone,
        the mma.sync path for every GPU (checked as sm_80 and sm_90), except where its shared memory
        exceeds what an sm_80 CTA may have."""
        if self.path in HOPPER_PATHS:
            return {"sm_90": WGMMA_ARCH}
        if max(self.smem(kernel) for kernel in self.kernels) > tiles.SM80_SMEM_BYTES:
            return {"sm_90": "sm_90"}
        return {"sm_80": "sm_80", "sm_90": "sm_90"}

    def __str__(self) -> str:
        """In words, e.g. ``fwd bfloat16 HEAD_DIM=128 causal (ws)``."""
        kind = "causal" if self.causal else "plain"
        if self.mods != "none":
            kind = {
                "scalars": "modifiers (window, softcap, ALiBi)",
                "softcap": "modifiers (softcap alone)",
                "window": "modifiers (window alone)",
                "all": "modifiers",
            }[self.mods]
            kind += ", causal" if self.causal else ""
        extras = (
            [self.path] + ([self.score] if self.score != "plain" else []) + (["block mask"] if self.block_mask else [])
        )
        out = f" -> {self.out_dtype}" if self.out_dtype else ""
        order = "" if self.deterministic else " unordered dq adds"
        return (
            f"{self.direction} {self.dtype}{out} HEAD_DIM={self.head_dim} {kind}"
            + (" dropout" if self.dropout else "")
            + order
            + f" ({', '.join(extras)})"
        )


@dataclass(frozen=True)
class Device:
    """What the device offers the selection: Hopper's paths (compute capability 9.0, unless
    CUPYFLASH_NO_WGMMA=1) and 227 KiB of shared memory per CTA (compute capability >= 9.0)."""

    wgmma: bool = False
    large_smem: bool = False


@dataclass(frozen=True)
class Features:
    """What of a call decides its variant. ``head_dim``: max(D, Dv) as the kernels read rows (row_width);
    ``window``: as given, causal apart; ``arrays``: a bias or a mask; ``tma``: whether the warp-specialized forward
    may serve (its tensor maps describe the inputs, its block-mask walk holds the key tiles); ``out_dtype``: WIDE
    where the call asks for unrounded results of 16-bit inputs, else ""."""

    direction: str
    dtype: str
    head_dim: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    arrays: bool = False
    block_mask: bool = False
    dropout: bool = False
    packed: bool = False
    tma: bool = True
    lengths: tuple[int, int] = (0, 0)  # (Nq, Nk) where the choice depends on them (the backward), else 0s
    deterministic: bool = True  # the backward's: False lets the fused backward add dq in any order
    out_dtype: str = ""

    @property
    def has_mods(self) -> bool:
        return self.window != (-1, -1) or self.softcap > 0 or self.alibi or self.arrays or self.block_mask

    @property
    def right_edge(self) -> bool:
        """Whether the window, causal folded in, bounds the keys on the right."""
        return self.causal or self.window[1] >= 0

    @classmethod
    def of(
        cls,
        direction: str,
        dtype,
        d: int,
        d_v: int,
        causal: bool,
        mods=None,
        dropout=None,
        packed: bool = False,
        lengths: tuple[int, int] = (0, 0),
        deterministic: bool = True,
        results=None,
    ) -> "Features":
        """The features of a call: ``mods`` a resolved cupyflash._modifiers.Modifiers or None, ``dropout``
        a cupyflash._dropout.Dropout or None, ``lengths`` (Nq, Nk) for a dense backward (the fused backward
        serves long sequences only), ``deterministic`` the backward's, ``results`` the dtype of its results
        (out, or dq, dk, dv; None: the inputs')."""
        name = dtype if isinstance(dtype, str) else numpy.dtype(dtype).name
        head_dim = max(row_width(d, name), row_width(d_v, name))
        lengths = tuple(int(n) for n in lengths)
        out_dtype = "" if results is None or numpy.dtype(results).name == name else numpy.dtype(results).name
        if mods is None:
            return cls(
                direction,
                name,
                head_dim,
                bool(causal),
                dropout=dropout is not None,
                packed=packed,
                lengths=lengths,
                deterministic=deterministic,
                out_dtype=out_dtype,
            )
        return cls(
            direction,
            name,
            head_dim,
            bool(causal),
            mods.window,
            mods.softcap,
            mods.alibi_slopes is not None,
            mods.bias is not None or mods.mask is not None,
            mods.block_mask is not None,
            dropout is not None,
            packed,
            lengths=lengths,
            deterministic=deterministic,
            out_dtype=out_dtype,
        )


def row_width(d: int, dtype: str) -> int:
    """A head dim of d elements as the kernels read rows: padded to a multiple of 16 bytes (cp.async's width;
    the padding is zeros)."""
    return round_up(d, 16 // ITEMSIZES[dtype])
