"""A dense call's checked problem: ``validate`` runs the one set of checks that every dense entry point takes
(the public functions of cupyflash._api and the ring of cupyflash.distributed) and returns a ``Problem``, what
the validated inputs describe. The checks themselves live in cupyflash._checks and cupyflash._modifiers.
"""

from __future__ import annotations

import math

from cupyflash import _modifiers
from cupyflash._checks import (
    check_array_types,
    check_causal,
    check_dtypes,
    check_forward_outputs,
    check_head_dims,
    check_shapes,
    resolve_scale,
)


class Problem:
    """What the validated inputs describe: array module, dtype, shapes, and the resolved options."""

    def __init__(self, xp, dtype, batch, q, k, v, scale, causal, mods):
        self.xp, self.dtype, self.batch = xp, dtype, batch
        self.nq, self.nk = q.shape[-2], k.shape[-2]
        self.d, self.dv = q.shape[-1], v.shape[-1]
        self.scale, self.causal = scale, causal
        self.mods = mods  # a _modifiers.Modifiers, or None when every score modifier is off

    @property
    def is_empty(self):
        return math.prod(self.batch) == 0 or self.nq == 0 or self.nk == 0


def validate(arrays, causal, scale, options) -> Problem:
    """Check the inputs of a dense call; ``arrays`` maps names to arrays and holds q, k, v (and for the
    backward out, dout and lse); ``options`` are the score-modifier keywords."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    xp = check_array_types(arrays)
    dtype = check_dtypes(arrays)
    batch = check_shapes(q, k, v)
    check_head_dims(q, v)
    if "out" in arrays:
        check_forward_outputs(arrays, batch)
    causal = check_causal(causal)
    scale = resolve_scale(scale, q.shape[-1])
    mods = _modifiers.resolve(xp, dtype, batch, q.shape[-2], k.shape[-2], **options)
    return Problem(xp, dtype, batch, q, k, v, scale, causal, mods)
