"""The GPU back end's entry points, the ones ``cupyflash._api`` calls with CuPy arrays: dense and packed
(variable-length) forward and backward, and the probabilities. The API has validated the inputs, handled
empty problems and broadcast q, k, v to one batch shape (stride-0 views); these turn the arrays into the
kernels' parameters, pick and compile the variant, and launch on CuPy's current stream.
"""

from __future__ import annotations

import dataclasses
import math

import numpy

from cupyflash._arrays import bits, cupy, lse_dtype, sum_to_shape
from cupyflash._cuda import f32_pieces, fused_backward, plans, tile_policy, tma
from cupyflash._cuda.compile import current_device, functions
from cupyflash._cuda.launch import (
    BACKWARD_NAMES,
    CHAIN_ROWS,
    FORWARD_NAMES,
    Plan,
    keep_call,
    launch,
    launch_summed,
    passes_side_by_side,
)
from cupyflash._cuda.params import (
    STRIDED,
    dbias_buffer,
    dense_params,
    kernel_ready,
    layout,
    mod_arrays,
    packed_params,
    packed_slopes,
    slopes,
    unpad,
)
from cupyflash._cuda.tiles import WS_BLOCK_MASK_TILES, WS_WARPGROUP_ROWS
from cupyflash._cuda.variants import Features, row_width
from cupyflash._modifiers import BLOCK_MASK_TILE


def _widths(dtype, d: int, d_v: int) -> tuple[int, int]:
    """The head dims as the kernels read rows (variants.row_width)."""
    name = numpy.dtype(dtype).name
    return row_width(d, name), row_width(d_v, name)


def _pieces_width(variant) -> int:
    """HEAD_DIM of a variant that reads float16 pieces of float32 inputs, else 0."""
    return variant.head_dim if variant.path == "pieces" else 0


