"""Random attention problems, shared by the CPU (NumPy) and GPU (CuPy) tests."""

import numpy as np


def random_array(rng, shape, dtype, *, xp=np):
    """Standard-normal values rounded to ``dtype``, as an array of module ``xp`` (numpy or cupy)."""
    return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def random_problem(rng, q_shape, k_shape, v_shape, dtype, *, xp=np):
    """q, k, v of the given shapes and a dout of the output's shape, as arrays of module ``xp``."""
    q, k, v = (random_array(rng, shape, dtype, xp=xp) for shape in (q_shape, k_shape, v_shape))
    batch = np.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2])
    return q, k, v, random_array(rng, batch + (q_shape[-2], v_shape[-1]), dtype, xp=xp)


def check_bhnd(rng, check, dtype, batch, nq, nk, d, dv, causal, scale=None, *, run, xp=np):
    """Draw a (batch..., N, D) problem, run forward + backward with ``run``, and ``check`` the results."""
    q, k, v, dout = random_problem(rng, batch + (nq, d), batch + (nk, d), batch + (nk, dv), dtype, xp=xp)
    check(q, k, v, dout, run(q, k, v, dout, causal=causal, scale=scale), causal=causal, scale=scale)


def shifted_problem(rng, q_shape, k_shape, v_shape, dtype, *, xp=np):
    """As ``random_problem``, with a harder case for attention's rounding: 0.5 added to q, k and dout and 3 to
    v (values away from zero), and q's and k's dims 3 and 7 multiplied by 8 (trained models' outlier channels:
    scores spread over about 10, softmax rows dominated by a few keys). Needs D >= 8."""
    q, k, v, dout = (
        rng.standard_normal(shape, dtype=np.float32)
        for shape in (
            q_shape,
            k_shape,
            v_shape,
            np.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2]) + (q_shape[-2], v_shape[-1]),
        )
    )
    for x in (q, k):
        x += 0.5
        x[..., [3, 7]] *= 8.0
    v += 3.0
    dout += 0.5
    return tuple(xp.asarray(x.astype(dtype)) for x in (q, k, v, dout))
