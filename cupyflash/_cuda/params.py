"""Arrays -> the kernels' parameter struct ``AttnParams`` (cuda_src/params.cuh): the host's mirror of it,
the inputs made kernel-ready, their leading dims collapsed into the kernels' three batch dims, and every
field a launch fills.
"""

from __future__ import annotations

import numpy

from cupyflash._arrays import bits, cupy, lse_dtype

# Host mirror of `struct AttnParams` (cuda_src/params.cuh): same field order, C alignment.
PARAMS_DTYPE = numpy.dtype(
    [(name, numpy.uint64) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse_log2", "delta")]
    + [(name, numpy.int64, (4,)) for name in ("q_stride", "k_stride", "v_stride", "out_stride", "dout_stride")]
    + [(name, numpy.int32) for name in ("batch", "batch1", "batch2", "nq", "nk", "d_qk", "d_v")]
    + [("scale", numpy.float32), ("scale_log2", numpy.float32)]
    + [(name, numpy.uint64) for name in ("bias", "dbias", "mask", "block_mask", "alibi_slopes")]
    + [(name, numpy.int64, (5,)) for name in ("bias_stride", "dbias_stride", "mask_stride", "block_mask_stride")]
    + [("alibi_stride", numpy.int64, (3,))]
    + [
        (name, numpy.int32)
        for name in ("window_left", "window_right", "bias_f32", "bias_pairs", "dbias_pairs", "dbias_f32")
    ]
    + [("softcap", numpy.float32), ("softcap_inv", numpy.float32)]
    + [(name, numpy.int32) for name in ("stream_begin", "stream_end")]
    + [("dropout_keys", numpy.uint32, (20,)), ("dropout_threshold", numpy.uint32)]
    + [("dropout_scale", numpy.float32)]
    + [(name, numpy.uint64) for name in ("cu_seqlens_q", "cu_seqlens_k")]
    + [(name, numpy.int32) for name in ("heads", "total_q", "total_k")]
    + [
        (name, numpy.float64)
        for name in ("scale_f64", "scale_log2_f64", "softcap_f64", "softcap_inv_f64", "dropout_scale_f64")
    ]
    + [("split_exponents", numpy.uint64)]
    + [("fp8_descale", numpy.uint64, (3,))]
    + [
        ("fp8_descale_blocks", numpy.int32, (3,)),
        ("fp8_descale_magic", numpy.uint32, (3,)),
        ("fp8_descale_shift", numpy.int32, (3,)),
    ],
    align=True,
)
# A launch passes the same bytes as one opaque value: CuPy finds a NumPy argument's address through
# __array_interface__, which for a structured dtype rebuilds the description of every field on every call
# (longer than a short kernel runs; docs/design/host_time.md); for an unstructured view it does not.
PARAMS_BYTES = numpy.dtype((numpy.void, PARAMS_DTYPE.itemsize))
STRIDED = ("q", "k", "v", "out", "dout")  # inputs with their own batch and row strides, in this order
_LOG2E = 1.4426950408889634


def kernel_ready(x, width: int):
    """x (..., N, D) as the kernels read it: unit column stride, 16-byte aligned rows holding ``width`` >= D
    columns. x itself when it already qualifies (any batch and row strides, broadcast dims included);
    otherwise a zero-padded copy that keeps broadcast dims unmaterialized."""
    if x.shape[-1] == width and x.flags.c_contiguous and x.data.ptr % 16 == 0 and (width * x.dtype.itemsize) % 16 == 0:
        return x  # the common case, decided without the general test below
    itemsize = x.dtype.itemsize
    sized = [(n, s) for n, s in zip(x.shape[:-1], x.strides[:-1]) if n > 1]
    if (
        x.shape[-1] == width
        and (x.shape[-1] == 1 or x.strides[-1] == itemsize)
        and x.data.ptr % 16 == 0
        and all(s % 16 == 0 for _, s in sized)
    ):
        return x
    base = x[tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None) for n, s in zip(x.shape[:-2], x.strides[:-2]))]
    padded = cupy.zeros(base.shape[:-1] + (width,), dtype=x.dtype)
    bits(padded)[..., : x.shape[-1]] = bits(base)
    return cupy.broadcast_to(padded, x.shape[:-1] + (width,))


def unpad(x, width: int):
    """x[..., :width] as a contiguous array (a copy only when the kernels ran on padded columns)."""
    return x if x.shape[-1] == width else cupy.ascontiguousarray(bits(x[..., :width])).view(x.dtype)


