"""Causal depthwise short convolution + SiLU of the KDA layer's q/k/v (``docs/kda.md``):

    y[b, t, c] = silu(sum_j weight[c, j] x[t - (K-1) + j, b, c]),   x = 0 before t = 0 (per sample)

``x`` comes sequence-first ``[s, b, C]`` (a ColumnParallelLinear output), ``y`` leaves batch-first
``[b, s, C]``. Entry point :func:`causal_conv_silu`: the Triton kernels (``fused.py``, the layout change
fused into the loads/stores, the pre-activation recomputed in backward) for CUDA tensors, the PyTorch
reference (``naive.py``) otherwise.
"""

import torch

from kimi_kernels.short_conv.naive import causal_conv_silu_reference

__all__ = ["causal_conv_silu", "causal_conv_silu_reference", "MAX_KERNEL_SIZE"]

# The kernels unroll K x K shifted loads in backward; short convs use 2..4 taps.
MAX_KERNEL_SIZE = 8
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _ConvSiluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        from kimi_kernels.short_conv.fused import conv_fwd

        x, weight = x.contiguous(), weight.contiguous()
        ctx.save_for_backward(x, weight)  # only the inputs: backward recomputes pre
        return conv_fwd(x, weight)

    @staticmethod
    def backward(ctx, dy):
        from kimi_kernels.short_conv.fused import conv_bwd

        x, weight = ctx.saved_tensors
        return conv_bwd(dy.contiguous(), x, weight)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be sequence-first [s, b, C], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"weight must be [C, K] with C = {x.shape[2]} (x's channels), got {tuple(weight.shape)}")
    if not 1 <= weight.shape[1] <= MAX_KERNEL_SIZE:
        raise ValueError(f"kernel size K = weight.shape[1] must be in 1..{MAX_KERNEL_SIZE}, got {weight.shape[1]}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"x must be fp32/fp16/bf16 and weight fp32 or x's dtype, got x {x.dtype}, "
                         f"weight {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x and weight on different devices: {x.device} vs {weight.device}")


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """``x [s, b, C]``, ``weight [C, K]`` (fp32 or x's dtype) -> ``[b, s, C]`` in x's dtype, computed in
    fp32 by the kernel. ``use_kernel`` defaults to ``x.is_cuda``; grads: ``dx [s, b, C]`` in x's dtype,
    ``dweight`` in weight's dtype (fp32 sums)."""
    _check(x, weight)
    if x.is_cuda if use_kernel is None else use_kernel:
        return _ConvSiluFunction.apply(x, weight)
    return causal_conv_silu_reference(x, weight)