def _tma_reads(variant, arrays, sizes, strides, nk: int) -> bool:
    """Whether the warp-specialized forward can serve: tensor maps describe q, k, v (k and v may be broadcast over
    query heads, GQA's layout, over the same batch dims: the kernel reads both at k's coordinates) and its
    block-mask walk holds the key tiles."""
    if not tma.available() or not all(
        tma.describable(arrays[name], sizes, strides[name], broadcast=name != "q") for name in tma.MAPPED
    ):
        return False
    broadcast = [[n > 1 and s == 0 for n, s in zip(sizes, strides[name])] for name in ("k", "v")]
    if broadcast[0] != broadcast[1]:
        return False
    return not variant.block_mask or -(-nk // BLOCK_MASK_TILE) <= WS_BLOCK_MASK_TILES


def plan_key(direction: str, arrays: dict, scale: float, causal: bool, mods, dropout, results) -> tuple | None:
    """A dense call's key in the plan cache (role "plan"), or None when it is not planned (the modifiers'
    per-element arrays). Its inputs' layouts and its results' dtype (``results``): outputs and workspaces are
    allocated contiguous from their shapes."""
    if mods is not None and not (mods.bias is None and mods.mask is None and mods.block_mask is None):
        return None
    window, softcap = (None, 0.0) if mods is None else (mods.window, mods.softcap)
    return plans.key(
        "plan",
        direction,
        [arrays[name] for name in STRIDED if name in arrays] + [arrays.get("alibi_slopes")],
        (scale, causal, window, softcap, results.name)
        + ((None, None) if dropout is None else (dropout.threshold, dropout.scale)),
    )


def attention_forward(q, k, v, *, scale: float, causal: bool, mods=None, dropout=None, fast_key=None, out_dtype=None):
    """out (*batch, Nq, Dv) in ``out_dtype`` (None: the inputs' dtype; or lse_dtype, unrounded) and lse (*batch, Nq)
    in lse_dtype (float32; float64 for float64 inputs). ``fast_key``: the call's key in the plan cache (plans.py,
    role "call"), under which a plan that launches on these very arrays is kept."""
    out_dtype = q.dtype if out_dtype is None else numpy.dtype(out_dtype)
    batch_shape, (nq, d), nk, d_v = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
    d_w, d_v_w = _widths(q.dtype, d, d_v)
    given = q, k, v
    q, k, v = kernel_ready(q, d_w), kernel_ready(k, d_w), kernel_ready(v, d_v_w)
    if any(a is not b for a, b in zip((q, k, v), given)) or (d_w, d_v_w) != (d, d_v):
        fast_key = None  # launched on padded copies
    out = cupy.empty(batch_shape + (nq, d_v_w), dtype=out_dtype)
    lse = cupy.empty(batch_shape + (nq,), dtype=lse_dtype(q.dtype))
    addresses = {"q": q, "k": k, "v": v, "out": out, "lse": lse, **slopes(mods)}
    key = plan_key("fwd", addresses, scale, causal, mods, dropout, out_dtype)
    plan = plans.get(key)
    features = Features.of("fwd", q.dtype, d_w, d_v_w, causal, mods, dropout, results=out_dtype)
    variant = plan.variant if plan is not None else tile_policy.dense(features, current_device())
    # float32 on Hopper: the kernel reads float16 pieces of k and v, and q itself (it splits each q tile as it
    # loads it).
    width = _pieces_width(variant)
    if width:
        (_, k, v), exponents = f32_pieces.split((None, k, v), width, batch_shape, max(nq, nk))
        addresses.update(k=k, v=v, split_exponents=exponents)
    if plan is None:
        arrays, sizes, strides, copied = layout(batch_shape, {"q": q, "k": k, "v": v, "out": out, **mod_arrays(mods)})
        batch = math.prod(batch_shape)
        others = {"lse": lse}
        if width:
            others["split_exponents"] = addresses["split_exponents"]
        params = dense_params(
            arrays,
            sizes,
            strides,
            batch=batch,
            nq=nq,
            nk=nk,
            d=d_w,
            d_v=d_v_w,
            scale=scale,
            others=others,
            mods=mods,
            causal=causal,
            dropout=dropout,
        )
        maps = None
        if variant.path == "ws":
            if _tma_reads(variant, arrays, sizes, strides, nk):
                block = variant.tiles("fwd").block
                maps = tma.TensorMaps(
                    arrays, sizes, strides, {"q": WS_WARPGROUP_ROWS, "k": block, "v": block}, broadcast=("k", "v")
                )
            else:
                variant = tile_policy.dense(dataclasses.replace(features, tma=False), current_device())
        plan = Plan(functions(variant), variant, params, [("fwd", nq, batch)], maps, arrays)
        if copied:  # the parameters point at copies made for this call
            plan.launch(None, None)
            return unpad(arrays["out"], d_v), lse
        plans.put(key, plan)  # (None for the modifiers' arrays: planned never, launched once)
    plan.launch(addresses, dropout)
    if key is not None and not width:
        keep_call(fast_key, plan, FORWARD_NAMES, [(out.shape, out.dtype), (lse.shape, lse.dtype)], dropout)
    return unpad(out, d_v), lse


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    scale: float,
    causal: bool,
    mods=None,
    dropout=None,
    fast_key=None,
    deterministic: bool = True,
    grad_dtype=None,
    summed: bool = False,
):
    """dq, dk, dv with the full (broadcast) batch shape, in ``grad_dtype`` (None: the inputs' dtype; or lse_dtype,
    unrounded), and dbias (the bias's shape and dtype) or None. ``fast_key`` as in attention_forward.
    ``deterministic=False`` lets the fused backward add dq in any order (bfloat16 / float16 on Hopper, long
    sequences); every other path is deterministic. ``summed``: the caller sums some of the gradients over
    broadcast dims, so they may come unrounded instead (``unrounded_if_alike``); the caller casts."""
    grad_dtype = q.dtype if grad_dtype is None else numpy.dtype(grad_dtype)
    batch_shape, (nq, d), nk, d_v = q.shape[:-2], q.shape[-2:], k.shape[-2], v.shape[-1]
    d_w, d_v_w = _widths(q.dtype, d, d_v)
    if summed:  # (only here: a planned call skips the features below, and its host time with them)
        lengths = tile_policy.backward_lengths(math.prod(batch_shape), nq, nk, max(d_w, d_v_w))
        features = Features.of(
            "bwd", q.dtype, d_w, d_v_w, causal, mods, dropout, lengths=lengths, deterministic=deterministic
        )
        grad_dtype = unrounded_if_alike(features, q.dtype, grad_dtype)
    given = dout, q, k, v, out, lse
    q, k = kernel_ready(q, d_w), kernel_ready(k, d_w)
    v, out, dout = (kernel_ready(x, d_v_w) for x in (v, out, dout))
    acc = lse_dtype(q.dtype)
    if not (lse.shape == batch_shape + (nq,) and lse.dtype == acc and lse.flags.c_contiguous):
        lse = cupy.ascontiguousarray(cupy.broadcast_to(lse, batch_shape + (nq,)), dtype=acc)
    if any(a is not b for a, b in zip((dout, q, k, v, out, lse), given)) or (d_w, d_v_w) != (d, d_v):
        fast_key = None  # launched on copies
    dq = cupy.empty(batch_shape + (nq, d_w), dtype=grad_dtype)
    dk = cupy.empty(batch_shape + (nk, d_w), dtype=grad_dtype)
    dv = cupy.empty(batch_shape + (nk, d_v_w), dtype=grad_dtype)
    lse_log2 = cupy.empty(batch_shape + (nq,), dtype=acc)
    delta = cupy.empty(batch_shape + (nq,), dtype=acc)
    addresses = {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "dout": dout,
        "dq": dq,
        "dk": dk,
        "dv": dv,
        "lse": lse,
        "lse_log2": lse_log2,
        "delta": delta,
        **slopes(mods),
    }
    # (an unordered call keys its plans apart: where its fused backward takes a length, the ordered call's plan
    # may be the two passes)
    direction = "bwd" if deterministic else "bwd-unordered"
    key = (
        plan_key(direction, addresses, scale, causal, mods, dropout, grad_dtype) if max(nq, nk) <= CHAIN_ROWS else None
    )
    plan = plans.get(key)
    outputs = [(x.shape, x.dtype) for x in (dq, dk, dv, lse_log2, delta)]
    # Gradients of inputs broadcast over leading dims (stride 0) are summed after the call: scratch memory.
    scratch = [
        i for i, x in enumerate(given[1:4]) if any(s == 0 and n > 1 for n, s in zip(x.shape[:-2], x.strides[:-2]))
    ]
    if plan is not None:
        plan.launch(addresses, dropout)
        keep_call(fast_key, plan, BACKWARD_NAMES, outputs, dropout, scratch)
        return unpad(dq, d), unpad(dk, d), unpad(dv, d_v), None
    lengths = tile_policy.backward_lengths(math.prod(batch_shape), nq, nk, max(d_w, d_v_w))
    features = Features.of(
        "bwd",
        q.dtype,
        d_w,
        d_v_w,
        causal,
        mods,
        dropout,
        lengths=lengths,
        deterministic=deterministic,
        results=grad_dtype,
    )
    variant = tile_policy.dense(features, current_device())
    # float32 on Hopper: the passes read float16 pieces of q, k, v, dout; the preprocess reads out and dout
    # themselves. (Never planned: the pieces are made per call anyway.)
    width = _pieces_width(variant)
    if width:
        key = None
    extra, accumulator = mod_arrays(mods), None
    if mods is not None and mods.bias is not None:
        accumulator = dbias_buffer(mods, q.dtype)
        extra["dbias"] = cupy.broadcast_to(accumulator, mods.bias.shape)
    arrays, sizes, strides, copied = layout(batch_shape, {"q": q, "k": k, "v": v, "out": out, "dout": dout, **extra})
    batch = math.prod(batch_shape)
    others = {"dq": dq, "dk": dk, "dv": dv, "lse": lse, "lse_log2": lse_log2, "delta": delta}
    params = dense_params(
        arrays,
        sizes,
        strides,
        batch=batch,
        nq=nq,
        nk=nk,
        d=d_w,
        d_v=d_v_w,
        scale=scale,
        others=others,
        mods=mods,
        causal=causal,
        dropout=dropout,
    )
    if variant.fused_backward and not fused_backward.describable(arrays, sizes, strides):
        variant = tile_policy.dense(dataclasses.replace(features, tma=False), current_device())
    kernels = functions(variant)
    if variant.fused_backward or (key is not None and not copied):
        # (the launches of a chained pass are not planned: key is None; the fused backward is never chained)
        if variant.fused_backward:
            plan = fused_backward.FusedBackwardPlan(
                kernels, variant, params, arrays, sizes, strides, batch=batch, nq=nq, nk=nk
            )
        else:
            plan = Plan(kernels, variant, params, [("preprocess", nq, batch), ("dkdv", nk, batch), ("dq", nq, batch)])
        if key is not None and not copied:
            plans.put(key, plan)
        else:
            fast_key = None
        plan.launch(None, None)
        keep_call(fast_key, plan, BACKWARD_NAMES, outputs, dropout, scratch)
        return unpad(dq, d), unpad(dk, d), unpad(dv, d_v), None
    launch(kernels, variant, "preprocess", nq, batch, params)
    if width:
        (q, k, v, dout), others["split_exponents"] = f32_pieces.split((q, k, v, dout), width, batch_shape, max(nq, nk))
        arrays, sizes, strides, _ = layout(batch_shape, {"q": q, "k": k, "v": v, "out": out, "dout": dout})
        params = dense_params(
            arrays,
            sizes,
            strides,
            batch=batch,
            nq=nq,
            nk=nk,
            d=d_w,
            d_v=d_v_w,
            scale=scale,
            others=others,
            causal=causal,
        )
    passes_side_by_side(
        lambda: launch_summed(kernels, variant, "dkdv", nk, batch, params, nq, (dk, dv)),
        lambda: launch_summed(kernels, variant, "dq", nq, batch, params, nk, (dq,)),
    )
    dbias = None
    if accumulator is not None:
        # A full-shape accumulator (the > 3 leading dims fallback) still has to be summed over the bias's
        # broadcast dims; the usual stride-0 one already holds the sums.
        dbias = sum_to_shape(arrays["dbias"], accumulator.shape) if copied else accumulator
        dbias = dbias.reshape(mods.bias_shape).astype(mods.bias.dtype, copy=False)
    return unpad(dq, d), unpad(dk, d), unpad(dv, d_v), dbias


