"""The CPU back end for NumPy inputs: FlashAttention's algorithm, tile by tile, in NumPy float32.

float64 inputs compute in float64 instead (``lse_dtype``: scores, softmax state, accumulators, lse, dbias,
the dropout scale 1 / (1 - p)); every other dtype computes in float32.

Same arguments and results as the GPU back end (cupyflash._cuda.dense): q (*batch, Nq, D),
k (*batch, Nk, D), v (*batch, Nk, Dv) of one dtype with identical batch shapes (stride-0 views welcome),
Nq, Nk, prod(batch) >= 1, already validated by cupyflash._api; ``mods`` is the resolved
cupyflash._modifiers.Modifiers (its arrays broadcast to the full shapes) or None.

Forward: for each block of BLOCK_Q queries, sweep the key blocks it can see keeping the online-softmax
state per row: running max m_i, running sum l_i of exp(S_ij - m_i), and the unnormalized output
accumulator acc_i, rescaled by exp(m_old - m_new) whenever the max grows. Only lse = m_i + log(l_i) is
saved for the backward. Backward: delta_i = rowsum(dout_i * out_i), then for each key block the query
blocks that see it, recomputing P_ij = exp(S_ij - lse_i) and accumulating
dV_j += P_ij^T dO_i,  dP_ij = dO_i V_j^T,  dS_ij = P_ij * (dP_ij - delta_i),
dQ_i += scale dS_ij K_j,  dK_j += scale dS_ij^T Q_i,  dbias_ij += dS_ij (summed over its broadcast dims)
(with softcap, dS_ij is multiplied by 1 - tanh^2 before dQ and dK).
With dropout (cupyflash._dropout) the keep mask Z_ij of each tile is regenerated from the seed: the forward
adds (P_ij * Z_ij) V_j into acc_i (l_i sums P_ij undropped) and scales out by 1 / (1 - p); the backward
uses P_ij * Z_ij / (1 - p) for dV and dP_ij * Z_ij / (1 - p) in place of dP_ij.
Key blocks outside the window band (causal included) or whose block_mask tiles are all False are skipped,
as the kernels skip them. At most one (BLOCK_Q x BLOCK_K) score tile per batch element exists at a time:
never Nq x Nk (except in attention_probs, whose output is that big).
A key that a query row does not see never reaches that row, even where k, v (or q, dout for the key's own
gradients) hold a NaN or an infinity: hidden scores are replaced, not added to, and the products skip the
hidden pairs (matmul_seen) whenever an input is not finite.
"""

from dataclasses import replace

import numpy as np

from cupyflash._arrays import lse_dtype, matmul_seen, quiet_float_errors, sum_to_shape
from cupyflash._dropout import keep_mask
from cupyflash._modifiers import BLOCK_MASK_TILE, Modifiers
from cupyflash._varlen import sequence_view

BLOCK_Q = 64
BLOCK_K = 64
# A tile then never straddles two block_mask tiles: one block_mask element hides it or not, as in the
# kernels. (The code below also works for other tile sizes, element by element; the tests try some.)
assert BLOCK_MASK_TILE % BLOCK_Q == 0 and BLOCK_MASK_TILE % BLOCK_K == 0
_NO_MODIFIERS = Modifiers((-1, -1), 0.0, None, None, None, None, None)


@quiet_float_errors
def attention_forward(q, k, v, *, scale, causal, mods=None, dropout=None, out_dtype=None):
    """Returns out (*batch, Nq, Dv) in ``out_dtype`` (None: the inputs' dtype; ``lse_dtype``: unrounded) and lse
    (*batch, Nq) ``lse_dtype`` (float32; float64 for float64 inputs)."""
    tiles = _ScoreTiles(q.shape[-2], k.shape[-2], scale, causal, mods, dropout, q.shape[:-2], q.dtype, (k, v))
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype if out_dtype is None else out_dtype)
    lse = np.empty(q.shape[:-1], dtype=tiles.dtype)
    for i0 in range(0, tiles.nq, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, tiles.nq)
        out[..., i0:i1, :], lse[..., i0:i1] = _forward_query_block(q, k, v, i0, i1, tiles)
    return out, lse


