"""examples/gpt: each layer's hand-written backward against central finite differences in float64 on NumPy, the
whole model's gradients against finite differences (and, where torch is installed, the benchmark's torch model's
loss, gradients and training steps against ours), a tiny model that learns on NumPy, and a checkpoint that
round-trips; the flat-buffer AdamW against AdamW written per parameter, with its learning rate read from a device
array; the matrix-product helper's NumPy path, and the column-major index logic of its cuBLAS path replayed on
NumPy (the GPU side: tests/gpu/test_gpu_gpt_example.py).
"""

import ctypes
import sys
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

import cublas_ctypes  # noqa: E402
import matmul  # noqa: E402
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
    # the residual stream's gradient, added in (the skip connection around the layernorm)
    dresidual = rng.standard_normal(x.shape)
    dx_plus, dg_plus, db_plus = model.layernorm_backward(w, saved, dresidual=dresidual)
    np.testing.assert_allclose(dx_plus, dx + dresidual, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(dg_plus, dg)
    np.testing.assert_array_equal(db_plus, db)


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
    residual = rng.standard_normal(y.shape)
    np.testing.assert_allclose(model.linear_forward(x, w, b, residual=residual)[0], y + residual, rtol=1e-14)
    # the MLP's first half as one layer (fused on CuPy), the same functions composed on NumPy
    act, saved = model.linear_gelu_forward(x, w, b)
    np.testing.assert_array_equal(act, model.gelu_forward(y)[0])
    for analytic, target in zip(model.linear_gelu_backward(dout, saved), (x, w, b)):
        _check(analytic, loss, target)


def test_merge_heads_writes_where_out_lies():
    """Heads (B, Hk, G, N, D) side by side in each token's row, into a column slice of a wider array (the qkv
    gradient's thirds), leaving its other columns as they were."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 3, 2, 5, 4))
    wide = np.full((2, 5, 2 + 24 + 3), 7.0)
    out = model.merge_heads(x, wide[..., 2:26])
    assert np.shares_memory(out, wide)
    for b, hk, g, n, d in np.ndindex(x.shape):
        assert wide[b, n, 2 + (hk * 2 + g) * 4 + d] == x[b, hk, g, n, d]
    assert (wide[..., :2] == 7.0).all() and (wide[..., 26:] == 7.0).all()


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
    """The same float64 model in torch (examples/gpt/torch_model.py, the benchmark's reference, loaded with these
    parameters) gives the same loss, and autograd the same gradients."""
    torch = pytest.importorskip("torch")
    import torch_model

    params, tokens, targets = _float64_model(seed=5)
    loss, state = model.forward(params, tokens, targets, TINY, np.float64)
    grads = model.backward(state, params, TINY)
    net = torch_model.load(torch_model.GPT(TINY).double(), params)
    assert set(torch_model.names(TINY)) == set(params)
    assert {name for name, _ in torch_model.names(TINY).values()} == set(dict(net.named_parameters()))
    expected = net(torch.tensor(tokens), torch.tensor(targets))
    expected.backward()
    assert abs(float(loss) - expected.item()) < 1e-10
    theirs = torch_model.gradients(net)
    for name in params:
        np.testing.assert_allclose(grads[name], theirs[name], rtol=1e-7, atol=1e-10, err_msg=name)


def test_training_steps_against_torch():
    """Four float64 training steps, ours (model.py, optim.AdamW) and torch's (torch_model: torch.optim.AdamW with the
    same decay groups, clip_grad_norm_) from the same parameters on the same batches at the same learning rates,
    clipping active: the same losses, and the same parameters after every step."""
    torch = pytest.importorskip("torch")
    import torch_model

    params, _, _ = _float64_model(seed=6)
    net = torch_model.load(torch_model.GPT(TINY).double(), params)
    optimizer = optim.AdamW(params, lr=0.0, clip=0.5)
    theirs = torch_model.adamw(net, lr=0.0, fused=False)
    rng = np.random.default_rng(12)
    for i in range(4):
        tokens, targets = (rng.integers(0, TINY.vocab, size=(2, TINY.context)) for _ in range(2))
        lr = optim.cosine_lr(i, peak=3e-2, warmup=2, total=4)
        loss, state = model.forward(params, tokens, targets, TINY, np.float64)
        norm = optimizer.step(model.backward(state, params, TINY), lr=lr)
        assert float(norm) > 0.5  # clipped
        expected = net(torch.tensor(tokens), torch.tensor(targets))
        expected.backward()
        torch_model.step(net, theirs, lr, clip=0.5)
        assert abs(float(loss) - expected.item()) < 1e-10, i
        found = {n: p.detach().numpy() for n, p in net.named_parameters()}
        for name, (their_name, transposed) in torch_model.names(TINY).items():
            value = found[their_name].T if transposed else found[their_name]
            np.testing.assert_allclose(params[name], value, rtol=1e-9, atol=1e-12, err_msg=f"step {i}: {name}")


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
    norm = optim.AdamW(p, lr=0.1, clip=1.0).step(g)
    assert norm.shape == () and float(norm) == pytest.approx(np.sqrt(4 * 9 + 2 * 16))
    assert np.all(p["w"] < 1.0) and np.all(p["b"] < 1.0)  # both moved against their gradients


def _reference_adamw(params, grads_per_step, lrs, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0):
    """AdamW written per parameter, in float64: the global norm clipped to ``clip``, weight decay on the matrices
    only, Adam's bias corrections; the parameters after each step's gradients at each step's learning rate."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in params.items()}
    b1, b2 = betas
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
        scale = min(1.0, clip / (norm + 1e-6))
        for name, p in params.items():
            g = grads[name] * scale
            m[name] = b1 * m[name] + (1 - b1) * g
            v[name] = b2 * v[name] + (1 - b2) * g * g
            if p.ndim == 2:
                p *= 1 - lr * weight_decay
            p -= lr * (m[name] / (1 - b1**t)) / (np.sqrt(v[name] / (1 - b2**t)) + eps)
    return params


