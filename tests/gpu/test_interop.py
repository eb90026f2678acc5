"""PyTorch interop through DLPack (gpu; skipped without torch): torch CUDA tensors go to CuPy and back
without a copy, and cupyflash on them matches torch's own SDPA in float64 (forward) and autograd
(backward). torch is never a dependency of cupyflash; this is the README's recipe, checked.

The second half checks examples/torch_attention.py, the fast PyTorch operation of docs/interop.md: its
``to_cupy`` views every strided tensor without a copy, its autograd Function hands the options through and
gives the bits of direct calls, on torch's default stream and on a side stream alike, and its gradients
match torch's in float64."""

import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

import cupyflash

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Relative max-norm error against float64, as `python -m cupyflash` checks; gradients get twice as much.
TOLERANCES = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5}
GRAD_TOLERANCE_FACTOR = 2
BF16 = np.dtype(ml_dtypes.bfloat16)
DLPACK_ERRORS = (BufferError, TypeError, NotImplementedError, RuntimeError)

# examples/ is no package: the example is imported from its folder, as its docstring tells users to.
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import torch_attention  # noqa: E402  (after torch's importorskip: it imports torch)


def to_cupy(t):
    """A torch CUDA tensor as a CuPy array on the same memory. CuPy >= 14 (with NumPy >= 2.1.2) imports
    bfloat16 as ml_dtypes.bfloat16 directly; otherwise its bits travel as int16 and are viewed back."""
    try:
        x = cupy.from_dlpack(t)
    except DLPACK_ERRORS:
        if t.dtype != torch.bfloat16:
            raise
        x = cupy.from_dlpack(t.view(torch.int16)).view(BF16)
    assert x.data.ptr == t.data_ptr(), "DLPack made a copy"
    return x


def to_torch(x):
    """A CuPy array as a torch tensor on the same memory (bfloat16 through int16 where needed)."""
    try:
        t = torch.from_dlpack(x)
    except DLPACK_ERRORS:
        if x.dtype != BF16:
            raise
        t = torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
    assert t.data_ptr() == x.data.ptr, "DLPack made a copy"
    return t


def sdpa_float64(q, k, v, causal):
    """torch's SDPA in float64 (its math backend) on (B, H, N, D) tensors; causal bottom-right aligned as
    in cupyflash (torch's is_causal is top-left aligned, which differs when Nq != Nk)."""
    nq, nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq) if causal else None
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max()).item()