def _forward_query_block(q, k, v, i0, i1, tiles):
    """Online softmax of queries i0:i1 over every key block they see."""
    dtype = tiles.dtype
    q_i = q[..., i0:i1, :].astype(dtype)
    m_i = np.full(q_i.shape[:-1], -np.inf, dtype=dtype)
    l_i = np.zeros(q_i.shape[:-1], dtype=dtype)
    acc_i = np.zeros(q_i.shape[:-1] + v.shape[-1:], dtype=dtype)
    for j0, j1 in tiles.key_blocks(i0, i1):
        s_ij, _ = tiles.scores(q_i, k[..., j0:j1, :], i0, i1, j0, j1)
        m_new = np.maximum(m_i, s_ij.max(axis=-1))
        # A row that has seen only hidden keys keeps m = -inf; shift it by 0 so that no -inf - -inf
        # (NaN) appears: its p_ij are exp(-inf) = 0 and its alpha exp(-inf) = 0.
        m_shift = np.where(np.isneginf(m_new), 0, m_new)
        p_ij = np.exp(s_ij - m_shift[..., None])
        alpha = np.exp(m_i - m_shift)
        l_i = alpha * l_i + p_ij.sum(axis=-1)
        acc_i = alpha[..., None] * acc_i + tiles.matmul(
            tiles.drop(p_ij, i0, i1, j0, j1), v[..., j0:j1, :].astype(dtype), ~np.isneginf(s_ij)
        )
        m_i = m_new
    # False only for rows that see no key at all (every key hidden or skipped); a NaN sum (a NaN or
    # +inf input) is "seen" and propagates, as in the reference.
    seen = l_i != 0
    out_i = np.where(seen[..., None], acc_i * (tiles.keep_scale / np.where(seen, l_i, 1))[..., None], 0)
    lse_i = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf)
    return out_i, lse_i


@quiet_float_errors
def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    scale,
    causal,
    mods=None,
    dropout=None,
    deterministic=True,
    grad_dtype=None,
    summed=False,
):
    """Returns dq, dk, dv with the full batch shape, in ``grad_dtype`` (None: the inputs' dtype; ``lse_dtype``:
    unrounded), and dbias or None. Deterministic whatever ``deterministic`` says (NumPy's sums run in one order).
    ``summed``: the caller sums some of them over broadcast dims, so 16-bit gradients come unrounded (the sum is
    then rounded once, not each part first); the caller casts.

    dbias has the bias's own shape ``mods.bias_shape`` and dtype (summed over its broadcast dims in
    float32; in float64 for float64 inputs); None when there is no bias.
    """
    tiles = _ScoreTiles(
        q.shape[-2], k.shape[-2], scale, causal, mods, dropout, q.shape[:-2], q.dtype, (dout, q, k, v, out)
    )
    delta = np.sum(dout.astype(tiles.dtype) * out.astype(tiles.dtype), axis=-1)
    # Rows that see no key have lse = -inf; +inf instead makes their P = exp(S - inf) = 0, never NaN.
    lse = np.where(np.isneginf(lse), np.inf, lse)
    grad_dtype = tiles.dtype if summed else q.dtype if grad_dtype is None else grad_dtype
    dq = np.zeros(q.shape, dtype=tiles.dtype)
    dk = np.empty(k.shape, dtype=grad_dtype)
    dv = np.empty(v.shape, dtype=grad_dtype)
    dbias = None if tiles.bias is None else np.zeros(tiles.dbias_shape, dtype=tiles.dtype)
    for j0 in range(0, tiles.nk, BLOCK_K):
        j1 = min(j0 + BLOCK_K, tiles.nk)
        dk[..., j0:j1, :], dv[..., j0:j1, :] = _backward_key_block(dout, q, k, v, lse, delta, dq, dbias, j0, j1, tiles)
    dbias = None if dbias is None else dbias.reshape(tiles.bias_shape).astype(tiles.bias.dtype)
    return dq.astype(grad_dtype, copy=False), dk, dv, dbias