def test_adamw_over_one_flat_buffer_matches_per_parameter_adamw():
    """Five steps of the flat-buffer AdamW (the matrices first, decay on that prefix) against AdamW written per
    parameter, with clipping active (gradients of norm ~10 against a bound of 1) and a new learning rate each
    step; the dict's arrays become views that the steps update in place."""
    rng = np.random.default_rng(8)
    params = model.init(TINY, np, 0)
    start = {k: v.copy() for k, v in params.items()}
    optimizer = optim.AdamW(params, lr=1e-3)
    assert optimizer.decay_end == sum(v.size for v in params.values() if v.ndim == 2)
    steps = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()} for _ in range(5)]
    lrs = [optim.cosine_lr(i, peak=1e-2, warmup=2, total=5) for i in range(5)]
    for grads, lr in zip(steps, lrs):
        optimizer.set_lr(lr)
        norm = optimizer.step(grads)
        assert float(norm) == pytest.approx(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values())))
    expected = _reference_adamw(start, steps, lrs)
    for name, value in params.items():
        assert np.shares_memory(value, optimizer.params), name
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert int(optimizer.t[0]) == 5


def test_the_learning_rate_is_read_from_the_device_array():
    """A step reads the learning rate from ``optimizer.lr`` (where a captured step finds it at each replay): one
    optimizer given each step's rate through ``step(lr=...)``, another whose array is written between steps, and a
    third that writes a rate into the array but steps at a different one, agree where they should."""
    rng = np.random.default_rng(9)
    steps = [{"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}]
    steps *= 3
    runs = []
    for how in ("argument", "array", "changed"):
        p = {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}
        optimizer = optim.AdamW(p, lr=0.5)
        for i, grads in enumerate(steps):
            lr = 0.01 * (i + 1)
            if how == "argument":
                optimizer.step(grads, lr=lr)
            elif how == "array":
                optimizer.lr[...] = lr
                optimizer.step(grads)
            else:
                optimizer.set_lr(lr)
                optimizer.lr *= 2
                optimizer.step(grads)
        runs.append(p)
    argument, array, changed = runs
    for name in argument:
        np.testing.assert_array_equal(argument[name], array[name])
        assert not np.allclose(argument[name], changed[name])


def test_optimizer_state_round_trips():
    """An optimizer loaded from another's state (as a checkpoint holds it: step and moments by name) takes the
    same next step."""
    rng = np.random.default_rng(10)
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.init(TINY, np, 0).items()}]
    grads *= 3
    p1 = model.init(TINY, np, 0)
    first = optim.AdamW(p1, lr=1e-2)
    for g in grads[:2]:
        first.step(g)
    p2 = {k: v.copy() for k, v in p1.items()}
    second = optim.AdamW(p2, lr=1e-2)
    second.load({k: np.array(v) for k, v in first.state().items()})
    first.step(grads[2])
    second.step(grads[2])
    for name in p1:
        np.testing.assert_array_equal(p1[name], p2[name])