def _collapse_batch(batch: tuple[int, ...], arrays) -> tuple[list[int], list[list[int]]] | None:
    """Merge the leading dims of several (batch..., N, D) arrays into at most three, as (sizes, per-array
    strides in elements); None when more than three remain."""
    dims = []
    for i, n in enumerate(batch):
        if n == 1:
            continue
        strides = [a.strides[i] // a.dtype.itemsize for a in arrays]
        if dims and all(prev == s * n for prev, s in zip(dims[-1][1], strides)):
            dims[-1] = (dims[-1][0] * n, strides)
        else:
            dims.append((n, strides))
    if len(dims) > 3:
        return None
    dims = [(1, [0] * len(arrays))] * (3 - len(dims)) + dims
    return [n for n, _ in dims], [[s[j] for _, s in dims] for j in range(len(arrays))]


def layout(batch, arrays: dict):
    """Collapse the leading dims of the named arrays together: (arrays, sizes, batch strides per name,
    copied). With more than three unmergeable leading dims the arrays are materialized first (copied: a
    broadcast dbias accumulator is then a full one, summed afterwards)."""
    names, values = list(arrays), list(arrays.values())
    found = _collapse_batch(batch, values)
    copied = found is None
    if copied:
        values = [cupy.ascontiguousarray(bits(a)).view(a.dtype) for a in values]
        found = _collapse_batch(batch, values)
    sizes, strides = found
    return dict(zip(names, values)), sizes, dict(zip(names, strides)), copied


def new_params(
    pointers: dict,
    *,
    batch: int,
    batch1: int,
    batch2: int,
    nq: int,
    nk: int,
    d: int,
    d_v: int,
    scale: float,
    causal: bool,
    mods,
    dropout,
):
    """An AttnParams (a one-element structured array: CuPy passes it by value) with what every launch fills:
    the arrays' addresses, the sizes, the scale, the whole streamed axis for the backward passes, the window
    (causal folded in) and softcap that the modifiers' kernels read, and dropout's fields. Strides and the
    per-layout fields are the caller's (dense_params, packed_params)."""
    p = numpy.zeros(1, dtype=PARAMS_DTYPE)
    for name, array in pointers.items():
        p[name] = array.data.ptr
    p["batch"], p["batch1"], p["batch2"] = batch, batch1, batch2
    p["nq"], p["nk"], p["d_qk"], p["d_v"] = nq, nk, d, d_v
    # Both precisions of the real-valued fields: float32 kernels read the first, float64 ones the second.
    p["scale"], p["scale_log2"] = scale, scale * _LOG2E
    p["scale_f64"], p["scale_log2_f64"] = scale, scale * _LOG2E
    p["stream_begin"], p["stream_end"] = 0, max(nq, nk)
    p["alibi_stride"] = batch1 * batch2, batch2, 1  # one slope per flat batch entry, contiguous (alibi)
    # Read only by the modifiers' kernels (and attention_probs_kernel, which always has them).
    p["window_left"], p["window_right"] = (-1, 0) if causal else (-1, -1)
    if mods is not None:
        p["window_left"], p["window_right"] = mods.window_with_causal(causal)
        softcap_inv = 1.0 / mods.softcap if mods.softcap > 0 else 0.0
        p["softcap"], p["softcap_inv"] = mods.softcap, softcap_inv
        p["softcap_f64"], p["softcap_inv_f64"] = mods.softcap, softcap_inv
    if dropout is not None:  # read by the dropout kernels only
        p["dropout_keys"] = dropout.round_keys
        p["dropout_threshold"], p["dropout_scale"] = dropout.threshold, dropout.scale
        p["dropout_scale_f64"] = dropout.scale
    return p


def dense_params(
    arrays: dict,
    sizes,
    batch_strides: dict,
    *,
    batch: int,
    nq: int,
    nk: int,
    d: int,
    d_v: int,
    scale: float,
    others: dict = None,
    mods=None,
    causal: bool = False,
    dropout=None,
):
    """The parameters of a dense batch: ``arrays`` the strided tensors (their collapsed batch strides in
    ``batch_strides``), ``others`` the contiguous ones (lse and workspaces), by address only."""
    p = new_params(
        {**arrays, **(others or {})},
        batch=batch,
        batch1=sizes[1],
        batch2=sizes[2],
        nq=nq,
        nk=nk,
        d=d,
        d_v=d_v,
        scale=scale,
        causal=causal,
        mods=mods,
        dropout=dropout,
    )
    for name, array in arrays.items():
        if name == "alibi_slopes":  # (*batch): batch strides only
            p["alibi_stride"] = batch_strides[name]
            continue
        row_col = [array.strides[-2] // array.dtype.itemsize]
        if name not in STRIDED:  # the modifiers' arrays: any column stride, 0 included
            row_col.append(array.strides[-1] // array.dtype.itemsize)
        p[f"{name}_stride"] = batch_strides[name] + row_col
    if mods is not None:
        p["bias_f32"] = mods.bias is not None and mods.bias.dtype == numpy.float32
        if "bias" in arrays:
            p["bias_pairs"] = _pairs_aligned(arrays["bias"], p["bias_stride"][0])
        if "dbias" in arrays:
            p["dbias_pairs"] = dbias_exclusive(mods)  # see dbias_buffer
            p["dbias_f32"] = arrays["dbias"].dtype == numpy.float32
    return p


def packed_params(
    packed, arrays: dict, *, d: int, d_v: int, scale: float, causal: bool, mods, dropout, others: dict, cu_q, cu_k
):
    """AttnParams of a packed batch (cupyflash._varlen): flat batch b = (s * Hk + hk) * G + g, the sequence
    s with batch stride 0 (its rows come from cu_seqlens), the heads split into (Hk, G) so that k and v have
    stride 0 along the G query heads that share them; q, out, dout (total_q, H, .) and k, v (total_k, Hk, .)
    with any row and head strides (unit column stride)."""
    hk, g = packed.kv_heads, packed.groups
    # nq, nk: the longest sequences, which size the grid; the kernels read each one's own from cu_seqlens.
    p = new_params(
        {**arrays, **others, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k},
        batch=packed.batch * packed.heads,
        batch1=hk,
        batch2=g,
        nq=packed.max_q,
        nk=packed.max_k,
        d=d,
        d_v=d_v,
        scale=scale,
        causal=causal,
        mods=mods,
        dropout=dropout,
    )
    for name, array in arrays.items():
        row, head = (s // array.dtype.itemsize for s in array.strides[:2])
        p[f"{name}_stride"] = [0, g * head, head, row] if name in ("q", "out", "dout") else [0, head, 0, row]
    p["heads"], p["total_q"], p["total_k"] = packed.heads, packed.total_q, packed.total_k
    return p


def dbias_buffer(mods, dtype):
    """Zeros in the bias's own shape (leading 1s added) that the dQ pass writes dbias into: the result
    itself, in the bias's dtype, when the bias is broadcast along no dim (each element has one writer, which
    stores pairs of adjacent keys: Nk even, no softcap); otherwise an accumulator for atomic adds in the
    accumulator dtype (the kernel's dbias_pairs flag says which)."""
    own = (1,) * (mods.bias.ndim - len(mods.bias_shape)) + tuple(mods.bias_shape)
    return cupy.zeros(own, dtype=mods.bias.dtype if dbias_exclusive(mods) else lse_dtype(dtype))


def dbias_exclusive(mods) -> bool:
    full = mods.bias.shape
    own = (1,) * (len(full) - len(mods.bias_shape)) + tuple(mods.bias_shape)
    return own == tuple(full) and full[-1] % 2 == 0 and mods.softcap == 0


def _pairs_aligned(array, strides) -> bool:
    """Unit column stride, and every (row, even column) element aligned to two elements' bytes, so the
    kernels may read (or write) two adjacent columns at once."""
    return bool(
        array.strides[-1] == array.dtype.itemsize
        and all(int(s) % 2 == 0 for s in strides[:4])
        and array.data.ptr % (2 * array.dtype.itemsize) == 0
    )


def mod_arrays(mods) -> dict:
    """The modifiers' arrays as the dense kernels read them: broadcast views, nothing copied."""
    if mods is None:
        return {}
    return {
        name: getattr(mods, name)
        for name in ("bias", "mask", "block_mask", "alibi_slopes")
        if getattr(mods, name) is not None
    }


def slopes(mods) -> dict:
    """The ALiBi slopes' broadcast view (float32, the batch shape), by name, or nothing: its address is one
    of a planned call's."""
    return {} if mods is None or mods.alibi_slopes is None else {"alibi_slopes": mods.alibi_slopes}


def packed_slopes(mods) -> dict:
    """One float32 slope per flat batch entry, contiguous (tiny: the batch size), or nothing, for packed
    batches, whose launches take new_params' contiguous alibi_stride. Often a new array: the caller keeps
    the dict alive until the kernels are launched, since the parameters hold only its address. (Dense calls
    pass the broadcast view itself with its batch strides: no copy, no extra kernel per call.)"""
    if mods is None or mods.alibi_slopes is None:
        return {}
    return {"alibi_slopes": cupy.ascontiguousarray(mods.alibi_slopes, dtype=numpy.float32).reshape(-1)}