def attention_probs(q, k, v, *, scale: float, causal: bool, mods=None):
    """P (*batch, Nq, Nk) in lse_dtype: the forward's lse, then the probs kernel over every tile."""
    _, lse = attention_forward(q, k, v, scale=scale, causal=causal, mods=mods)
    batch_shape, (nq, d), nk = q.shape[:-2], q.shape[-2:], k.shape[-2]
    d_w, _ = _widths(q.dtype, d, d)
    variant = tile_policy.dense(Features.of("probs", q.dtype, d_w, d_w, causal, mods), current_device())
    q, k = kernel_ready(q, d_w), kernel_ready(k, d_w)
    probs = cupy.empty(batch_shape + (nq, nk), dtype=lse_dtype(q.dtype))
    arrays, sizes, strides, _ = layout(batch_shape, {"q": q, "k": k, **mod_arrays(mods)})
    params = dense_params(
        arrays,
        sizes,
        strides,
        batch=math.prod(batch_shape),
        nq=nq,
        nk=nk,
        d=d_w,
        d_v=d_w,
        scale=scale,
        others={"out": probs, "lse": lse},
        mods=mods,
        causal=causal,
    )
    launch(functions(variant), variant, "probs", nq, math.prod(batch_shape), params, cols=nk)
    return probs


