"""Causal depthwise short convolution + SiLU of the KDA layer's q/k/v (``docs/kda.md``):

    y[b, t, c] = silu(sum_j weight[c, j] x[t - (K-1) + j, b, c]),   x = 0 before t = 0 (per sample)

``x`` comes sequence-first ``[s, b, C]`` (a ColumnParallelLinear output), ``y`` leaves batch-first
``[b, s, C]``. Entry point :func:`causal_conv_silu`: the Triton kernels (``fused.py``, the layout change
fused into the loads/stores, the pre-activation recomputed in backward) for CUDA tensors, the PyTorch
reference (``naive.py``) otherwise.
"""

import torch

from kimi_kernels.short_conv.naive import causal_conv_silu_reference

__all__ = ["causal_conv_silu", "causal_conv_silu_group", "causal_conv_silu_reference", "MAX_KERNEL_SIZE"]

# The kernels unroll K x K shifted loads in backward; short convs use 2..4 taps.
MAX_KERNEL_SIZE = 8
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _ConvSiluFunction(torch.autograd.Function):
    """``n`` convolutions of one shape (inputs x_1..x_n, then w_1..w_n) through one kernel launch each way."""

    @staticmethod
    def forward(ctx, *tensors):
        from kimi_kernels.short_conv.fused import conv_fwd

        n = len(tensors) // 2
        xs, weights = [x.contiguous() for x in tensors[:n]], [w.contiguous() for w in tensors[n:]]
        ctx.save_for_backward(*xs, *weights)  # only the inputs: backward recomputes pre
        return tuple(conv_fwd(xs, weights))

    @staticmethod
    def backward(ctx, *dys):
        from kimi_kernels.short_conv.fused import conv_bwd

        saved = ctx.saved_tensors
        n = len(saved) // 2
        dxs, dweights = conv_bwd([dy.contiguous() for dy in dys], list(saved[:n]), list(saved[n:]))
        return (*dxs, *dweights)


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
    return causal_conv_silu_group([x], [weight], use_kernel)[0]


def causal_conv_silu_group(xs, weights, use_kernel: bool | None = None) -> list:
    """:func:`causal_conv_silu` of each ``(xs[i], weights[i])``; on the kernel path the parts (up to three, one
    shape, dtype and device: a KDA layer's q, k and v) share one launch forward and one backward."""
    from kimi_kernels.short_conv.fused import MAX_PARTS

    if len(xs) != len(weights) or not xs:
        raise ValueError(f"one weight per input: got {len(xs)} inputs and {len(weights)} weights")
    for x, weight in zip(xs, weights):
        _check(x, weight)
    if not (xs[0].is_cuda if use_kernel is None else use_kernel):
        return [causal_conv_silu_reference(x, w) for x, w in zip(xs, weights)]
    same = all(x.shape == xs[0].shape and x.dtype == xs[0].dtype and x.device == xs[0].device for x in xs) and all(
        w.shape == weights[0].shape for w in weights)
    if not same or len(xs) > MAX_PARTS:  # one launch per part
        return [_ConvSiluFunction.apply(x, w)[0] for x, w in zip(xs, weights)]
    return list(_ConvSiluFunction.apply(*xs, *weights))