def _backward_key_block(dout, q, k, v, lse, delta, dq, dbias, j0, j1, tiles):
    """dK_j and dV_j for keys j0:j1; adds this block's share of dQ (and dbias) into dq (dbias) in place."""
    dtype = tiles.dtype
    k_j = k[..., j0:j1, :].astype(dtype)
    v_j = v[..., j0:j1, :].astype(dtype)
    dk_j = np.zeros(k_j.shape, dtype=dtype)
    dv_j = np.zeros(v_j.shape, dtype=dtype)
    for i0, i1 in tiles.query_blocks(j0, j1):
        q_i = q[..., i0:i1, :].astype(dtype)
        dout_i = dout[..., i0:i1, :].astype(dtype)
        s_ij, tanh_ij = tiles.scores(q_i, k_j, i0, i1, j0, j1)
        p_ij = tiles.hide(s_ij, np.exp(s_ij - lse[..., i0:i1, None]))  # a NaN lse leaves P NaN where hidden
        seen_t = ~np.isneginf(_transpose(s_ij))
        dv_j += tiles.matmul(_transpose(tiles.drop(p_ij, i0, i1, j0, j1, tiles.keep_scale)), dout_i, seen_t)
        dp_ij = tiles.hide(s_ij, tiles.drop(dout_i @ _transpose(v_j), i0, i1, j0, j1, tiles.keep_scale))
        ds_ij = tiles.hide(s_ij, p_ij * (dp_ij - delta[..., i0:i1, None]))
        if dbias is not None:
            tiles.add_to_bias_shape(dbias, ds_ij, i0, i1, j0, j1)
        if tanh_ij is not None:  # the softcap's derivative: d(c tanh(x / c)) / dx = 1 - tanh^2
            ds_ij = tiles.hide(s_ij, ds_ij * (1 - tanh_ij * tanh_ij))
        dq[..., i0:i1, :] += tiles.scale * tiles.matmul(ds_ij, k_j, ~np.isneginf(s_ij))
        dk_j += tiles.scale * tiles.matmul(_transpose(ds_ij), q_i, seen_t)
    return dk_j, dv_j


@quiet_float_errors
def attention_probs(q, k, v, *, scale, causal, mods=None):
    """Returns P (*batch, Nq, Nk) float32 (float64 for float64 inputs): exp(s - lse) with the forward's
    lse; 0 where keys are hidden (NaN there too in a row whose lse is NaN, as on the GPU)."""
    _, lse = attention_forward(q, k, v, scale=scale, causal=causal, mods=mods)
    lse = np.where(np.isneginf(lse), np.inf, lse)  # rows that see no key: P = 0, as in the backward
    tiles = _ScoreTiles(q.shape[-2], k.shape[-2], scale, causal, mods, None, q.shape[:-2], q.dtype, ())
    p = np.zeros(q.shape[:-1] + k.shape[-2:-1], dtype=tiles.dtype)
    for i0 in range(0, tiles.nq, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, tiles.nq)
        q_i = q[..., i0:i1, :].astype(tiles.dtype)
        for j0, j1 in tiles.key_blocks(i0, i1):
            s_ij, _ = tiles.scores(q_i, k[..., j0:j1, :], i0, i1, j0, j1)
            p[..., i0:i1, j0:j1] = np.exp(s_ij - lse[..., i0:i1, None])
    return p


