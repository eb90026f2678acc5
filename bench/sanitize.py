#!/usr/bin/env python3
"""Every shipped kernel variant under compute-sanitizer: memcheck, racecheck, initcheck and synccheck.

    python bench/sanitize.py                              # all four tools, in parallel, every variant
    python bench/sanitize.py --tools racecheck            # one tool
    python bench/sanitize.py --variants '^bwd/bf16/(64|128)/' --out /tmp/sanitize
    python bench/sanitize.py --all-rows                   # one table row per kernel instantiation

Variants are named
``{fwd,bwd,probs}/{fp16,bf16,fp32,fp64,fp8}/HEAD_DIM/PATH/FORM[/SCORE][/block-mask][/dropout][/unordered][/OUT]``
with PATH the tile table's path (mma, large, wgmma, pieces, ws), FORM plain, causal or the modifiers'
instantiation (scalars, softcap, softcap-causal, window, all) and OUT the dtype of the results where it is not the
inputs' (the FP8 forward's: ``fwd/fp8/HEAD_DIM/ws/{plain,causal}/{out-bf16,out-fp16}``; 16-bit inputs' unrounded
out or gradients: ``out-fp32``): every module of
cupyflash._cuda.tile_policy.shipped_variants() that the GPU at hand can run (Hopper's paths need compute
capability 9.0, and so does FP8; the large float64 tiles 9.0 or more, where they replace the mma ones).
``--variants`` is a regular expression searched in those names. Each variant runs through the public API,
with options chosen so that the API's own selection picks exactly that variant (checked before the run; a forward
also after it, against the kernels the call loaded), and CUPYFLASH_NO_WGMMA set to pick its path. The Hopper
forwards that stand in where tensor maps cannot read the inputs run with q shared along a batch dim.

How it works. This script first compiles the selected variants into CuPy's on-disk kernel cache, in
parallel, so that no sanitized process compiles. Then, for each tool, one ``compute-sanitizer --tool TOOL``
process runs this script's worker mode (``--worker``), which launches every selected variant on tiny
problems with head dim D = HEAD_DIM, so each kernel is exactly the variant named:

- plain and causal: q (2, 70, D), k and v (2, 90, D); forward, then (for bwd) backward;
- mods (and probs): q (1, 2, 150, D), k, v (1, 2, 270, D), two calls, so the block mask skips tiles and every
  dbias path runs: (a) causal with window (100, 20), ALiBi, a full bias (dbias by paired stores), a mask and
  a block mask with one tile off; (b) softcap 5, ALiBi, a bias broadcast over the heads (dbias by float32
  atomics, per-element logits) and a key-padding mask of shape (1, 1, 1, Nk);
- scalars, softcap, window (and the warp-specialized forward's score forms and block-mask walk): the same
  shapes, with the options that pick the form (window (100, 20) and ALiBi; softcap 5 and ALiBi; a softcap
  alone; a window alone; with a block mask of one tile off where the form walks one);
- a packed variable-length batch where the API sends one to the variant (scalars; all with dropout):
  sequences of 0, 70, 1, 150 queries and 90, 0, 40, 270 keys, 2 heads sharing one key/value head, causal
  with ALiBi;
- dropout variants: the same calls with dropout_p = 0.2;
- unrounded results (out-fp32): the same calls with out_dtype (forward) or grad_dtype (backward) float32;
- the fused backward (path ws, and its unordered form): q (2, 3, 333, D), k and v (2, 3, 397, D) with its length
  thresholds lowered, twice: key blocks adding in the order they reach a query block, then in index order (the
  unordered form walks by arrival both times: the library never walks it in index order);
- FP8 (forward only: there is no FP8 backward): q, k, v quantized by ``quantize_fp8`` on the host, then
  ``attention_forward`` with the variant's causal and out_dtype, twice: the plain and causal shapes with one
  descale per slice (``block=None``), then q (1, 2, 150, D), k and v (1, 2, 270, D) with ``block=128``, so that
  the kernel reads descales per row block (q's 2, k's and v's 3, the last ones partial) and rescales its sum
  where v's changes. Each call also runs the pass that writes V^T (``fp8_values_transposed``).

The worker turns CuPy's memory pool off, so every array is its own cudaMalloc: memcheck then knows each
array's exact bounds (with ``--padding`` bytes of guard after each allocation), and initcheck sees fresh,
uninitialized memory. Inputs are made on the host, so the only kernels are ours (and CuPy's few copies,
fills and casts inside cupyflash, reported under "other"). The worker prints ``RAN <kernel>`` for each
kernel of a variant that completed.

The sanitizer's report (``--log-file``) is parsed: its summary (``ERROR SUMMARY: N errors``, or for racecheck
``RACECHECK SUMMARY: ... (E errors, W warnings)``) is the count of record; each reported error is attributed
to the kernel named in it (template arguments normalized), and what cannot be attributed is counted as
"other". The table gives errors per kernel and tool; exit status 1 on any error, a worker failure or a
missing summary, 2 when compute-sanitizer is not found. Racecheck warnings are listed and fail the run only
with ``--strict``.

Logs: ``OUT/TOOL.sanitizer.log`` (the tool's report) and ``OUT/TOOL.worker.log`` (the worker's output). Runtime: tiny
problems, so the time goes to loading and instrumenting ~310 modules per tool (~520 on Hopper); racecheck is the
slowest. Split the work with ``--tools`` or ``--variants`` if a run must fit a time limit.
"""

