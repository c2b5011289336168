"""project_shared_input: the outputs and gradients of separate linears of one input."""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.kda.shared_input import project_shared_input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_separate_linears(dtype):
    torch.manual_seed(0)
    x = torch.randn(40, 3, 64, dtype=dtype)
    weights = [torch.randn(n, 64, dtype=dtype) / 8 for n in (64, 64, 5, 16)]
    frozen = 2  # a weight without grad: its gradient is skipped, the input's still includes it
    weights[frozen].requires_grad_(False)
    ws_ref = [w.clone().requires_grad_(i != frozen) for i, w in enumerate(weights)]
    ws = [w.clone().requires_grad_(i != frozen) for i, w in enumerate(weights)]
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()

    ys_ref = [F.linear(x_ref, w) for w in ws_ref]
    ys = project_shared_input(x_ours, [[ws[0]], ws[1:]])  # a group of one and a group of three
    cotangents = [torch.randn_like(y) for y in ys_ref]
    sum((y * c).float().sum() for y, c in zip(ys_ref, cotangents)).backward()
    sum((y * c).float().sum() for y, c in zip(ys, cotangents)).backward()

    # one GEMM over a group's concatenated weights blocks the sums differently: equal up to rounding
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for y, y_ref in zip(ys, ys_ref):
        torch.testing.assert_close(y, y_ref, **tol)
    # fp32: the same sum in another order; bf16: the GEMM epilogue's roundings differ from the adds'
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 5e-2)
    for i, (w, w_ref) in enumerate(zip(ws, ws_ref)):
        if i == frozen:
            assert w.grad is None
        else:
            torch.testing.assert_close(w.grad, w_ref.grad, **tol)
