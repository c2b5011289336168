"""PyTorch reference of RMSNorm (and the KDA layer's gated RMSNorm): the plain ops the fused kernels replace."""

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in fp32, returned in ``x``'s dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def gated_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """``rms_norm(x) * sigmoid(gate)`` as the KDA layer computed it before the fused kernel: the norm rounded
    to ``x``'s dtype, then gated in fp32 and rounded again (the kernel rounds once)."""
    normed = rms_norm_reference(x, weight, eps)
    return (normed.float() * torch.sigmoid(gate.float())).to(x.dtype)