import argparse
import collections
import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "float8_e4m3": "fp8"}
# fp8_values_transposed: the FP8 forward's pass that writes V^T before its kernel (cupyflash/_cuda/fp8.py).
KERNEL_FAMILIES = (
    "attention_fwd_kernel",
    "attention_fwd_wgmma_kernel",
    "attention_fwd_ws_kernel",
    "attention_bwd_preprocess_kernel",
    "attention_bwd_dkdv_kernel",
    "attention_bwd_dq_kernel",
    "attention_probs_kernel",
    "split_f32_kernel",
    "attention_bwd_ws_kernel",
    "attention_bwd_dq_convert_kernel",
    "fp8_values_transposed",
)
OTHER = "other (CuPy kernels, API calls, unattributed)"
TOOL_VARIABLE = "CUPYFLASH_SANITIZER_TOOL"  # tells the worker which tool runs it
PLAIN_SHAPE = dict(batch=(2,), nq=70, nk=90)
# The fused backward, its length thresholds lowered: several key blocks and query blocks, partial ones at the end.
FUSED_SHAPE = dict(batch=(2, 3), nq=333, nk=397)
MODS_SHAPE = dict(batch=(1, 2), nq=150, nk=270)  # 2 x 3 block-mask tiles; Nk even for paired dbias stores
# The FP8 forward's calls: (shape, quantize_fp8's block). One descale per slice on the plain shapes; then blocks
# of 128 rows (the smallest allowed) on the modifiers' shapes, so that q has 2 row blocks and k, v 3, the last
# ones partial: the kernel then looks up a descale per warpgroup and key block and rescales its sum between v's.
FP8_CALLS = ((PLAIN_SHAPE, None), (MODS_SHAPE, 128))


# ============================================================================= variants
def variant_label(variant):
    form = variant.mods if variant.mods != "none" else "plain"
    if variant.causal:
        form = "causal" if variant.mods == "none" else form + "-causal"
    extras = ([variant.score] if variant.score != "plain" else []) + (["block-mask"] if variant.block_mask else [])
    extras += ["dropout"] if variant.dropout else []
    extras += [] if variant.deterministic else ["unordered"]
    # The FP8 forward's out dtype is its own compile-time choice: without it two variants would share a label.
    extras += [f"out-{DTYPE_NAMES[variant.out_dtype]}"] if variant.out_dtype else []
    return "/".join([variant.direction, DTYPE_NAMES[variant.dtype], str(variant.head_dim), variant.path, form, *extras])


def _device(no_wgmma=False):
    """The current GPU's abilities as the API's selection sees them (``no_wgmma``: CUPYFLASH_NO_WGMMA=1)."""
    import dataclasses

    from cupyflash._cuda import compile

    saved = os.environ.pop("CUPYFLASH_NO_WGMMA", None)
    try:
        device = compile.current_device()
    finally:
        if saved is not None:
            os.environ["CUPYFLASH_NO_WGMMA"] = saved
    return dataclasses.replace(device, wgmma=False) if no_wgmma else device


def _hopper_path(variant) -> bool:
    from cupyflash._cuda.variants import HOPPER_PATHS

    return variant.path in HOPPER_PATHS


def _fp8(variant) -> bool:
    from cupyflash._cuda.variants import FP8

    return variant.dtype == FP8


def reachable(variant, device) -> bool:
    """Whether the API sends some call to ``variant`` on a device with these abilities (Hopper's paths with
    them, the others with CUPYFLASH_NO_WGMMA=1)."""
    import dataclasses

    if _hopper_path(variant) and not device.wgmma:
        return False
    device = device if _hopper_path(variant) else dataclasses.replace(device, wgmma=False)
    calls = [(causal, options, False, tma) for causal, options in _calls(variant, None, None) for tma in (True, False)]
    calls += [(causal, options, True, True) for causal, options in _packed_options(variant)]
    return any(
        _selected(variant, causal, options, device, packed, tma) == variant for causal, options, packed, tma in calls
    )


