"""The CPU back end for NumPy inputs: FlashAttention's algorithm, tile by tile, in NumPy float32.

Same arguments and results as cupyflash._kernels (see the internal contract there): q (*batch, Nq, D),
k (*batch, Nk, D), v (*batch, Nk, Dv) of one dtype with identical batch shapes (stride-0 views welcome),
Nq, Nk, prod(batch) >= 1, already validated by cupyflash._api.

Forward: for each block of BLOCK_Q queries, sweep the key blocks it can see keeping the online-softmax
state per row: running max m_i, running sum l_i of exp(S_ij - m_i), and the unnormalized output
accumulator acc_i, rescaled by exp(m_old - m_new) whenever the max grows. Only lse = m_i + log(l_i) is
saved for the backward. Backward: delta_i = rowsum(dout_i * out_i), then for each key block the query
blocks that see it, recomputing P_ij = exp(S_ij - lse_i) and accumulating
dV_j += P_ij^T dO_i,  dP_ij = dO_i V_j^T,  dS_ij = P_ij * (dP_ij - delta_i),
dQ_i += scale dS_ij K_j,  dK_j += scale dS_ij^T Q_i.
At most one (BLOCK_Q x BLOCK_K) score tile per batch element exists at a time: never Nq x Nk.
"""

import numpy as np

BLOCK_Q = 64
BLOCK_K = 64
COMPUTE_DTYPE = np.float32


def attention_forward(q, k, v, *, scale, causal):
    """Returns out (*batch, Nq, Dv) in the inputs' dtype and lse (*batch, Nq) float32."""
    nq = q.shape[-2]
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    lse = np.empty(q.shape[:-1], dtype=COMPUTE_DTYPE)
    for i0 in range(0, nq, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, nq)
        out[..., i0:i1, :], lse[..., i0:i1] = _forward_query_block(q, k, v, i0, i1, scale, causal)
    return out, lse


def _forward_query_block(q, k, v, i0, i1, scale, causal):
    """Online softmax of queries i0:i1 over every key block they see."""
    nq, nk = q.shape[-2], k.shape[-2]
    q_i = q[..., i0:i1, :].astype(COMPUTE_DTYPE)
    m_i = np.full(q_i.shape[:-1], -np.inf, dtype=COMPUTE_DTYPE)
    l_i = np.zeros(q_i.shape[:-1], dtype=COMPUTE_DTYPE)
    acc_i = np.zeros(q_i.shape[:-1] + v.shape[-1:], dtype=COMPUTE_DTYPE)
    for j0 in range(0, _keys_seen(i1, nq, nk, causal), BLOCK_K):
        j1 = min(j0 + BLOCK_K, nk)
        s_ij = _scores(q_i, k[..., j0:j1, :], scale, i0, i1, j0, j1, nq, nk, causal)
        m_new = np.maximum(m_i, s_ij.max(axis=-1))
        # A row that has seen only masked keys keeps m = -inf; shift it by 0 so that no -inf - -inf
        # (NaN) appears: its p_ij are exp(-inf) = 0 and its alpha exp(-inf) = 0.
        m_shift = np.where(np.isneginf(m_new), 0, m_new)
        p_ij = np.exp(s_ij - m_shift[..., None])
        alpha = np.exp(m_i - m_shift)
        l_i = alpha * l_i + p_ij.sum(axis=-1)
        acc_i = alpha[..., None] * acc_i + p_ij @ v[..., j0:j1, :].astype(COMPUTE_DTYPE)
        m_i = m_new
    seen = l_i > 0  # False only for rows that see no key at all (causal with Nq > Nk)
    out_i = np.where(seen[..., None], acc_i / np.where(seen, l_i, 1)[..., None], 0)
    lse_i = np.where(seen, m_i + np.log(np.where(seen, l_i, 1)), -np.inf)
    return out_i, lse_i


def attention_backward(dout, q, k, v, out, lse, *, scale, causal):
    """Returns dq, dk, dv with the full batch shape, in the inputs' dtype."""
    nk = k.shape[-2]
    delta = np.sum(dout.astype(COMPUTE_DTYPE) * out.astype(COMPUTE_DTYPE), axis=-1)
    # Rows that see no key have lse = -inf; +inf instead makes their P = exp(S - inf) = 0, never NaN.
    lse = np.where(np.isneginf(lse), np.inf, lse)
    dq = np.zeros(q.shape, dtype=COMPUTE_DTYPE)
    dk = np.empty(k.shape, dtype=q.dtype)
    dv = np.empty(v.shape, dtype=q.dtype)
    for j0 in range(0, nk, BLOCK_K):
        j1 = min(j0 + BLOCK_K, nk)
        dk[..., j0:j1, :], dv[..., j0:j1, :] = _backward_key_block(
            dout, q, k, v, lse, delta, dq, j0, j1, scale, causal
        )
    return dq.astype(q.dtype), dk, dv


def _backward_key_block(dout, q, k, v, lse, delta, dq, j0, j1, scale, causal):
    """dK_j and dV_j for keys j0:j1; adds this block's share of dQ into dq (float32) in place."""
    nq, nk = q.shape[-2], k.shape[-2]
    k_j = k[..., j0:j1, :].astype(COMPUTE_DTYPE)
    v_j = v[..., j0:j1, :].astype(COMPUTE_DTYPE)
    dk_j = np.zeros(k_j.shape, dtype=COMPUTE_DTYPE)
    dv_j = np.zeros(v_j.shape, dtype=COMPUTE_DTYPE)
    for i0 in range(_first_query_seeing(j0, nq, nk, causal), nq, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, nq)
        q_i = q[..., i0:i1, :].astype(COMPUTE_DTYPE)
        dout_i = dout[..., i0:i1, :].astype(COMPUTE_DTYPE)
        s_ij = _scores(q_i, k_j, scale, i0, i1, j0, j1, nq, nk, causal)
        p_ij = np.exp(s_ij - lse[..., i0:i1, None])
        dv_j += _transpose(p_ij) @ dout_i
        dp_ij = dout_i @ _transpose(v_j)
        ds_ij = p_ij * (dp_ij - delta[..., i0:i1, None])
        dq[..., i0:i1, :] += scale * (ds_ij @ k_j)
        dk_j += scale * (_transpose(ds_ij) @ q_i)
    return dk_j, dv_j


def _scores(q_i, k_j, scale, i0, i1, j0, j1, nq, nk, causal):
    """S_ij = scale * Q_i K_j^T, with -inf where the causal mask hides key j from query i."""
    s_ij = scale * (q_i @ _transpose(k_j.astype(COMPUTE_DTYPE)))
    # Bottom-right aligned causal mask: query i sees key j iff j <= i + (Nk - Nq). Tiles wholly below
    # the diagonal need no mask.
    if causal and j1 - 1 > i0 + nk - nq:
        rows = np.arange(i0, i1)[:, None]
        cols = np.arange(j0, j1)[None, :]
        s_ij = np.where(cols <= rows + (nk - nq), s_ij, -np.inf)
    return s_ij


def _keys_seen(i1, nq, nk, causal):
    """End of the key range that queries below i1 see (0 when none sees any)."""
    if not causal:
        return nk
    return max(0, min(nk, i1 + nk - nq))


def _first_query_seeing(j0, nq, nk, causal):
    """First query that sees key j0: the queries before it see no key j >= j0."""
    if not causal:
        return 0
    return max(0, j0 - (nk - nq))


def _transpose(x):
    return np.swapaxes(x, -1, -2)
