"""AdamW over float32 master parameters, with the gradient's global norm clipped and a cosine learning rate.

Weight decay applies to the matrices (2-D parameters: embeddings, projections), not to biases and layernorm
gains, as in GPT-2's and nanoGPT's recipes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class AdamW:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0  # the gradients' global norm is scaled down to this (None: no clipping)

    def __post_init__(self):
        self.m, self.v, self.t = {}, {}, 0

    def step(self, params: dict, grads: dict, lr: float | None = None) -> float:
        """Update ``params`` in place from ``grads`` (float32, same names); returns the gradients' global norm
        before clipping."""
        norm = global_norm(grads)
        scale = min(1.0, self.clip / (norm + 1e-6)) if self.clip is not None else 1.0
        lr = self.lr if lr is None else lr
        self.t += 1
        b1, b2 = self.betas
        correction1, correction2 = 1 - b1**self.t, 1 - b2**self.t
        for name, p in params.items():
            g = grads[name] * scale
            if name not in self.m:
                self.m[name], self.v[name] = p * 0, p * 0
            m, v = self.m[name], self.v[name]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            if p.ndim == 2:
                p *= 1 - lr * self.weight_decay
            p -= lr * (m / correction1) / ((v / correction2) ** 0.5 + self.eps)
        return norm

    def state(self) -> dict:
        """The optimizer's arrays and step, by name, for a checkpoint."""
        return {
            "t": np.array(self.t),
            **{f"m.{k}": v for k, v in self.m.items()},
            **{f"v.{k}": v for k, v in self.v.items()},
        }

    def load(self, state: dict, xp) -> None:
        self.t = int(state["t"])
        self.m = {k[2:]: xp.asarray(v) for k, v in state.items() if k.startswith("m.")}
        self.v = {k[2:]: xp.asarray(v) for k, v in state.items() if k.startswith("v.")}


def global_norm(grads: dict) -> float:
    """sqrt of the sum of every gradient's squares (one value: a wait for the device)."""
    return math.sqrt(sum(float((g.astype(np.float32) ** 2).sum()) for g in grads.values()))


def cosine_lr(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then a cosine decay to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