def selected_variants(pattern):
    from cupyflash._cuda import tile_policy

    regex = re.compile(pattern)
    device = _device()
    return [v for v in tile_policy.shipped_variants() if regex.search(variant_label(v)) and reachable(v, device)]


def compile_into_cache(variants, jobs):
    """Build the variants' modules into CuPy's cache, several at a time, and the FP8 forward's V^T pass where an
    FP8 variant is among them (it is no variant's module); returns the failures as messages."""
    from cupyflash._cuda.compile import compile_ahead

    problems = compile_ahead(variants, max_workers=jobs)
    if any(_fp8(v) for v in variants):
        import cupy

        from cupyflash._cuda import fp8

        try:
            fp8._module(cupy.cuda.Device().id)
        except Exception as error:  # noqa: BLE001 - the worker then compiles (and reports) on its own
            problems.append(f"{fp8.SOURCE} {fp8.KERNEL}: {type(error).__name__}: {error}")
    return problems


# ============================================================================= worker (runs under the sanitizer)
def _problem(rng, dtype, batch, nq, nk, d):
    import cupy
    import numpy as np

    shapes = (batch + (nq, d), batch + (nk, d), batch + (nk, d), batch + (nq, d))
    return [cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for shape in shapes]


class _Stand:
    """An option's array as selection reads it (whether it is given), for ``_selected`` without a GPU."""


def _calls(variant, rng, dtype):
    """(causal, options) of the calls that pick ``variant`` (module docstring); with ``rng`` None the arrays
    are stand-ins, for selection only."""
    import numpy as np

    if _fp8(variant):  # causal and out_dtype are all it takes; the inputs' quantization is FP8_CALLS'
        import ml_dtypes

        out_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[variant.out_dtype]
        return [(variant.causal, dict(out_dtype=out_dtype))]
    (b, h), nq, nk = MODS_SHAPE["batch"], MODS_SHAPE["nq"], MODS_SHAPE["nk"]

    def array(make):
        if rng is None:
            return _Stand()
        import cupy

        return cupy.asarray(make())

    slopes = array(lambda: np.array([0.25, 0.0625], dtype=np.float32))
    block_mask = np.ones((b, h, 2, 3), dtype=bool)
    block_mask[0, 1, 0, 2] = False
    tiles_off = array(lambda: block_mask)
    if variant.mods == "none":
        return [(variant.causal, {})]
    if variant.mods == "all":
        first = dict(
            window=(100, 20),
            alibi_slopes=slopes,
            bias=array(lambda: rng.standard_normal((b, h, nq, nk), dtype=np.float32).astype(dtype)),
            mask=array(lambda: rng.random((nq, nk)) < 0.8),
            block_mask=tiles_off,
        )
        second = dict(
            softcap=5.0,
            alibi_slopes=slopes,
            bias=array(lambda: rng.standard_normal((b, 1, nq, nk), dtype=np.float32).astype(dtype)),
            mask=array(lambda: rng.random((1, 1, 1, nk)) < 0.8),
        )
        return [(True, first), (False, second)]
    if variant.mods == "softcap":
        return [(variant.causal, dict(softcap=5.0))]
    if variant.mods == "window":
        return [(True, dict(window=(100, 20))), (False, dict(window=(40, -1)))]
    extra = dict(block_mask=tiles_off) if variant.block_mask else {}
    if variant.score == "bounded":
        return [(True, dict(softcap=5.0, window=(100, 20), **extra)), (False, dict(softcap=5.0, **extra))]
    if variant.score == "alibi":
        return [(False, dict(window=(100, -1), alibi_slopes=slopes, **extra))]
    if variant.score == "alibi_half_first":
        return [
            (True, dict(alibi_slopes=slopes, **extra)),
            (False, dict(window=(100, 20), alibi_slopes=slopes, **extra)),
        ]
    # The scalars' plain form: a window with a softcap beyond the bounded form's reach; on the other paths
    # also ALiBi (the warp-specialized forward folds it), and in the backward the block mask.
    calls = [
        (True, dict(window=(100, 20), softcap=50.0, **extra)),
        (False, dict(window=(40, 10), softcap=50.0, **extra)),
    ]
    if variant.path != "ws":
        calls += [(True, dict(window=(100, 20), alibi_slopes=slopes)), (False, dict(softcap=5.0, alibi_slopes=slopes))]
        if variant.direction == "bwd":
            calls.append((True, dict(block_mask=tiles_off)))
    return calls


