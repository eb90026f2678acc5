"""The CPU path of the FP8 attention forward (NumPy FP8Tensors), and the naive implementation it is checked
by: the scores from the e4m3 values of q and k, the probabilities P rounded to e4m3 as the GPU kernel rounds
them before its P V product, every other step in float64. The GPU kernel computes the same with an online
softmax over key tiles (and float32 sums); nothing else in the library implements these numerics.

With qd, kd, vd the e4m3 values of q, k, v and sq, sk, sv the scales of their rows (row i takes
``scale[..., i // block]``), for each query row i over the keys j it sees:

    S_ij  = (sum_d qd_id kd_jd) sq_i sk_j
    m_i   = max_j scale S_ij
    p_ij  = exp(scale S_ij - m_i)                       l_i = sum_j p_ij
    p8_ij = e4m3(p_ij * 2^8)
    out_i = (sum_j p8_ij vd_j sv_j) / (2^8 l_i)         lse_i = m_i + log(l_i)

The factor 2^8 puts the largest probability, 1, at 256, high in e4m3's range (largest value 448), so the
probabilities keep e4m3's 3 mantissa bits down to 2^-14 of the row's largest before becoming subnormal. v's
descales apply to the products, not to P (the kernel rescales its running O per key block), so P's rounding
does not depend on them. A row that sees no key gets
out 0 and lse -inf. The sums run in float64 (l_i is not rounded to float32 as in the kernel: the results
are rounded once, out to ``out_dtype`` and lse to float32).

Queries are processed BLOCK_Q rows at a time, so memory stays O(BLOCK_Q * Nk) per leading-dim slice.
"""

import numpy as np

from cupyflash._arrays import from_float, quiet_float_errors
from cupyflash._fp8.tensor import decode_e4m3, encode_e4m3, row_scales

BLOCK_Q = 256
P_OFFSET = 256.0  # 2^8: the e4m3 value of a probability of 1


@quiet_float_errors
def attention_forward_fp8(q, k, v, *, scale, causal, out_dtype):
    """Returns out (*lead, Nq, Dv) ``out_dtype`` and lse (*lead, Nq) float32.

    q, k, v: NumPy FP8Tensors of shapes (*lead, Nq, D), (*lead, Nk, D), (*lead, Nk, Dv), their data and
    scale broadcast to the same leading dims (stride-0 views welcome), validated by cupyflash._fp8.api;
    Nq, Nk, prod(lead) >= 1. ``scale`` multiplies the scores; ``causal`` is bottom-right aligned.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    kd, vd = decode_e4m3(k.data, np.float64), decode_e4m3(v.data, np.float64)
    sq = row_scales(q.scale.astype(np.float64), q.block, nq)
    sk = row_scales(k.scale.astype(np.float64), k.block, nk)
    sv = row_scales(v.scale.astype(np.float64), v.block, nk)
    v_values = vd * sv[..., None]  # the real values of v's e4m3 codes
    out = np.empty(q.shape[:-1] + v.shape[-1:], dtype=out_dtype)
    lse = np.empty(q.shape[:-1], dtype=np.float32)
    for i0 in range(0, nq, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, nq)
        qd_i = decode_e4m3(q.data[..., i0:i1, :], np.float64)
        s_ij = (qd_i @ kd.swapaxes(-1, -2)) * sq[..., i0:i1, None] * sk[..., None, :] * scale
        if causal:  # query i sees key j iff j <= i + Nk - Nq
            rows = np.arange(i0, i1)[:, None]
            s_ij = np.where(np.arange(nk) <= rows + nk - nq, s_ij, -np.inf)
        m_i = s_ij.max(axis=-1)
        seen = ~np.isneginf(m_i)  # False for a row that sees no key
        p_ij = np.exp(s_ij - np.where(seen, m_i, 0)[..., None])
        l_i = np.where(seen, p_ij.sum(axis=-1), 1.0)
        p8_ij = decode_e4m3(encode_e4m3(p_ij * P_OFFSET), np.float64)
        out_i = (p8_ij @ v_values) / (P_OFFSET * l_i)[..., None]
        out[..., i0:i1, :] = from_float(np.where(seen[..., None], out_i, 0.0), out_dtype)
        lse[..., i0:i1] = np.where(seen, m_i + np.log(l_i), -np.inf)
    return out, lse
