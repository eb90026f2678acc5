"""PyTorch interop through DLPack (gpu; skipped without torch): torch CUDA tensors go to CuPy and back
without a copy, and cupyflash on them matches torch's own SDPA in float64 (forward) and autograd
(backward). torch is never a dependency of cupyflash; this is the README's recipe, checked."""

import ml_dtypes
import numpy as np
import pytest

import cupyflash

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Relative max-norm error against float64, as `python -m cupyflash` checks; gradients get twice as much.
TOLERANCES = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5}
GRAD_TOLERANCE_FACTOR = 2
BF16 = np.dtype(ml_dtypes.bfloat16)
DLPACK_ERRORS = (BufferError, TypeError, NotImplementedError, RuntimeError)


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
    q_t, k_t, v_t, dout_t = (torch.randn(1, 4, 96, 64, device="cuda", generator=g).to(TORCH_DTYPES[dtype])
                             for _ in range(4))
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