def _packed_options(variant):
    """(causal, options) of the packed call (module docstring), or nothing where the API sends none to
    ``variant``."""
    if variant.direction == "probs" or variant.mods not in ("scalars", "all") or variant.path == "ws":
        return []
    return [(True, dict(alibi_slopes=_Stand()))]


@contextlib.contextmanager
def _fused_at_any_length(variant):
    """For a fused-backward variant, its thresholds lowered (shortest length, least work) so that small problems
    take it, and no plan kept from before; other variants as they are."""
    if not variant.fused_backward:
        yield
        return
    from cupyflash._cuda import plans, tile_policy

    names = ("WS_BWD_MIN_LENGTH", "WS_BWD_MIN_WORK")
    saved = {name: getattr(tile_policy, name) for name in names}
    tile_policy.WS_BWD_MIN_LENGTH = {d: 1 for d in saved["WS_BWD_MIN_LENGTH"]}
    tile_policy.WS_BWD_MIN_WORK = 0
    plans.clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(tile_policy, name, value)
        plans.clear()


def _selected(variant, causal, options, device, packed=False, tma=True):
    """The variant the API selects for a call of ``variant``'s direction, dtype and head dim with these
    options on a device with these abilities; ``tma`` False: with q broadcast along a batch dim, which the
    warp-specialized forward's tensor maps cannot describe (k and v broadcast they can)."""
    import dataclasses

    from cupyflash._cuda import tile_policy
    from cupyflash._cuda.variants import Features
    from cupyflash._modifiers import Modifiers

    if _fp8(variant):
        return _fp8_selected(variant.head_dim, causal, options, device, packed)
    mods = None
    if options:
        mods = Modifiers(
            options.get("window", (-1, -1)),
            options.get("softcap", 0.0),
            options.get("alibi_slopes"),
            options.get("bias"),
            None,
            options.get("mask"),
            options.get("block_mask"),
        )
    dropout = object() if variant.dropout else None
    # The fused backward is chosen by length (its thresholds lowered where it runs: _fused_at_any_length)
    lengths = (FUSED_SHAPE["nq"], FUSED_SHAPE["nk"]) if variant.fused_backward else (0, 0)
    features = Features.of(
        variant.direction,
        variant.dtype,
        variant.head_dim,
        variant.head_dim,
        causal,
        mods,
        dropout,
        packed,
        lengths=lengths,
        deterministic=variant.deterministic,
        results=variant.out_dtype or None,
    )
    with _fused_at_any_length(variant):
        return tile_policy.dense(dataclasses.replace(features, tma=tma), device)


def _fp8_selected(head_dim, causal, options, device, packed=False):
    """The variant the FP8 forward takes for e4m3 q, k, v of this head dim, as cupyflash._cuda.fp8.prepare picks
    it (FP8 calls bypass Features and tile_policy.dense), or None where the API sends the call nowhere: FP8 needs
    compute capability 9.0 alone, which ``device.wgmma`` stands for here (``_device`` reads it with
    CUPYFLASH_NO_WGMMA unset, a switch the FP8 forward ignores); it takes no modifiers and no packed batch.
    Its tensor maps never see a broadcast batch dim (q and k are copied whole), so ``tma`` does not matter."""
    from cupyflash._cuda import tile_policy
    from cupyflash._cuda.fp8 import head_dim_for
    from cupyflash._fp8.api import resolve_out_dtype

    if not device.wgmma or packed or set(options) - {"out_dtype"}:
        return None
    return tile_policy.fp8(head_dim_for(head_dim), bool(causal), resolve_out_dtype(options.get("out_dtype")).name)


