"""Do the recipe's results on the model's layout change after bench_train_step's host section ran?"""

import sys

import torch

sys.path[:0] = ["bench", "examples"]  # run from the repository root
import bench_train_step as bts  # noqa: E402
import torch_attention as ta  # noqa: E402


def grads(seed):
    torch.manual_seed(seed)
    qkv = torch.randn(8, 1024, 3, 8, 64, device="cuda").to(torch.bfloat16).requires_grad_()
    g = torch.randn(8, 1024, 512, device="cuda").to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    y = ta.attention(q, k, v, causal=True)
    y.transpose(1, 2).reshape(8, 1024, 512).backward(g)
    leaf = qkv.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(leaf[:, :, i].transpose(1, 2) for i in range(3)), is_causal=True
    )
    ref.transpose(1, 2).reshape(8, 1024, 512).backward(g.double())
    e_out = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    e_g = ((qkv.grad.double() - leaf.grad).abs().max() / leaf.grad.abs().max()).item()
    return y.detach().clone(), qkv.grad.clone(), e_out, e_g


first = [grads(s) for s in range(3)]
print("fresh:", [(round(a, 5), round(b, 5)) for _, _, a, b in first])
if "--host" in sys.argv:
    bts.host_rows()
    bts.recipe_rows()
after = [grads(s) for s in range(3)]
print("after:", [(round(a, 5), round(b, 5)) for _, _, a, b in after])
print("bitwise same:", [bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])) for a, b in zip(first, after)])