def test_adamw_keeps_half_precision_copies_of_the_matrices():
    """AdamW.copies: the matrices in bfloat16, rewritten by every step as the float32 parameters rounded to nearest
    even; the parameters' own views for their own dtype; one copy dtype per optimizer, and never a wider one."""
    params = model.init(TINY, np, 0)
    optimizer = optim.AdamW(params, lr=1e-2)
    own = optimizer.copies(np.float32)
    assert set(own) == {k for k, v in params.items() if v.ndim == 2}
    assert all(np.shares_memory(own[k], params[k]) for k in own)
    copies = optimizer.copies(BF16)
    assert set(copies) == set(own) and all(v.dtype == BF16 for v in copies.values())
    rng = np.random.default_rng(13)
    for _ in range(2):
        optimizer.step({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()})
        for name, copy in copies.items():
            np.testing.assert_array_equal(copy, params[name].astype(BF16), err_msg=name)
    with pytest.raises(ValueError, match="keeps its copies"):
        optimizer.copies(np.float16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        optim.AdamW(model.init(TINY, np, 0)).copies(np.float64)


def test_forward_reads_the_weights_it_is_given():
    """model.forward's products take ``weights`` where given (the optimizer's copies), the parameters cast once
    where not: the same loss from the cast matrices, another from other matrices."""
    params = model.init(TINY, np, 0)
    rng = np.random.default_rng(14)
    tokens, targets = (rng.integers(0, TINY.vocab, size=(2, TINY.context)) for _ in range(2))
    loss, _ = model.forward(params, tokens, targets, TINY, BF16)
    weights = model.matrices(params, BF16)
    assert set(weights) == {k for k, v in params.items() if v.ndim == 2}
    assert float(model.forward(params, tokens, targets, TINY, BF16, weights)[0]) == float(loss)
    weights["h0.mlp.wfc"] = weights["h0.mlp.wfc"] * BF16.type(2)
    assert float(model.forward(params, tokens, targets, TINY, BF16, weights)[0]) != float(loss)


def test_a_training_step_on_numpy():
    """train.make_step (the function --graph captures) on NumPy: a finite loss and gradient norm as 0-d arrays,
    every parameter moved; --graph is refused without --device gpu."""
    params = model.init(TINY, np, 0)
    before = {k: v.copy() for k, v in params.items()}
    optimizer = optim.AdamW(params, lr=1e-2)
    rng = np.random.default_rng(11)
    tokens, targets = (rng.integers(0, TINY.vocab, size=(2, TINY.context)) for _ in range(2))
    loss, norm = train.make_step(params, optimizer, TINY, np.float32)(tokens, targets)
    assert loss.shape == norm.shape == () and np.isfinite(float(loss)) and float(norm) > 0
    assert all(not np.array_equal(before[k], params[k]) for k in params)
    for argv in (["--graph"], ["--device", "gpu", "--graph", "--plain"]):
        with pytest.raises(SystemExit):  # a CUDA graph needs the GPU, and captures the fused kernels
            train.parse(argv)


def test_the_text_is_the_repository_docs():
    text = Text()
    assert text.vocab > 50 and len(text.splits["train"]) > 100_000
    assert text.decode(text.encode("attention")) == "attention"
    x, y = text.batch(np.random.default_rng(0), "val", 3, 10)
    assert x.shape == y.shape == (3, 10) and np.array_equal(x[:, 1:], y[:, :-1])


# ------------------------------------------------------------------------------------------ matmul.py
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16])
def test_matmul_numpy_path_is_plain_matmul(dtype):
    """On NumPy the helper is ``a @ b`` cast to out_dtype (default a's dtype: NumPy's own bfloat16 product is
    float32, which would otherwise leak into the activations)."""
    rng = np.random.default_rng(6)
    a, w = rng.standard_normal((2, 3, 5)).astype(dtype), rng.standard_normal((7, 5)).astype(dtype)
    found = matmul.matmul(a, w.T)
    assert found.dtype == dtype and found.shape == (2, 3, 7)
    np.testing.assert_array_equal(found, (a @ w.T).astype(dtype))
    wide = matmul.matmul(a, w.T, np.float64)
    assert wide.dtype == np.float64
    np.testing.assert_array_equal(wide, (a @ w.T).astype(np.float64))
    assert matmul.matmul(a[0, 0], w.T).shape == (7,)  # a 1-D a: a vector times a matrix


