"""examples/gpt: each layer's hand-written backward against central finite differences in float64 on NumPy, the
whole model's gradients against finite differences (and against torch autograd where torch is installed), a
tiny model that learns on NumPy, and a checkpoint that round-trips.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

import model  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from data import Text  # noqa: E402

TINY = model.Config(vocab=11, context=8, layers=2, width=16, heads=4, kv_heads=2)


def _numeric_grad(f, x, eps=1e-6, count=12, rng=None):
    """Central differences of the scalar f() in ``count`` random entries of x (changed in place, restored)."""
    rng = rng or np.random.default_rng(0)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(count, flat.size), replace=False)
    found = []
    for i in picks:
        keep = flat[i]
        flat[i] = keep + eps
        up = f()
        flat[i] = keep - eps
        down = f()
        flat[i] = keep
        found.append((up - down) / (2 * eps))
    return picks, np.array(found)


def _check(analytic, f, x, rtol=1e-5, atol=1e-8):
    picks, numeric = _numeric_grad(f, x)
    np.testing.assert_allclose(analytic.reshape(-1)[picks], numeric, rtol=rtol, atol=atol)


def test_layernorm_backward():
    rng = np.random.default_rng(1)
    x, g, b = rng.standard_normal((2, 3, 8)) + 0.5, rng.standard_normal(8), rng.standard_normal(8)
    w = rng.standard_normal((2, 3, 8))

    def loss():  # (float64 inputs: statistics in float64 too, model.accumulator)
        return float((model.layernorm_forward(x, g, b)[0] * w).sum())

    out, saved = model.layernorm_forward(x, g, b)
    dx, dg, db = model.layernorm_backward(w, saved)
    for analytic, target in ((dx, x), (dg, g), (db, b)):
        _check(analytic, loss, target)


def test_linear_gelu_backward():
    rng = np.random.default_rng(2)
    x, w, b, dout = (rng.standard_normal(s) for s in ((2, 3, 5), (5, 7), (7,), (2, 3, 7)))

    def loss():
        y, _ = model.linear_forward(x, w, b)
        return float((model.gelu_forward(y)[0] * dout).sum())

    y, s_lin = model.linear_forward(x, w, b)
    _, s_gelu = model.gelu_forward(y)
    dx, dw, db = model.linear_backward(model.gelu_backward(dout, s_gelu), s_lin)
    for analytic, target in ((dx, x), (dw, w), (db, b)):
        _check(analytic, loss, target)


def test_attention_backward_grouped_heads():
    """Causal attention through cupyflash's CPU path (float64), 4 query heads over 2 key/value heads."""
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((2, 8, TINY.width + 2 * TINY.kv * TINY.head_dim))
    dout = rng.standard_normal((2, 8, TINY.width))

    def loss():
        return float((model.attention_forward(qkv, TINY)[0] * dout).sum())

    _, saved = model.attention_forward(qkv, TINY)
    _check(model.attention_backward(dout, saved, TINY), loss, qkv)


def test_cross_entropy_backward():
    rng = np.random.default_rng(4)
    x, wte = rng.standard_normal((2, 5, 6)), rng.standard_normal((11, 6))
    targets = rng.integers(0, 11, size=(2, 5))

    def loss():
        return float(model.cross_entropy_forward(x, wte, targets)[0])

    loss_value, saved = model.cross_entropy_forward(x, wte, targets)
    dx, dwte = model.cross_entropy_backward(saved)
    _check(dx, loss, x, rtol=1e-4, atol=1e-7)
    _check(dwte, loss, wte, rtol=1e-4, atol=1e-7)


def _float64_model(seed=0):
    params = {k: v.astype(np.float64) for k, v in model.init(TINY, np, seed).items()}
    rng = np.random.default_rng(seed + 1)
    for name in params:  # non-trivial gains and biases, so that their gradients are exercised
        params[name] = params[name] + 0.05 * rng.standard_normal(params[name].shape)
    tokens = rng.integers(0, TINY.vocab, size=(2, TINY.context))
    targets = rng.integers(0, TINY.vocab, size=(2, TINY.context))
    return params, tokens, targets


def test_whole_model_gradients_against_finite_differences():
    """Every parameter's gradient, float64 through the whole model, at a dozen entries of each."""
    params, tokens, targets = _float64_model()
    loss, state = model.forward(params, tokens, targets, TINY, np.float64)
    grads = model.backward(state, params, TINY)
    assert set(grads) == set(params)

    def value():
        return float(model.forward(params, tokens, targets, TINY, np.float64)[0])

    for name in params:
        _check(grads[name], value, params[name], rtol=1e-4, atol=1e-7)