def run_variant(variant, rng):
    """Launch every kernel of ``variant`` (and the forward the backward needs) on tiny inputs, through the calls
    that tile_policy.dense it (each checked against the API's selection first)."""
    import cupy
    import ml_dtypes
    import numpy as np

    # The API picks the variant from the inputs and the device; the path (Hopper's or mma.sync) through the
    # CUPYFLASH_NO_WGMMA switch.
    os.environ["CUPYFLASH_NO_WGMMA"] = "0" if _hopper_path(variant) else "1"
    device = _device(no_wgmma=not _hopper_path(variant))
    if _fp8(variant):
        _run_fp8(variant, rng, device)
        return
    dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}[
        variant.dtype
    ]
    shape = MODS_SHAPE if variant.mods != "none" else FUSED_SHAPE if variant.fused_backward else PLAIN_SHAPE
    q, k, v, dout = _problem(rng, dtype, shape["batch"], shape["nq"], shape["nk"], variant.head_dim)
    dropout = dict(dropout_p=0.2, dropout_seed=7) if variant.dropout else {}
    wide = _wide_options(variant)
    ran = 0
    # q of one entry of the last batch dim, broadcast over it: the calls of a forward that the warp-specialized
    # kernel would otherwise take. Which forward they launched is checked (dense.functions is asked for it).
    q_shared = q[..., :1, :, :]
    from cupyflash._cuda import dense

    loaded = []
    functions = dense.functions
    dense.functions = lambda chosen: loaded.append(chosen) or functions(chosen)
    try:
        ran += _dense_calls(variant, rng, dtype, device, q, q_shared, k, v, dout, dropout, wide, loaded)
    finally:
        dense.functions = functions
    for causal, options in _packed_options(variant):
        if _selected(variant, causal, options, device, packed=True) == variant:
            ran += 1
            _packed_call(rng, dtype, variant, dropout, wide)
    if not ran:
        raise RuntimeError(f"no call selects {variant_label(variant)} on this GPU")
    cupy.cuda.Device().synchronize()


def _dense_calls(variant, rng, dtype, device, q, q_shared, k, v, dout, dropout, wide, loaded) -> int:
    """The dense calls that select ``variant`` (q shared along a batch dim where only that selects it); how many
    ran. A forward variant must be among the kernels the calls loaded."""
    import cupyflash

    ran = 0
    for causal, options in _calls(variant, rng, dtype):
        if _selected(variant, causal, options, device) == variant:
            queries = q
        elif _selected(variant, causal, options, device, tma=False) == variant:
            queries = q_shared
        else:
            continue
        ran += 1
        loaded.clear()
        if variant.direction == "probs":
            cupyflash.attention_probs(queries, k, v, causal=causal, **options)
            continue
        out, lse = cupyflash.attention_forward(queries, k, v, causal=causal, **options, **dropout, **wide["fwd"])
        if variant.direction == "fwd" and variant not in loaded:
            raise RuntimeError(f"{variant_label(variant)} selected, but the call launched {loaded}")
        if variant.fused_backward:
            _fused_calls(variant, dout, queries, k, v, out, lse, causal, wide["bwd"])
        elif variant.direction == "bwd":
            cupyflash.attention_backward(
                dout, queries, k, v, out, lse, causal=causal, **options, **dropout, **wide["bwd"]
            )
    return ran


def _wide_options(variant):
    """The keywords that ask a forward ("fwd") and a backward ("bwd") call for ``variant``'s unrounded results:
    out_dtype for a forward variant, grad_dtype for a backward one (its forward stays rounded)."""
    found = {"fwd": {}, "bwd": {}}
    if variant.wide:
        found[variant.direction] = {"fwd": dict(out_dtype="float32"), "bwd": dict(grad_dtype="float32")}[
            variant.direction
        ]
    return found


def _run_fp8(variant, rng, device):
    """The FP8 forward on FP8_CALLS' inputs, through each call that selects ``variant``: forward only, as there is
    no FP8 backward. quantize_fp8 runs on the host, as the other variants' inputs are made there, so that its
    CuPy kernels stay out of the report; the holders then take the bytes and descales to the GPU."""
    import cupy
    import numpy as np

    import cupyflash

    def quantized(shape, block):
        held = cupyflash.quantize_fp8(rng.standard_normal(shape, dtype=np.float32), block=block)
        return cupyflash.FP8Tensor(cupy.asarray(held.data), cupy.asarray(held.scale), held.block)

    ran = 0
    for causal, options in _calls(variant, rng, None):
        if _selected(variant, causal, options, device) != variant:
            continue
        for shape, block in FP8_CALLS:
            q, k, v = (
                quantized(shape["batch"] + (n, variant.head_dim), block)
                for n in (shape["nq"], shape["nk"], shape["nk"])
            )
            cupyflash.attention_forward(q, k, v, causal=causal, **options)
            ran += 1
    if not ran:
        raise RuntimeError(f"no call selects {variant_label(variant)} on this GPU")
    cupy.cuda.Device().synchronize()


def kernel_names(variant):
    """The name expressions of the kernels a run of ``variant`` launches: its own, and for FP8 the V^T pass
    before its forward."""
    names = [variant.name_expression(kernel) for kernel in variant.kernels]
    if _fp8(variant):
        from cupyflash._cuda import fp8

        names.append(fp8.KERNEL)
    return names


