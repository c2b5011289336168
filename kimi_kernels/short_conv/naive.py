"""PyTorch reference of the causal depthwise short convolution + SiLU (the path CausalShortConv used
before the kernel; it stays the CPU path and the tests' reference)."""

import torch
import torch.nn.functional as F


def causal_conv_silu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [s, b, C]``, ``weight [C, K]`` -> ``[b, s, C]``:
    ``y[b, t, c] = silu(sum_j weight[c, j] x[t - (K-1) + j, b, c])``, zeros before ``t = 0``.

    The weight is cast to ``x``'s dtype (as the module always did); autograd through plain ops."""
    channels, kernel_size = weight.shape
    xb = x.permute(1, 2, 0)  # [b, C, s]: conv1d's layout
    xb = F.pad(xb, (kernel_size - 1, 0))  # causal: left padding only
    y = F.conv1d(xb, weight.unsqueeze(1).to(x.dtype), groups=channels)
    return F.silu(y).transpose(1, 2)