def test_whole_model_gradients_against_torch():
    """The same float64 model written with torch's autograd (torch.nn.functional's pieces) gives the same loss
    and gradients."""
    torch = pytest.importorskip("torch")
    params, tokens, targets = _float64_model(seed=5)
    loss, state = model.forward(params, tokens, targets, TINY, np.float64)
    grads = model.backward(state, params, TINY)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    c, h, hk, d = TINY.width, TINY.heads, TINY.kv, TINY.head_dim
    b, n = tokens.shape
    x = t["wte"][torch.tensor(tokens)] + t["wpe"][:n]
    for layer in range(TINY.layers):
        p = f"h{layer}."
        qkv = (
            torch.nn.functional.layer_norm(x, (c,), t[p + "ln1.g"], t[p + "ln1.b"]) @ t[p + "attn.wqkv"]
            + t[p + "attn.bqkv"]
        )
        q = qkv[..., : h * d].reshape(b, n, h, d).transpose(1, 2)
        k = qkv[..., h * d : (h + hk) * d].reshape(b, n, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1)
        v = qkv[..., (h + hk) * d :].reshape(b, n, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + att.transpose(1, 2).reshape(b, n, c) @ t[p + "attn.wo"] + t[p + "attn.bo"]
        hidden = torch.nn.functional.layer_norm(x, (c,), t[p + "ln2.g"], t[p + "ln2.b"]) @ t[p + "mlp.wfc"]
        hidden = torch.nn.functional.gelu(hidden + t[p + "mlp.bfc"], approximate="tanh")
        x = x + hidden @ t[p + "mlp.wproj"] + t[p + "mlp.bproj"]
    x = torch.nn.functional.layer_norm(x, (c,), t["lnf.g"], t["lnf.b"])
    expected = torch.nn.functional.cross_entropy((x @ t["wte"].T).reshape(b * n, -1), torch.tensor(targets).reshape(-1))
    expected.backward()
    assert abs(float(loss) - float(expected)) < 1e-10
    for name in params:
        np.testing.assert_allclose(grads[name], t[name].grad.numpy(), rtol=1e-7, atol=1e-10, err_msg=name)


# The bound: a uniform guess over the vocabulary costs log(V) = log(119) = 4.78 on these docs; the mean training
# loss of this tiny model's last 5 of 50 steps measured 3.42-3.59 over seeds 0-3 (NumPy, float32).
LOSS_AFTER_50_STEPS = 3.8


def test_a_tiny_model_learns_on_numpy(tmp_path):
    argv = ["--steps", "50", "--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--batch", "8",
            "--eval-every", "50", "--checkpoint", str(tmp_path / "gpt.npz"), "--sample", "20"]  # fmt: skip
    found = train.main(argv)
    first, last = np.mean(found["history"]["train"][:5]), np.mean(found["history"]["train"][-5:])
    assert first > np.log(found["config"].vocab) - 0.3  # it starts at a uniform guess
    assert last < LOSS_AFTER_50_STEPS, found["history"]["train"][-5:]
    # the checkpoint round-trips: same config, parameters, optimizer step; a resumed run goes on from it
    config, params, state, step = train.load(tmp_path / "gpt.npz", np)
    assert config == found["config"] and step == 50 and int(state["t"]) == 50
    for name, value in found["params"].items():
        np.testing.assert_array_equal(params[name], value)


def test_optimizer_pieces():
    assert optim.cosine_lr(0, peak=1.0, warmup=10, total=100) == pytest.approx(0.1)
    assert optim.cosine_lr(10, peak=1.0, warmup=10, total=100) == pytest.approx(1.0)
    assert optim.cosine_lr(100, peak=1.0, warmup=10, total=100) == pytest.approx(0.1)
    p = {"w": np.ones((2, 2), np.float32), "b": np.ones(2, np.float32)}
    g = {"w": np.full((2, 2), 3.0, np.float32), "b": np.full(2, 4.0, np.float32)}
    norm = optim.AdamW(lr=0.1, clip=1.0).step(p, g)
    assert norm == pytest.approx(np.sqrt(4 * 9 + 2 * 16))
    assert np.all(p["w"] < 1.0) and np.all(p["b"] < 1.0)  # both moved against their gradients


def test_the_text_is_the_repository_docs():
    text = Text()
    assert text.vocab > 50 and len(text.splits["train"]) > 100_000
    assert text.decode(text.encode("attention")) == "attention"
    x, y = text.batch(np.random.default_rng(0), "val", 3, 10)
    assert x.shape == y.shape == (3, 10) and np.array_equal(x[:, 1:], y[:, :-1])