def _fused_calls(variant, dout, q, k, v, out, lse, causal, wide):
    """The fused backward twice: its key blocks in the order they reach a query block, then in the order of their
    index (as where an entry's key blocks outnumber the SMs); unordered adds walk by arrival both times."""
    import cupyflash
    from cupyflash._cuda import fused_backward

    # initcheck does not see stores by bulk copies (cp.async.bulk), which is how the ordered adds' first key
    # block of a chain writes dq's float32 accumulator: the conversion's every read of it would be reported.
    # Under initcheck the accumulator is therefore allocated zeroed (its only cupy.empty). That the stores do
    # come first is what the GPU tests show, on NaN-filled allocations (tests/gpu/test_gpu_fused_backward.py).
    zeroed = os.environ.get(TOOL_VARIABLE) == "initcheck" and variant.deterministic
    module = fused_backward.cupy
    with _fused_at_any_length(variant):
        try:
            if zeroed:
                fused_backward.cupy = _ZeroedEmpty(module)
            cupyflash.attention_backward(
                dout, q, k, v, out, lse, causal=causal, deterministic=variant.deterministic, **wide
            )
            sm_count = fused_backward.sm_count
            fused_backward.sm_count = lambda device: 1
            try:
                cupyflash.attention_backward(
                    dout, q, k, v, out, lse, causal=causal, deterministic=variant.deterministic, **wide
                )
            finally:
                fused_backward.sm_count = sm_count
        finally:
            fused_backward.cupy = module


class _ZeroedEmpty:
    """A stand-in for the cupy module whose ``empty`` allocates zeroed arrays."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def empty(self, *args, **kwargs):
        return self._module.zeros(*args, **kwargs)


def _packed_call(rng, dtype, variant, dropout, wide):
    """A variable-length batch through the same kernels (module docstring)."""
    import cupy
    import numpy as np

    import cupyflash

    lengths_q, lengths_k, d = [0, 70, 1, 150], [90, 0, 40, 270], variant.head_dim
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lengths_q, lengths_k))
    q, dout = (
        cupy.asarray(rng.standard_normal((sum(lengths_q), 2, d), dtype=np.float32).astype(dtype)) for _ in range(2)
    )
    k, v = (cupy.asarray(rng.standard_normal((sum(lengths_k), 1, d), dtype=np.float32).astype(dtype)) for _ in range(2))
    options = dict(causal=True, alibi_slopes=cupy.asarray(np.array([0.25, 0.0625], dtype=np.float32)), **dropout)
    out, lse = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, **options, **wide["fwd"])
    if variant.direction == "bwd":
        cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **options, **wide["bwd"])


def worker(pattern):
    import cupy
    import numpy as np

    cupy.cuda.set_allocator(None)  # no pool: one cudaMalloc per array (module docstring)
    rng = np.random.default_rng(6)
    variants = selected_variants(pattern)
    failures = 0
    for variant in variants:
        label = variant_label(variant)
        started = time.perf_counter()
        try:
            run_variant(variant, rng)
        except Exception as error:  # noqa: BLE001 - counted, reported, and the next variant still runs
            failures += 1
            print(f"FAILED {label}: {type(error).__name__}: {error}", flush=True)
            continue
        for kernel in kernel_names(variant):
            print(f"RAN {label} {kernel}", flush=True)
        print(f"done {label} in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"WORKER DONE {len(variants)} variants, {failures} failed", flush=True)
    return 1 if failures else 0


# ============================================================================= finding the sanitizer
def find_sanitizer(explicit=None):
    """compute-sanitizer from --sanitizer, PATH, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda*, or the pip
    package nvidia-cuda-sanitizer-api; None if absent."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    roots += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]
    candidates = [
        os.path.join(root, sub, "compute-sanitizer") for root in roots if root for sub in ("bin", "compute-sanitizer")
    ]
    candidates += [
        os.path.join(path, "nvidia", "cuda_sanitizer_api", "compute-sanitizer", "compute-sanitizer")
        for path in sys.path
        if path
    ]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


# ============================================================================= parsing a report
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?\s*$", re.MULTILINE)
_NOT_PRINTED = re.compile(r"ERROR SUMMARY:\s*(\d+) errors? (?:was|were) not printed")
NOT_PRINTED = "not printed (past the sanitizer's --print-limit)"
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_KERNEL = re.compile(r"(" + "|".join(KERNEL_FAMILIES) + r")(<[^>]*>)?")
_CAST = re.compile(r"\((?:unsigned |signed )?(?:int|bool|long|long long|short|char)\)")
_NOT_ERRORS = (
    "COMPUTE-SANITIZER",
    "Process ID",
    "ERROR SUMMARY",
    "RACECHECK SUMMARY",
    "LEAK SUMMARY",
    "Target application",
    "This application",
    "Note:",
    "Disabling",
    "Enabling",
)