def bnhd(b, n, h, d, dtype, generator):
    """A (B, N, H, D) tensor, FlashAttention's layout, in a dtype."""
    x = torch.randn(b, n, h, d, device="cuda", dtype=torch.float32, generator=generator)
    return x.to(TORCH_DTYPES[dtype])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_forward_on_torch_tensors_without_copies(dtype, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, nq, nk, d = 2, 3, 77, 133, 64
    q_t, k_t, v_t = bnhd(b, nq, h, d, dtype, g), bnhd(b, nk, h, d, dtype, g), bnhd(b, nk, h, d, dtype, g)
    # (B, N, H, D) -> (B, H, N, D): strided views on both sides, no copy anywhere
    q, k, v = (to_cupy(x).transpose(0, 2, 1, 3) for x in (q_t, k_t, v_t))
    assert q.dtype == (BF16 if dtype == "bfloat16" else np.dtype(dtype))
    out = to_torch(cupyflash.attention(q, k, v, causal=causal))
    assert out.dtype == TORCH_DTYPES[dtype] and out.shape == (b, h, nq, d)
    torch.cuda.synchronize()
    ref = sdpa_float64(*(x.transpose(1, 2) for x in (q_t, k_t, v_t)), causal)
    assert rel_err(out, ref) <= TOLERANCES[dtype], f"{dtype} causal={causal}: {rel_err(out, ref):.2e}"


def test_backward_matches_torch_autograd():
    dtype, causal = "bfloat16", True
    g = torch.Generator(device="cuda").manual_seed(1)
    q_t, k_t, v_t, dout_t = (
        torch.randn(1, 4, 96, 64, device="cuda", generator=g).to(TORCH_DTYPES[dtype]) for _ in range(4)
    )
    q, k, v, dout = (to_cupy(x) for x in (q_t, k_t, v_t, dout_t))
    out, lse = cupyflash.attention_forward(q, k, v, causal=causal)
    grads = [to_torch(x) for x in cupyflash.attention_backward(dout, q, k, v, out, lse, causal=causal)]
    torch.cuda.synchronize()

    leaves = [x.double().requires_grad_() for x in (q_t, k_t, v_t)]
    sdpa_float64(*leaves, causal).backward(dout_t.double())
    limit = TOLERANCES[dtype] * GRAD_TOLERANCE_FACTOR
    for name, ours, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert ours.dtype == TORCH_DTYPES[dtype] and ours.shape == leaf.shape
        assert rel_err(ours, leaf.grad) <= limit, f"{name}: {rel_err(ours, leaf.grad):.2e} > {limit}"
    assert rel_err(to_torch(out), sdpa_float64(q_t, k_t, v_t, causal)) <= TOLERANCES[dtype]


# ---------------------------------------------------------------------------------------------------
# examples/torch_attention.py
# ---------------------------------------------------------------------------------------------------


def _generator(rng):
    """A CUDA torch generator seeded from the test's rng: fresh data per test, the same on every run."""
    return torch.Generator(device="cuda").manual_seed(int(rng.integers(2**62)))


def _bits(x):
    """The bits of a torch tensor or CuPy array, C-ordered on the host, as signed integers of its width
    (torch has no unsigned 16-bit view in older releases)."""
    if isinstance(x, torch.Tensor):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.detach().contiguous().view(ints).cpu().numpy()
    return np.array(cupy.asnumpy(x.view(f"i{x.dtype.itemsize}")), order="C")  # (0-d stays 0-d)


def _assert_same_bits(got, want, name):
    a, b = _bits(got), _bits(want)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
    assert np.array_equal(a, b), f"{name}: {np.count_nonzero(a != b)} of {a.size} elements differ"


def test_example_checks_itself():
    torch_attention._check()  # asserts out and the gradients against torch's SDPA in float64


# name -> a view of a (B, N, 3, H, D) tensor, as a model's qkv projection gives it
VIEWS = {
    "contiguous": lambda t: t,
    "one of packed qkv, (B, H, N, D)": lambda t: t[:, :, 1].transpose(1, 2),
    "every other row": lambda t: t[:, ::2, 2],
    "every third column": lambda t: t[..., ::3],
    "expanded rows (stride 0)": lambda t: t[:, :1, 0].expand(-1, t.shape[1], -1, -1),
    "one element": lambda t: t[1, 4, 2, 3, 5],
    "empty": lambda t: t[:, :0, 0],
}


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_example_to_cupy_views_tensors_without_a_copy(rng, dtype, view):
    g = _generator(rng)
    base = torch.randn(2, 37, 3, 5, 24, device="cuda", dtype=torch.float64, generator=g)
    t = VIEWS[view](base.to(getattr(torch, dtype)))
    x = torch_attention.to_cupy(t)
    assert isinstance(x, cupy.ndarray) and x.dtype == (BF16 if dtype == "bfloat16" else np.dtype(dtype))
    assert x.data.ptr == t.data_ptr() and x.shape == tuple(t.shape)
    assert x.strides == tuple(s * t.element_size() for s in t.stride())
    assert x.device.id == t.get_device()
    _assert_same_bits(x, t, view)


def test_example_to_cupy_keeps_the_tensor_alive(rng):
    g = _generator(rng)
    packed = torch.randn(3, 41, 3, 2, 40, device="cuda", generator=g).to(torch.float16)
    x = torch_attention.to_cupy(packed[:, :, 0].transpose(1, 2))
    expected = _bits(x)
    del packed
    # torch's caching allocator hands a freed block to the next request of its size: had the array not kept
    # the tensor, these sevens would land in its memory.
    filler = torch.full((3 * 41 * 3 * 2 * 40,), 7.0, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    assert np.array_equal(_bits(x), expected)
    del filler


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2, 3, dtype=torch.float16),  # on the host
        lambda: torch.ones(2, 3, dtype=torch.int32, device="cuda"),
        lambda: torch.ones(2, 3, dtype=torch.int16, device="cuda"),
        lambda: torch.ones(2, 3, dtype=torch.complex64, device="cuda"),
    ],
    ids=["host float16", "cuda int32", "cuda int16", "cuda complex64"],
)
def test_example_to_cupy_rejects_what_it_cannot_view(make):
    with pytest.raises(TypeError, match="to_cupy"):
        torch_attention.to_cupy(make())