def _padded(rng, shape):
    """A standard normal float64 array of ``shape`` inside a larger buffer (so that a wrong leading dimension in
    the replay reads other numbers, not past the allocation), returned as the view."""
    base = rng.standard_normal((shape[0] + 3) * (shape[1] + 5) + 64)
    return base[: shape[0] * (shape[1] + 5)].reshape(shape[0], shape[1] + 5)[:, 2 : 2 + shape[1]]


def _always(r, c):
    return True


# Each builds an (r, c) operand a different way: (how, whether cuBLAS can read it in place for that r and c). A
# stride that neither reading allows is harmless along a dim of length 1, where it is never used.
OPERANDS = {
    "C order": (lambda rng, r, c: np.ascontiguousarray(_padded(rng, (r, c))), _always),
    "a block of a wider array": (lambda rng, r, c: _padded(rng, (r, c)), _always),
    "transposed (w.T)": (lambda rng, r, c: np.ascontiguousarray(_padded(rng, (c, r))).T, _always),
    "a transposed block": (lambda rng, r, c: _padded(rng, (c, r)).T, _always),
    "the last row of each sequence (x[:, -1])": (lambda rng, r, c: rng.standard_normal((r, 4, c))[:, -1], _always),
    "every other column": (lambda rng, r, c: rng.standard_normal((r, 2 * c))[:, ::2], lambda r, c: 1 in (r, c)),
    "rows reversed": (lambda rng, r, c: rng.standard_normal((r, c))[::-1], lambda r, c: r == 1),
}


def _column_major(x, rows, cols, ld):
    """The (rows, cols) column-major matrix with leading dimension ``ld`` that starts at x's first element: what
    cuBLAS reads from x's pointer. It must reach no further than x's own last element (checked first, so that a
    wrong plan fails here rather than reading or writing outside the allocation)."""
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.strides) if stride > 0)
    assert ((rows - 1) + (cols - 1) * ld) * x.itemsize <= last, "the column-major matrix runs past the operand"
    return np.lib.stride_tricks.as_strided(x, shape=(rows, cols), strides=(x.itemsize, ld * x.itemsize))