def _device_offsets(packed):
    """cu_seqlens as the kernels read them: int32 on the current device (the validated host copies)."""
    return cupy.asarray(packed.cu_q.astype(numpy.int32)), cupy.asarray(packed.cu_k.astype(numpy.int32))


def attention_varlen_forward(q, k, v, packed, *, scale: float, causal: bool, mods=None, dropout=None, out_dtype=None):
    """out (total_q, H, Dv) in ``out_dtype`` (as in attention_forward) and lse (H, total_q) in lse_dtype of a
    packed batch; no padding anywhere."""
    out_dtype = q.dtype if out_dtype is None else numpy.dtype(out_dtype)
    d_w, d_v_w = _widths(q.dtype, packed.d, packed.dv)
    features = Features.of("fwd", q.dtype, d_w, d_v_w, causal, mods, dropout, packed=True, results=out_dtype)
    variant = tile_policy.dense(features, current_device())
    q, k, v = kernel_ready(q, d_w), kernel_ready(k, d_w), kernel_ready(v, d_v_w)
    out = cupy.empty((packed.total_q, packed.heads, d_v_w), dtype=out_dtype)
    lse = cupy.empty((packed.heads, packed.total_q), dtype=lse_dtype(q.dtype))
    cu_q, cu_k = _device_offsets(packed)
    others = {"lse": lse, **packed_slopes(mods)}  # alive until the launch
    params = packed_params(
        packed,
        {"q": q, "k": k, "v": v, "out": out},
        d=d_w,
        d_v=d_v_w,
        scale=scale,
        causal=causal,
        mods=mods,
        dropout=dropout,
        others=others,
        cu_q=cu_q,
        cu_k=cu_k,
    )
    launch(functions(variant), variant, "fwd", packed.max_q, packed.batch * packed.heads, params)
    return unpad(out, packed.dv), lse


