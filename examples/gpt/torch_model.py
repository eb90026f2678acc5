"""model.py's GPT in PyTorch, parameter for parameter, with its optimizer: what bench/bench_gpt.py times ours
against, from the same initial weights (``load``) and on the same batches.

The layers are torch's own (``nn.LayerNorm``, ``nn.Linear``, ``F.scaled_dot_product_attention``, GELU's tanh form,
``F.cross_entropy``); the head is tied to the token embedding; AdamW is ``torch.optim.AdamW`` with weight decay on
the matrices only and the gradients' global norm clipped first (``clip_grad_norm_``), as optim.py does. An
``nn.Linear`` holds its weight as (out, in): model.py's (in, out) matrix transposed.

Precision is the caller's: the benchmark runs it under ``torch.autocast(dtype=torch.bfloat16)``, where the products
and GELU run in bfloat16 and layernorm, the residual stream and the loss stay float32 (model.py keeps the residual
stream in bfloat16 and adds in float32); the tests run it in float64 against model.py in float64.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, width: int, qkv: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, qkv), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)


class GPT(torch.nn.Module):
    """``GPT(config)(tokens, targets)``: the mean cross-entropy of predicting targets (B, N) from tokens (B, N)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        c, qkv = config.width, config.width + 2 * config.kv * config.head_dim
        self.wte, self.wpe = torch.nn.Embedding(config.vocab, c), torch.nn.Embedding(config.context, c)
        self.blocks = torch.nn.ModuleList(Block(c, qkv) for _ in range(config.layers))
        self.lnf = torch.nn.LayerNorm(c)

    def forward(self, tokens, targets):
        b, n = tokens.shape
        h, hk, d = self.config.heads, self.config.kv, self.config.head_dim
        x = self.wte(tokens) + self.wpe.weight[:n]
        for block in self.blocks:
            qkv = block.qkv(block.ln1(x))
            q = qkv[..., : h * d].unflatten(-1, (h, d)).transpose(1, 2)  # (B, H, N, D)
            k = qkv[..., h * d : (h + hk) * d].unflatten(-1, (hk, d)).transpose(1, 2)
            v = qkv[..., (h + hk) * d :].unflatten(-1, (hk, d)).transpose(1, 2)
            if hk != h:  # query head i reads key/value head i // (H / Hk), as model.py's grouping does
                k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.proj(att.transpose(1, 2).reshape(b, n, h * d))
            x = x + block.out(F.gelu(block.fc(block.ln2(x)), approximate="tanh"))
        logits = F.linear(self.lnf(x), self.wte.weight)
        if logits.dtype in (torch.bfloat16, torch.float16):  # the loss's softmax in float32, as model.py's
            logits = logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten().long())


def names(config) -> dict[str, tuple[str, bool]]:
    """model.py's parameter name -> (this model's, whether the matrix is transposed)."""
    found = {"wte": ("wte.weight", False), "wpe": ("wpe.weight", False)}
    for layer in range(config.layers):
        ours, theirs = f"h{layer}.", f"blocks.{layer}."
        for a, b in (("ln1", "ln1"), ("ln2", "ln2")):
            found[ours + a + ".g"] = (theirs + b + ".weight", False)
            found[ours + a + ".b"] = (theirs + b + ".bias", False)
        for a, b, w, bias in (("attn", "qkv", "wqkv", "bqkv"), ("attn", "proj", "wo", "bo"),
                              ("mlp", "fc", "wfc", "bfc"), ("mlp", "out", "wproj", "bproj")):  # fmt: skip
            found[f"{ours}{a}.{w}"] = (f"{theirs}{b}.weight", True)
            found[f"{ours}{a}.{bias}"] = (f"{theirs}{b}.bias", False)
    found.update({"lnf.g": ("lnf.weight", False), "lnf.b": ("lnf.bias", False)})
    return found


def load(model: GPT, params: dict) -> GPT:
    """Copy model.py's parameters (NumPy or CuPy arrays) into ``model``, in its dtype and on its device."""
    state = model.state_dict()
    with torch.no_grad():
        for ours, (theirs, transposed) in names(model.config).items():
            value = torch.from_numpy(np.ascontiguousarray(_host(params[ours])))
            state[theirs].copy_(value.T if transposed else value)
    return model


def gradients(model: GPT) -> dict:
    """The parameters' gradients under model.py's names and layouts, as float64 NumPy arrays."""
    found = dict(model.named_parameters())
    out = {}
    for ours, (theirs, transposed) in names(model.config).items():
        grad = found[theirs].grad.detach().double().cpu()
        out[ours] = (grad.T if transposed else grad).numpy()
    return out


def adamw(model: GPT, lr: float, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused: bool | None = None):
    """torch.optim.AdamW over the model with optim.AdamW's settings: decay on the matrices (embeddings included),
    none on biases and layernorm gains."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def step(model: GPT, optimizer, lr: float, clip: float | None = 1.0) -> None:
    """After backward: clip the gradients' global norm to ``clip`` (optim.AdamW's rule), step at ``lr``, clear the
    gradients."""
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()