def _replay_gemm(a, b):
    """a (m, k) @ b (k, n) the way matmul._cublas_gemm hands it to cuBLAS (the same copies, layouts and
    cublasGemmEx arguments, pointers included), with cuBLAS's column-major gemm done by NumPy on the buffers the
    pointers name, into a C-order (m, n) output."""
    m, n = a.shape[0], b.shape[1]
    a, layout_a = matmul._in_place_or_copy(a, np)
    b, layout_b = matmul._in_place_or_copy(b, np)
    out = np.full((m, n), np.nan, a.dtype)
    arguments = matmul.gemm_arguments(a, layout_a, b, layout_b, out)
    (transa, transb, gm, gn, gk, alpha, ptr_a, type_a, lda, ptr_b, type_b, ldb, beta, ptr_c, type_c, ldc, compute,
     algo) = arguments  # fmt: skip
    buffers = {x.ctypes.data: x for x in (a, b, out)}
    assert len(buffers) == 3 and {ptr_a, ptr_b, ptr_c} == set(buffers)
    assert type_a == type_b == type_c == matmul.CUDA_R_64F and compute == matmul.CUBLAS_COMPUTE_64F
    assert algo == matmul.CUBLAS_GEMM_DEFAULT
    # alpha and beta: float64 scalars (the compute type's) in host memory, 1 and 0
    assert (ctypes.c_double.from_address(alpha).value, ctypes.c_double.from_address(beta).value) == (1.0, 0.0)
    n_op, t_op = matmul.CUBLAS_OP_N, matmul.CUBLAS_OP_T
    assert {transa, transb} <= {n_op, t_op}
    # cuBLAS's own checks: op(A) is gm x gk, op(B) gk x gn, stored with at least as many rows as the ld says
    stored_a = (gm, gk) if transa == n_op else (gk, gm)
    stored_b = (gk, gn) if transb == n_op else (gn, gk)
    assert lda >= max(1, stored_a[0]) and ldb >= max(1, stored_b[0]) and ldc >= max(1, gm)
    op_a = _column_major(buffers[ptr_a], *stored_a, lda)
    op_b = _column_major(buffers[ptr_b], *stored_b, ldb)
    op_a, op_b = (op_a if transa == n_op else op_a.T), (op_b if transb == n_op else op_b.T)
    _column_major(buffers[ptr_c], gm, gn, ldc)[...] = op_a @ op_b
    return out, (layout_a, layout_b)


@pytest.mark.parametrize("a_kind", OPERANDS)
@pytest.mark.parametrize("b_kind", OPERANDS)
@pytest.mark.parametrize("m, k, n", [(5, 7, 3), (1, 7, 3), (5, 1, 3), (5, 7, 1), (37, 64, 96)])
def test_cublas_plan_replayed_on_numpy(a_kind, b_kind, m, k, n):
    """The cuBLAS path's layouts and gemmEx arguments, replayed as a column-major gemm on the same buffers, give
    a @ b for every way the model's operands are laid out; those the model passes (C order, transposed views,
    row slices) go in without a copy."""
    rng = np.random.default_rng(m * 10_000 + k * 100 + n)
    (make_a, a_in_place), (make_b, b_in_place) = OPERANDS[a_kind], OPERANDS[b_kind]
    a, b = make_a(rng, m, k), make_b(rng, k, n)
    found, layouts = _replay_gemm(a, b)
    np.testing.assert_allclose(found, a @ b, rtol=1e-12, atol=1e-12)
    for x, in_place in ((a, a_in_place), (b, b_in_place)):
        layout = matmul.operand_layout(x.shape, matmul._element_strides(x))
        assert (layout is not None) == in_place(*x.shape), (x.shape, x.strides)


@pytest.mark.parametrize("a_kind", OPERANDS)
@pytest.mark.parametrize("b_kind", OPERANDS)
def test_a_kept_product_writes_the_arguments_of_the_general_path(a_kind, b_kind):
    """A product kept by layout (matmul._product, whose later calls write only the three pointers) has the
    general path's gemmEx arguments, for a 2-D a and a 3-D one (the model's activations); operands that the
    general path would copy first are not kept."""
    rng = np.random.default_rng(11)
    (make_a, a_in_place), (make_b, b_in_place) = OPERANDS[a_kind], OPERANDS[b_kind]
    for a in (make_a(rng, 6, 7), np.ascontiguousarray(make_a(rng, 6, 7)).reshape(2, 3, 7)):
        b = make_b(rng, 7, 5)
        kept = matmul._product(a, b, np.dtype(np.float64))
        flat = a.reshape(-1, 7)
        if not ((a.ndim == 3 or a_in_place(6, 7)) and b_in_place(7, 5)):
            assert kept is None
            continue
        shape, written, arguments = kept
        assert shape == a.shape[:-1] + (5,) and written == np.float64
        out = np.empty((6, 5))
        arguments[matmul._B], arguments[matmul._A], arguments[matmul._OUT] = (x.ctypes.data for x in (b, a, out))
        layouts = (matmul._in_place_or_copy(flat, np)[1], matmul._in_place_or_copy(b, np)[1])
        assert tuple(arguments) == matmul.gemm_arguments(flat, layouts[0], b, layouts[1], out)