def unrounded_if_alike(features: Features, dtype, grad_dtype):
    """The dtype of a backward's gradients that its caller sums over broadcast dims: lse_dtype (unrounded) where
    ``grad_dtype`` is the 16-bit inputs' own and tile_policy.unrounded_alike finds the unrounded variant to be the
    rounded one's kernel form (with tensor maps and without: the layout is not read yet), else ``grad_dtype``
    (each part then rounded before the sum)."""
    if grad_dtype != dtype or tile_policy.unrounded_alike(features, current_device()) is None:
        return grad_dtype
    return lse_dtype(dtype)


def attention_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    packed,
    *,
    scale: float,
    causal: bool,
    mods=None,
    dropout=None,
    grad_dtype=None,
    summed: bool = False,
):
    """dq (total_q, H, D), dk (total_k, Hk, D), dv (total_k, Hk, Dv) of a packed batch in ``grad_dtype`` (as in
    attention_backward). The kernels write per-head arrays (H, total, .); dk and dv are then summed over each
    group's G query heads (in lse_dtype). ``summed`` (G > 1): they may come unrounded instead, as in
    attention_backward."""
    grad_dtype = q.dtype if grad_dtype is None else numpy.dtype(grad_dtype)
    d_w, d_v_w = _widths(q.dtype, packed.d, packed.dv)
    if summed:
        features = Features.of("bwd", q.dtype, d_w, d_v_w, causal, mods, dropout, packed=True)
        grad_dtype = unrounded_if_alike(features, q.dtype, grad_dtype)
    features = Features.of("bwd", q.dtype, d_w, d_v_w, causal, mods, dropout, packed=True, results=grad_dtype)
    variant = tile_policy.dense(features, current_device())
    q, k = kernel_ready(q, d_w), kernel_ready(k, d_w)
    v, out, dout = (kernel_ready(x, d_v_w) for x in (v, out, dout))
    acc = lse_dtype(q.dtype)
    lse = cupy.ascontiguousarray(lse, dtype=acc)
    h, total_q, total_k = packed.heads, packed.total_q, packed.total_k
    dq = cupy.empty((h, total_q, d_w), dtype=grad_dtype)
    dk = cupy.empty((h, total_k, d_w), dtype=grad_dtype)
    dv = cupy.empty((h, total_k, d_v_w), dtype=grad_dtype)
    lse_log2, delta = (cupy.empty((h, total_q), dtype=acc) for _ in range(2))
    cu_q, cu_k = _device_offsets(packed)
    others = {"dq": dq, "dk": dk, "dv": dv, "lse": lse, "lse_log2": lse_log2, "delta": delta, **packed_slopes(mods)}
    params = packed_params(
        packed,
        {"q": q, "k": k, "v": v, "out": out, "dout": dout},
        d=d_w,
        d_v=d_v_w,
        scale=scale,
        causal=causal,
        mods=mods,
        dropout=dropout,
        others=others,
        cu_q=cu_q,
        cu_k=cu_k,
    )
    kernels, batch = functions(variant), packed.batch * h
    launch(kernels, variant, "preprocess", packed.max_q, batch, params)
    passes_side_by_side(
        lambda: launch_summed(kernels, variant, "dkdv", packed.max_k, batch, params, packed.max_q, (dk, dv)),
        lambda: launch_summed(kernels, variant, "dq", packed.max_q, batch, params, packed.max_k, (dq,)),
    )

    def packed_rows(x, width, groups):  # (H, total, w) -> (total, H // groups, width), summed over groups
        if groups > 1:
            x = x.reshape(h // groups, groups, x.shape[1], x.shape[2]).astype(acc).sum(axis=1).astype(grad_dtype)
        return cupy.ascontiguousarray(bits(x[..., :width]).transpose(1, 0, 2)).view(grad_dtype)

    return (
        packed_rows(dq, packed.d, 1),
        packed_rows(dk, packed.d, packed.groups),
        packed_rows(dv, packed.dv, packed.groups),
    )