def normalize_kernel(family, args):
    """``attention_fwd_kernel<half_t, 64, ...>`` in one spelling, whether it came from our name expression
    or from the sanitizer's demangler (which may write ``(int)64`` or ``(bool)1``)."""
    if not args:
        return family
    parts = [_CAST.sub("", part).strip() for part in args.strip("<>").split(",")]
    parts = ["1" if part == "true" else "0" if part == "false" else part for part in parts]
    return f"{family}<{', '.join(parts)}>"


def parse_report(text):
    """(summary errors or None, racecheck warnings, {kernel: errors}) from a compute-sanitizer log."""
    lines = [line.rstrip("\n") for line in text.splitlines() if line.startswith("=========")]
    blocks, current = [], None
    for line in lines:
        body = line[len("=========") :]
        if not body.strip():
            current = None
            continue
        if body.startswith(" ") and not body.startswith("  "):  # a header line: "========= Text"
            header = body.strip()
            current = None
            if not header.startswith(_NOT_ERRORS):
                current = [header]
                blocks.append(current)
        elif current is not None:  # "=========     at kernel+0x..." continues the block
            current.append(body.strip())
    errors, warnings = collections.Counter(), 0
    for block in blocks:
        if block[0].startswith("Warning"):
            warnings += 1
            continue
        match = next((m for m in map(_KERNEL.search, block) if m), None)
        errors[normalize_kernel(match.group(1), match.group(2)) if match else OTHER] += 1
    summary = None
    race = _RACE_SUMMARY.findall(text)
    if race:
        summary = sum(int(e) for _, e, _ in race)
        warnings = max(warnings, sum(int(w) for _, _, w in race))
    else:
        found = _SUMMARY.findall(text)
        summary = sum(int(n) for n in found) if found else None
    attributed = sum(errors.values())
    # The sanitizer prints the first errors only: the rest are counted apart, not blamed on anything.
    not_printed = sum(int(n) for n in _NOT_PRINTED.findall(text))
    if not_printed:
        errors[NOT_PRINTED] += not_printed
    if summary is not None and summary > attributed + not_printed:
        errors[OTHER] += summary - attributed - not_printed
    return summary, warnings, errors


def parse_worker(text):
    """(kernels that ran, failure lines, finished) from the worker's output."""
    ran = set()
    for match in re.finditer(r"^RAN \S+ (.+)$", text, re.MULTILINE):
        kernel = _KERNEL.search(match.group(1))
        ran.add(normalize_kernel(kernel.group(1), kernel.group(2)))
    failures = re.findall(r"^FAILED .+$", text, re.MULTILINE)
    return ran, failures, "WORKER DONE" in text


# ============================================================================= running and reporting
def run_tool(tool, sanitizer, args, out):
    log, worker_log = out / f"{tool}.sanitizer.log", out / f"{tool}.worker.log"
    command = [sanitizer, "--tool", tool, "--log-file", str(log), "--report-api-errors", args.api_errors]
    environment = dict(os.environ, **{TOOL_VARIABLE: tool})
    if tool == "memcheck" and args.padding:
        command += ["--padding", str(args.padding)]
    command += [sys.executable, str(Path(__file__).resolve()), "--worker", "--variants", args.variants]
    started = time.perf_counter()
    with open(worker_log, "w") as stream:
        # Its own process group, so that a timeout ends the sanitized worker too, not only the sanitizer.
        process = subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True, env=environment
        )
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = "timeout"
    seconds = time.perf_counter() - started
    report = log.read_text(errors="replace") if log.exists() else ""
    summary, warnings, errors = parse_report(report)
    ran, failures, finished = parse_worker(worker_log.read_text(errors="replace"))
    return dict(
        tool=tool,
        code=code,
        seconds=seconds,
        summary=summary,
        warnings=warnings,
        errors=errors,
        ran=ran,
        failures=failures,
        finished=finished,
        log=log,
        worker_log=worker_log,
    )


def family_of(kernel):
    return kernel.split("<")[0]