def test_operand_layouts_and_plan_by_hand():
    """The column-major reading spelled out: a C-order (r, c) buffer is the (c, r) transpose with ld c; a
    transposed view w.T of a C-order (c, r) w is the matrix itself with ld c; a row slice keeps its row stride."""
    n_op, t_op = matmul.CUBLAS_OP_N, matmul.CUBLAS_OP_T
    assert matmul.operand_layout((5, 7), (7, 1)) == (n_op, 7)
    assert matmul.operand_layout((7, 5), (1, 7)) == (t_op, 7)
    assert matmul.operand_layout((3, 64), (37 * 64, 1)) == (n_op, 37 * 64)
    assert matmul.operand_layout((5, 7), (14, 2)) is None
    assert matmul.operand_layout((1, 7), (0, 1)) == (n_op, 7)  # a broadcast single row is still one row
    assert matmul.operand_layout((1, 7), (1, 6)) == (t_op, 6)  # one row, every sixth element: no copy either
    assert matmul.operand_layout((4, 1), (0, 1)) is None  # a broadcast column: the same element four times
    # C (m, n) = A (m, k) @ B (k, n), both C order: cuBLAS's C^T (n, m) = B^T A^T, B first, no transposes
    assert matmul.gemm_plan(5, 7, 3, (n_op, 7), (n_op, 3)) == (n_op, n_op, 3, 5, 7, 3, 7, 3)
    with pytest.raises(ValueError, match="too large"):
        matmul.gemm_plan(2**31, 8, 8, (n_op, 8), (n_op, 8))


# cudaDataType by dtype (library_types.h), written out here rather than read from matmul.py
CUDA_R = {np.dtype(np.float64): 1, np.dtype(np.float32): 0, np.dtype(np.float16): 2, BF16: 14}


@pytest.mark.parametrize("dtype", list(matmul.GEMM_TYPES))
def test_gemm_types_by_dtype(dtype):
    """Each operand dtype's cudaDataType, compute type and scalars, and the output types cuBLAS writes: the half
    types accumulate in float32 (alpha and beta float32) and may be written as float32; float64 stays float64."""
    a, b = np.ones((2, 3), dtype), np.ones((3, 4), dtype)
    layouts = (matmul.operand_layout(a.shape, (3, 1)), matmul.operand_layout(b.shape, (4, 1)))
    half = dtype in (BF16, np.float16)
    assert matmul.GEMM_TYPES[dtype][2] == ((dtype, np.dtype(np.float32)) if half else (dtype,))
    for out_dtype in matmul.GEMM_TYPES[dtype][2]:
        out = np.empty((2, 4), out_dtype)
        arguments = matmul.gemm_arguments(a, layouts[0], b, layouts[1], out)
        alpha, type_a, type_b, beta, type_c, compute = (arguments[i] for i in (5, 7, 10, 12, 14, 16))
        assert type_a == type_b == CUDA_R[dtype] and type_c == CUDA_R[out_dtype]
        scalar = ctypes.c_double if dtype == np.float64 else ctypes.c_float
        assert compute == (70 if dtype == np.float64 else 68)  # CUBLAS_COMPUTE_64F, _32F (cublas_api.h)
        assert (scalar.from_address(alpha).value, scalar.from_address(beta).value) == (1.0, 0.0)