def _leaves(g, dtype, b, h, nq, nk, d):
    """q (B, Nq, H, D) and a packed kv (B, Nk, 2, H, D) requiring grad, as a model's projections give them."""
    q = torch.randn(b, nq, h, d, device="cuda", generator=g).to(TORCH_DTYPES[dtype]).requires_grad_()
    kv = torch.randn(b, nk, 2, h, d, device="cuda", generator=g).to(TORCH_DTYPES[dtype]).requires_grad_()
    return q, kv


def _views(q_leaf, kv_leaf):
    """(B, H, N, D) views of the leaves, no copy."""
    return q_leaf.transpose(1, 2), kv_leaf[:, :, 0].transpose(1, 2), kv_leaf[:, :, 1].transpose(1, 2)


# Options that change every output (each is checked to), with Nq = 77 below Nk = 133: bottom-right aligned,
# every query still sees keys.
OPTIONS = {
    "window softcap": dict(window=(29, 5), softcap=15.0),
    "causal window scale": dict(causal=True, window=(40, 0), scale=0.2),
    "softcap scale": dict(softcap=7.5, scale=0.11),
}


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_example_attention_passes_options_through(rng, dtype, options):
    options = OPTIONS[options]
    g = _generator(rng)
    q_leaf, kv_leaf = _leaves(g, dtype, 2, 3, 77, 133, 64)
    q, k, v = _views(q_leaf, kv_leaf)
    out = torch_attention.attention(q, k, v, **options)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    out.backward(dout)
    torch.cuda.synchronize()

    arrays = [torch_attention.to_cupy(x.detach()) for x in (q, k, v, dout)]
    out_c, lse_c = cupyflash.attention_forward(*arrays[:3], **options)
    dq, dk, dv = cupyflash.attention_backward(arrays[3], *arrays[:3], out_c, lse_c, **options)
    _assert_same_bits(out, out_c, "out")
    _assert_same_bits(q_leaf.grad, dq.transpose(0, 2, 1, 3), "dq")
    _assert_same_bits(kv_leaf.grad[:, :, 0], dk.transpose(0, 2, 1, 3), "dk")
    _assert_same_bits(kv_leaf.grad[:, :, 1], dv.transpose(0, 2, 1, 3), "dv")
    # The same bits would also follow from options dropped on both sides: they must matter.
    plain = torch_attention.attention(q.detach(), k.detach(), v.detach())
    assert not torch.equal(plain, out.detach())