def print_table(results, all_rows):
    tools = [r["tool"] for r in results]
    kernels = set().union(*(r["ran"] for r in results), *(r["errors"] for r in results))
    if all_rows:
        rows = {kernel: {kernel} for kernel in kernels}
    else:  # one row per kernel family, with the number of instantiations that ran
        rows = collections.defaultdict(set)
        for kernel in kernels:
            rows[family_of(kernel) if kernel not in (OTHER, NOT_PRINTED) else kernel].add(kernel)
    width = max([len("kernel")] + [len(name) + 12 for name in rows])
    print(f"{'kernel':<{width}} " + " ".join(f"{tool:>10}" for tool in tools))
    ran_anywhere = set().union(*(r["ran"] for r in results))
    for name in sorted(rows, key=lambda n: (n in (OTHER, NOT_PRINTED), n)):
        members = rows[name]
        label = name if all_rows or name in (OTHER, NOT_PRINTED) else f"{name} ({len(members & ran_anywhere)} ran)"
        cells = []
        for r in results:
            errors = sum(r["errors"].get(kernel, 0) for kernel in members)
            ran = any(kernel in r["ran"] for kernel in members)
            cells.append(f"{errors:>10}" if errors or ran or name == OTHER else f"{'-':>10}")
        print(f"{label:<{width}} " + " ".join(cells))
    totals = [("?" if r["summary"] is None else str(r["summary"])) for r in results]
    print(f"{'TOTAL (sanitizer summary)':<{width}} " + " ".join(f"{t:>10}" for t in totals))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    parser.add_argument(
        "--variants",
        default=".",
        help="regex searched in the names fwd|bwd|probs/fp16|bf16|fp32|"
        "fp64|fp8/HEAD_DIM/PATH/FORM[/...] (default: all)",
    )
    parser.add_argument("--out", default="/tmp/cupyflash-sanitize", help="folder for the logs (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=0, help="tools run at once (default: all of them)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per tool (default 3600)")
    parser.add_argument("--padding", type=int, default=64, help="memcheck guard bytes after each allocation (0: off)")
    parser.add_argument(
        "--api-errors",
        default="no",
        choices=("no", "explicit", "all"),
        help="compute-sanitizer --report-api-errors (default no: kernels only)",
    )
    parser.add_argument("--sanitizer", default=None, help="path of compute-sanitizer (default: searched)")
    parser.add_argument("--all-rows", action="store_true", help="one row per kernel instantiation")
    parser.add_argument("--strict", action="store_true", help="racecheck warnings fail the run too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.variants)

    tools = [tool.strip() for tool in args.tools.split(",") if tool.strip()]
    unknown = set(tools) - set(TOOLS)
    if unknown or not tools:
        parser.error(f"unknown tools {sorted(unknown)}; choose from {', '.join(TOOLS)}")
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print(
            "compute-sanitizer not found: looked on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda*/bin "
            "and the nvidia-cuda-sanitizer-api package. It ships with the CUDA toolkit; pass --sanitizer PATH.",
            file=sys.stderr,
        )
        return 2
    variants = selected_variants(args.variants)
    if not variants:
        parser.error(f"--variants {args.variants!r} matches none of the shipped variants")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{sanitizer}: {', '.join(tools)} over {len(variants)} variants; logs in {out}/", flush=True)

    started = time.perf_counter()
    try:
        problems = compile_into_cache(variants, jobs=max(1, min(16, os.cpu_count() or 1)))
    except Exception as error:  # noqa: BLE001 - the workers then compile (and report) on their own
        problems = [f"{type(error).__name__}: {error}"]
    print(
        f"compiled into the kernel cache in {time.perf_counter() - started:.0f} s"
        + (f"; {len(problems)} failed, e.g. {problems[0]}" if problems else ""),
        flush=True,
    )

    with ThreadPoolExecutor(max_workers=args.jobs or len(tools)) as pool:
        results = list(pool.map(lambda tool: run_tool(tool, sanitizer, args, out), tools))

    print()
    print_table(results, args.all_rows)
    print()
    failed = False
    for r in results:
        notes = []
        if r["summary"] is None:
            notes.append("NO SUMMARY in the report (did the sanitizer run?)")
        if r["failures"]:
            notes.append(f"{len(r['failures'])} variants failed, e.g. {r['failures'][0]}")
        if not r["finished"]:
            notes.append("the worker did not finish")
        if r["code"] != 0:
            notes.append(f"exit status {r['code']}")
        if r["warnings"]:
            notes.append(f"{r['warnings']} racecheck warnings")
        bad = bool(
            r["summary"] is None
            or r["summary"]
            or sum(r["errors"].values())
            or r["failures"]
            or not r["finished"]
            or r["code"] != 0
            or (args.strict and r["warnings"])
        )
        failed |= bad
        print(
            f"{r['tool']:>10}: {'FAIL' if bad else 'ok'} in {r['seconds']:.0f} s, {len(r['ran'])} kernels ran"
            + (f"; {'; '.join(notes)}" if notes else "")
            + f"  [{r['log']}, {r['worker_log']}]"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