def test_libcublas_is_found_among_the_mapped_files():
    """cublas_ctypes binds the libcublas the process has loaded: the first mapped file named libcublas.so[.N...],
    not libcublasLt, whatever its directory (spaces included)."""
    maps = (
        "7f01-7f02 r--p 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f03-7f04 r-xp 00000000 08:01 12 /site packages/nvidia/cu13/lib/libcublasLt.so.13\n"
        "7f05-7f06 r-xp 00000000 08:01 13 /site packages/nvidia/cu13/lib/libcublas.so.13\n"
        "7f07-7f08 rw-p 00000000 00:00 0 \n"
        "7f09-7f0a r-xp 00000000 08:01 14 /usr/local/cuda/lib64/libcublas.so.12.9.1.4\n"
    )
    assert cublas_ctypes.loaded_library(maps) == "/site packages/nvidia/cu13/lib/libcublas.so.13"
    assert cublas_ctypes.loaded_library(maps.splitlines()[-1]) == "/usr/local/cuda/lib64/libcublas.so.12.9.1.4"
    assert cublas_ctypes.loaded_library("\n".join(maps.splitlines()[:2])) is None


def test_cublas_handle_sets_the_stream_and_its_workspace_on_each_change(monkeypatch):
    """A handle sets cuBLAS's stream only when the stream changes, and then the stream's workspace too (setting the
    stream resets cuBLAS to a workspace pool of its own, which allocates); each stream keeps the workspace it was
    given first. Replayed with a stand-in for libcublas that records its calls."""
    calls = []

    class Library:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, *args[1:])) or 0  # the handle, then the rest; status 0

    workspaces = iter(range(100, 200))
    monkeypatch.setattr(cublas_ctypes, "_lib", Library())
    monkeypatch.setattr(cublas_ctypes, "_refuse_under_capture", lambda what: None)
    monkeypatch.setattr(cublas_ctypes, "_allocate_workspace", lambda: SimpleNamespace(ptr=next(workspaces), size=32))
    handle = cublas_ctypes._Handle()
    assert calls == [("cublasCreate_v2",), ("cublasSetPointerMode_v2", cublas_ctypes.CUBLAS_POINTER_MODE_HOST)]
    calls.clear()
    for stream in (0, 7, 7, 9, 0, 0, 9):
        handle.use(stream)
    set_stream_and_workspace = {
        stream: [("cublasSetStream_v2", stream), ("cublasSetWorkspace_v2", workspace, 32)]
        for stream, workspace in ((0, 100), (7, 101), (9, 102))
    }
    assert calls == sum((set_stream_and_workspace[s] for s in (0, 7, 9, 0, 9)), [])


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_every_product_of_a_half_precision_step_has_one_dtype(monkeypatch, dtype):
    """The cuBLAS path takes two operands of one dtype and refuses a mix: a forward and backward in bfloat16 (and
    float16) on NumPy sends every product two operands of one dtype, the activations' (in bfloat16 the tied
    head's weight gradient too, from dlogits rounded as every layer's dout is) or float32 (that gradient in
    float16, whose range would flush dlogits), and ends with float32 gradients."""
    calls = []

    def recorded(a, b, out_dtype=None):
        calls.append((a.dtype, b.dtype))
        return matmul.matmul(a, b, out_dtype)

    monkeypatch.setattr(model, "matmul", recorded)
    params = model.init(TINY, np, 0)
    rng = np.random.default_rng(7)
    tokens, targets = (rng.integers(0, TINY.vocab, size=(2, TINY.context)) for _ in range(2))
    loss, state = model.forward(params, tokens, targets, TINY, dtype)
    grads = model.backward(state, params, TINY)
    expected = {(np.dtype(dtype),) * 2} | ({(np.dtype(np.float32),) * 2} if dtype == np.float16 else set())
    assert set(calls) == expected
    assert len(calls) == 4 * TINY.layers * 3 + 3  # each linear: 1 forward, 2 backward; the head: 1 + 2
    assert np.isfinite(float(loss)) and all(g.dtype == np.float32 and np.isfinite(g).all() for g in grads.values())
    assert model.gelu_forward(np.ones((2, 3), dtype))[0].dtype == dtype