class _ScoreTiles:
    """The scores S_ij of one tile with every modifier applied, and which tiles can be skipped.

    The band of keys a query sees is the window with causal folded in: query i sees keys j with
    i + off - left <= j <= i + off + right (off = Nk - Nq, -1 = unbounded side), further thinned by
    mask and block_mask. ``dtype`` is the compute dtype, ``lse_dtype`` of the inputs' ``input_dtype``.
    """

    def __init__(self, nq, nk, scale, causal, mods, dropout, batch, input_dtype, inputs):
        self.nq, self.nk, self.scale = nq, nk, scale
        # Whether any input holds a NaN or an infinity: then the products skip hidden pairs (matmul_seen).
        self.finite = all(np.isfinite(x).all() for x in inputs)
        self.dropout, self.batch = dropout, tuple(batch)
        self.dtype = lse_dtype(input_dtype)
        # 1 / (1 - p) rounded once to the compute dtype: exactly the float64 value for float64 inputs.
        self.keep_scale = self.dtype.type(1.0 if dropout is None else dropout.scale)
        self.off = nk - nq  # bottom-right alignment
        mods = _NO_MODIFIERS if mods is None else mods
        self.window = mods.window_with_causal(causal)
        self.softcap, self.alibi_slopes = mods.softcap, mods.alibi_slopes
        self.bias, self.bias_shape = mods.bias, mods.bias_shape
        self.mask, self.block_mask = mods.mask, mods.block_mask
        # dbias is accumulated with at least 2 dims: a bias of fewer broadcasts along queries (and keys).
        if self.bias_shape is not None:
            self.dbias_shape = (1,) * max(0, 2 - len(self.bias_shape)) + tuple(self.bias_shape)

    def key_blocks(self, i0, i1):
        """(j0, j1) of the key blocks that queries i0:i1 may see, at multiples of BLOCK_K."""
        left, right = self.window
        lo = 0 if left == -1 else max(0, i0 + self.off - left)
        hi = self.nk if right == -1 else min(self.nk, i1 - 1 + self.off + right + 1)
        for j0 in range(lo - lo % BLOCK_K, hi, BLOCK_K):
            j1 = min(j0 + BLOCK_K, self.nk)
            if not self._block_masked_out(i0, i1, j0, j1):
                yield j0, j1

    def query_blocks(self, j0, j1):
        """(i0, i1) of the query blocks that may see keys j0:j1, at multiples of BLOCK_Q."""
        left, right = self.window
        lo = 0 if right == -1 else max(0, j0 - self.off - right)
        hi = self.nq if left == -1 else min(self.nq, j1 - 1 - self.off + left + 1)
        for i0 in range(lo - lo % BLOCK_Q, hi, BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, self.nq)
            if not self._block_masked_out(i0, i1, j0, j1):
                yield i0, i1

    def _block_masked_out(self, i0, i1, j0, j1):
        """True when block_mask hides the whole tile for every batch entry (then it is skipped)."""
        if self.block_mask is None:
            return False
        t = BLOCK_MASK_TILE
        return not self.block_mask[..., i0 // t : (i1 - 1) // t + 1, j0 // t : (j1 - 1) // t + 1].any()

    def scores(self, q_i, k_j, i0, i1, j0, j1):
        """S_ij (*batch, i1-i0, j1-j0) in the compute dtype, -inf where hidden; and tanh(x / softcap) or None."""
        dtype = self.dtype
        s_ij = self.scale * (q_i @ _transpose(k_j.astype(dtype)))
        tanh_ij = None
        if self.softcap > 0:
            tanh_ij = np.tanh(s_ij / dtype.type(self.softcap))
            s_ij = dtype.type(self.softcap) * tanh_ij
        rel = np.arange(j0, j1)[None, :] - (np.arange(i0, i1)[:, None] + self.off)  # j - (i + off)
        if self.alibi_slopes is not None:
            s_ij = s_ij - self.alibi_slopes[..., None, None] * np.abs(rel).astype(dtype)
        if self.bias is not None:
            s_ij = s_ij + self.bias[..., i0:i1, j0:j1].astype(dtype)
        hidden = self._hidden(rel, i0, i1, j0, j1)
        # Hidden keys are -inf whatever the bias there holds (even NaN): skipped tiles are never read.
        if hidden is not None:
            s_ij = np.where(hidden, -np.inf, s_ij).astype(dtype, copy=False)
        return s_ij, tanh_ij

    def matmul(self, a, x, seen):
        """a @ x over the pairs ``seen`` marks (a is 0 elsewhere): a hidden key adds nothing, even non-finite."""
        return a @ x if self.finite else matmul_seen(a, x, seen)

    def hide(self, s_ij, x_ij):
        """x_ij with 0 where the key is hidden (s_ij = -inf; a NaN score is seen), where 0 * NaN would leave a NaN;
        x_ij itself when every input is finite (then it is 0 there already)."""
        return x_ij if self.finite else np.where(np.isneginf(s_ij), 0, x_ij).astype(x_ij.dtype, copy=False)

    def drop(self, x_ij, i0, i1, j0, j1, scale=None):
        """x_ij * Z_ij (times ``scale``), the dropout keep mask of the tile; x_ij itself without dropout."""
        if self.dropout is None:
            return x_ij
        kept = np.where(keep_mask(self.dropout, self.batch, np.arange(i0, i1), np.arange(j0, j1)), x_ij, 0)
        return (kept if scale is None else kept * scale).astype(self.dtype, copy=False)

    def add_to_bias_shape(self, dbias, ds_ij, i0, i1, j0, j1):
        """dbias[..., i0:i1, j0:j1] += dS_ij, summed over the dims along which the bias was broadcast.

        dbias has shape ``self.dbias_shape``: the bias's, with at least two dims.
        """
        rows = slice(0, 1) if dbias.shape[-2] == 1 else slice(i0, i1)
        cols = slice(0, 1) if dbias.shape[-1] == 1 else slice(j0, j1)
        target = dbias[..., rows, cols]
        target += sum_to_shape(ds_ij, target.shape, ds_ij.dtype)

    def _hidden(self, rel, i0, i1, j0, j1):
        """Where keys j0:j1 are hidden from queries i0:i1, or None when the tile hides nothing."""
        left, right = self.window
        hidden = None
        if (left != -1 and rel.min() < -left) or (right != -1 and rel.max() > right):
            hidden = ((left != -1) & (rel < -left)) | ((right != -1) & (rel > right))
        if self.mask is not None:
            hidden = _union(hidden, ~self.mask[..., i0:i1, j0:j1])
        if self.block_mask is not None:
            t = BLOCK_MASK_TILE
            rows, cols = np.arange(i0, i1) // t, np.arange(j0, j1) // t
            tile_mask = self.block_mask[..., rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            if not tile_mask.all():
                hidden = _union(hidden, ~tile_mask[..., rows[:, None] - rows[0], cols[None, :] - cols[0]])
        return hidden


def _union(a, b):
    return b if a is None else a | b


def _transpose(x):
    return np.swapaxes(x, -1, -2)


# ---------------------------------------------------------------------------------------------------
# Variable-length packed batches (cupyflash._varlen): each sequence through the dense functions above,
# its heads grouped as (Hk, G) so that k and v broadcast over the G query heads of each group.


@quiet_float_errors
def attention_varlen_forward(q, k, v, packed, *, scale, causal, mods=None, dropout=None, out_dtype=None):
    """out (total_q, H, Dv) in ``out_dtype`` (as in attention_forward) and lse (H, total_q) float32 (float64 for
    float64 inputs)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    out = np.zeros((packed.total_q, packed.heads, packed.dv), dtype=out_dtype)
    lse = np.full((packed.heads, packed.total_q), -np.inf, dtype=lse_dtype(q.dtype))
    for s, q0, q1, k0, k1 in packed.sequences():
        if q1 == q0:
            continue
        qs, ks, vs = _sequence(packed, q, k, v, q0, q1, k0, k1)
        mods_s, dropout_s = _sequence_options(packed, s, mods, dropout)
        if k1 == k0:  # no key: out = 0, lse = -inf, as already filled
            continue
        out_s, lse_s = attention_forward(
            qs, ks, vs, scale=scale, causal=causal, mods=mods_s, dropout=dropout_s, out_dtype=out_dtype
        )
        out[q0:q1] = out_s.reshape(packed.heads, q1 - q0, packed.dv).transpose(1, 0, 2)
        lse[:, q0:q1] = lse_s.reshape(packed.heads, q1 - q0)
    return out, lse


@quiet_float_errors
def attention_varlen_backward(
    dout, q, k, v, out, lse, packed, *, scale, causal, mods=None, dropout=None, grad_dtype=None, summed=False
):
    """dq, dk, dv in the shapes of q, k, v and ``grad_dtype`` (as in attention_backward; dk, dv summed over each
    group's query heads, unrounded where ``summed``: the caller casts)."""
    grad_dtype = lse_dtype(q.dtype) if summed else q.dtype if grad_dtype is None else grad_dtype
    dq, dk, dv = (np.zeros(x.shape, dtype=grad_dtype) for x in (q, k, v))
    hk, g = packed.kv_heads, packed.groups
    for s, q0, q1, k0, k1 in packed.sequences():
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs = _sequence(packed, q, k, v, q0, q1, k0, k1)
        douts, outs = (sequence_view(x, q0, q1, hk) for x in (dout, out))
        lses = lse[:, q0:q1].reshape(hk, g, q1 - q0)
        mods_s, dropout_s = _sequence_options(packed, s, mods, dropout)
        dq_s, dk_s, dv_s, _ = attention_backward(
            douts,
            qs,
            ks,
            vs,
            outs,
            lses,
            scale=scale,
            causal=causal,
            mods=mods_s,
            dropout=dropout_s,
            grad_dtype=grad_dtype,
        )
        dq[q0:q1] = dq_s.reshape(packed.heads, q1 - q0, packed.d).transpose(1, 0, 2)
        for grad, target in ((dk_s, dk), (dv_s, dv)):
            summed = grad.astype(lse_dtype(q.dtype)).sum(axis=1)  # over the G query heads of each group
            target[k0:k1] = summed.transpose(1, 0, 2).astype(grad_dtype)
    return dq, dk, dv


def _sequence(packed, q, k, v, q0, q1, k0, k1):
    """Sequence s's q (Hk, G, n, D) and k, v (Hk, G, m, D), k and v broadcast (stride 0) over G."""
    hk, g = packed.kv_heads, packed.groups
    qs = sequence_view(q, q0, q1, hk)
    ks, vs = (np.broadcast_to(sequence_view(x, k0, k1, hk), (hk, g, k1 - k0, x.shape[2])) for x in (k, v))
    return qs, ks, vs


def _sequence_options(packed, s, mods, dropout):
    """The options as a dense call on sequence s alone sees them: its ALiBi slopes, as (Hk, G), and the
    dropout mask's flat batch index starting at s * H."""
    if mods is not None and mods.alibi_slopes is not None:
        mods = replace(mods, alibi_slopes=mods.alibi_slopes[s].reshape(packed.kv_heads, packed.groups))
    if dropout is not None:
        dropout = replace(dropout, batch_offset=s * packed.heads)
    return mods, dropout