def test_example_attention_on_a_side_stream_gives_the_same_bits(rng):
    dtype = "bfloat16"
    g = _generator(rng)
    q_leaf, kv_leaf = _leaves(g, dtype, 2, 4, 133, 133, 64)
    new_q, new_kv = (x.detach().clone().normal_(generator=g) for x in (q_leaf, kv_leaf))
    dout = torch.randn(2, 4, 133, 64, device="cuda", generator=g).to(TORCH_DTYPES[dtype])

    def both_passes():
        q_leaf.grad = kv_leaf.grad = None
        out = torch_attention.attention(*_views(q_leaf, kv_leaf), causal=True)
        out.backward(dout)  # autograd runs it on the forward's stream
        return out.detach(), q_leaf.grad, kv_leaf.grad

    with torch.no_grad():
        q_leaf.copy_(new_q)
        kv_leaf.copy_(new_kv)
    expected = [_bits(x) for x in both_passes()]  # on the default stream

    with torch.no_grad():  # other values until the side stream's copy
        q_leaf.normal_(generator=g)
        kv_leaf.normal_(generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the leaves, new values and dout were made on the default one
    with torch.cuda.stream(side):
        # A long kernel before the copy of the new values: a kernel of cupyflash's queued on any other
        # stream would run before the copy, on the other values, and give other bits.
        torch.cuda._sleep(50_000_000)
        with torch.no_grad():
            q_leaf.copy_(new_q)
            kv_leaf.copy_(new_kv)
        results = both_passes()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert (q_leaf.get_device(), side.cuda_stream) in torch_attention._streams
    for name, got, want in zip(("out", "dq", "dkv"), results, expected):
        assert np.array_equal(_bits(got), want), name


@pytest.mark.parametrize("loss", ["random dout", "out.sum()"])
def test_example_attention_gradients_match_float64(rng, loss):
    # Non-causal with Nq != Nk; out.sum() hands the backward an expanded dout (every stride 0).
    dtype = "float16"
    g = _generator(rng)
    q_leaf, kv_leaf = _leaves(g, dtype, 2, 3, 77, 133, 64)
    out = torch_attention.attention(*_views(q_leaf, kv_leaf))
    dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    if loss == "random dout":
        out.backward(dout)
    else:
        out.sum().backward()

    q_ref, kv_ref = (x.detach().double().requires_grad_() for x in (q_leaf, kv_leaf))
    ref = sdpa_float64(*_views(q_ref, kv_ref), causal=False)
    if loss == "random dout":
        ref.backward(dout.double())
    else:
        ref.sum().backward()
    assert rel_err(out, ref) <= TOLERANCES[dtype], f"out: {rel_err(out, ref):.2e}"
    limit = TOLERANCES[dtype] * GRAD_TOLERANCE_FACTOR
    grads = (
        ("dq", q_leaf.grad, q_ref.grad),
        ("dk", kv_leaf.grad[:, :, 0], kv_ref.grad[:, :, 0]),
        ("dv", kv_leaf.grad[:, :, 1], kv_ref.grad[:, :, 1]),
    )
    for name, ours, want in grads:  # each against its own largest value: dk is smaller than dv
        assert ours.dtype == TORCH_DTYPES[dtype] and ours.shape == want.shape
        assert rel_err(ours, want) <= limit, f"{name}: {rel_err(ours, want):.2e} > {limit}"


def test_example_attention_returns_the_bias_gradient(rng):
    dtype = "float16"
    g = _generator(rng)
    q_leaf, kv_leaf = _leaves(g, dtype, 2, 3, 77, 133, 64)
    bias = (torch.randn(1, 3, 77, 133, device="cuda", generator=g)).to(TORCH_DTYPES[dtype]).requires_grad_()
    q, k, v = _views(q_leaf, kv_leaf)
    out = torch_attention.attention(q, k, v, bias=bias, causal=True)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    out.backward(dout)
    torch.cuda.synchronize()

    arrays = [torch_attention.to_cupy(x.detach()) for x in (q, k, v, dout, bias)]
    out_c, lse_c = cupyflash.attention_forward(*arrays[:3], bias=arrays[4], causal=True)
    dq, dk, dv, dbias = cupyflash.attention_backward(arrays[3], *arrays[:3], out_c, lse_c, bias=arrays[4], causal=True)
    _assert_same_bits(out, out_c, "out")
    _assert_same_bits(bias.grad, dbias, "dbias")
    _assert_same_bits(q_leaf.grad, dq.transpose(0, 2, 1, 3), "dq")
    assert bias.grad.shape == bias.shape and float(bias.grad.abs().max()) > 0