# ------------------------------------------------------------------------------------------ fused.py's sources
def _nvrtc():
    """CuPy's NVRTC binding and its compiler options (CuPy's headers, CUDA's), or a skip where it cannot load."""
    try:
        import cupy._core.core as cupy_core
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return nvrtc, cupy_core.assemble_cupy_compiler_options(("--std=c++17", "-ftz=true"))
    except Exception as exc:  # no CuPy, no NVRTC, or no CUDA headers: nothing to compile with here
        pytest.skip(f"NVRTC cannot compile here: {exc!r}")


def _compile(nvrtc, options, source, names, arch) -> dict:
    """NVRTC's build of ``source`` with the name expressions ``names``: ptxas' report (registers, spills, stack
    frame) of each, by name."""
    from cupyflash._cuda.ptxas_report import parse_ptxas

    program = nvrtc.createProgram(source, "gpt_fused.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, [*options, f"-arch={arch}", "-Xptxas", "-v"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(program))
        found = parse_ptxas(nvrtc.getProgramLog(program))
        return {name: found[nvrtc.getLoweredName(program, name)] for name in names}
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fused_kernels_compile(arch):
    """fused.cu's templates, every one fused.py launches (each pointwise kernel with packs of 1 and 16 bytes) for
    every dtype, compile with NVRTC (no GPU needed), with no spills and no stack frame."""
    import fused

    nvrtc, options = _nvrtc()
    for dtype in fused._CTYPES:
        names = fused._names(dtype)
        assert {name.split("<")[0] for name in names} >= set(fused._KERNELS) - {"softmax_cross_entropy"}
        report = _compile(nvrtc, options, fused._SOURCE.read_text(), names, arch)
        spilled = {n: r for n, r in report.items() if r["spill_stores"] or r["spill_loads"] or r["stack_frame"]}
        assert not spilled, spilled


def test_fused_kernel_names_and_packs():
    """The template arguments fused.py asks for: T and A by dtype, 16-byte packs of T, or of A for the kernels
    that stream the accumulator's arrays (the optimizer's buffers, the loss's probabilities)."""
    import fused

    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert fused._template("bias_add", bf16, 8) == "bias_add<__nv_bfloat16, float, 8>"
    assert fused._template("merge_heads", np.float16, 8) == "merge_heads<__half, 8>"
    assert fused._template("layernorm_forward", np.float64) == "layernorm_forward<double, double>"
    names = fused._names(bf16)
    assert "adamw<__nv_bfloat16, float, 4>" in names and "cross_entropy_backward<__nv_bfloat16, float, 4>" in names
    assert "column_sums<__nv_bfloat16, float, 8>" in names and "column_sums<__nv_bfloat16, float, 1>" in names
    assert "column_totals<float>" in names  # the column sums' partial sums, added in float32
    assert not any(n.startswith("softmax_cross_entropy") for n in names)
    assert "softmax_cross_entropy<float>" in fused._names(np.float32)
    assert "bias_gelu_forward<double, double, 2>" in fused._names(np.float64)


class _Pointer:
    """A stand-in for a CuPy array in fused._pack: a device address and an item size."""

    def __init__(self, ptr, itemsize):
        self.data, self.itemsize = SimpleNamespace(ptr=ptr), itemsize


def test_pack_width_follows_alignment_and_rows():
    """16 bytes per load where every array starts on a multiple of its pack and rows hold whole packs; else 1."""
    import fused

    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert fused._pack(bf16, _Pointer(256, 2), _Pointer(512, 2), width=768) == 8
    assert fused._pack(bf16, _Pointer(256, 2), None, width=768) == 8  # an absent array (a null pointer)
    assert fused._pack(bf16, _Pointer(256 + 2, 2), width=768) == 1  # a view one element in
    assert fused._pack(bf16, _Pointer(256 + 16, 2), width=768) == 8  # a view eight elements in
    assert fused._pack(bf16, _Pointer(256, 2), width=770) == 1  # rows of 770: packs would straddle them
    assert fused._pack(np.float32, _Pointer(256, 4), _Pointer(256 + 8, 2)) == 4  # a bfloat16 copy: 8-byte packs
    assert fused._pack(np.float32, _Pointer(256, 4), _Pointer(256 + 4, 2)) == 1
    assert fused._pack(np.float64, _Pointer(256, 8), width=3) == 1
