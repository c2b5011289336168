"""RMSNorm over the last dim, optionally gated (the KDA layer's ``norm(o) * sigmoid(g)``):

    y = x * rsqrt(mean(x^2) + eps) * weight [* sigmoid(gate)]     computed in fp32, returned in x's dtype

Entry point :func:`rms_norm`: the Triton kernels (``fused.py``: one pass forward, reading x and writing y;
one pass backward, reading x and dy and writing dx, with the weight's gradient from per-program fp32 partial
sums) for CUDA tensors, the PyTorch reference (``naive.py``) otherwise.
"""

import torch

from kimi_kernels.rms_norm.naive import gated_rms_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference", "gated_rms_norm_reference", "MAX_HIDDEN"]

MAX_HIDDEN = 16384  # a row is one tile of the kernels
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        from kimi_kernels.rms_norm.fused import rms_norm_fwd

        gate = gate.contiguous() if gate is not None else None
        weight = weight.contiguous()
        y, rstd, x, ctx.layout = rms_norm_fwd(x, weight, gate, eps)  # x as it is when its tokens lie apart
        ctx.save_for_backward(x, weight, gate, rstd)  # not y: backward recomputes x * rstd
        return y

    @staticmethod
    def backward(ctx, dy):
        from kimi_kernels.rms_norm.fused import rms_norm_bwd

        x, weight, gate, rstd = ctx.saved_tensors
        dx, dweight, dgate = rms_norm_bwd(dy.contiguous(), x, ctx.layout, weight, gate, rstd)
        return dx, dweight, dgate, None


def _check(x, weight, gate, use_kernel):
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., h] with h > 0, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [h] with h = {x.shape[-1]} (x's last dim), got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    for name, t in (("weight", weight), ("gate", gate)):
        if t is not None and t.device != x.device:
            raise ValueError(f"x and {name} on different devices: {x.device} vs {t.device}")
    if not use_kernel:
        return
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"the kernel takes rows of h <= {MAX_HIDDEN}, got h = {x.shape[-1]}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"x must be fp32/fp16/bf16 and weight fp32 or x's dtype, got x {x.dtype}, "
                         f"weight {weight.dtype}")
    if gate is not None and gate.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"gate must be fp32 or x's dtype, got gate {gate.dtype}, x {x.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             use_kernel: bool | None = None) -> torch.Tensor:
    """``x [..., h]``, ``weight [h]`` (fp32 or x's dtype) -> ``x * rsqrt(mean(x^2) + eps) * weight`` in x's
    dtype, computed in fp32; times ``sigmoid(gate)`` (``gate``: x's shape, fp32 or x's dtype) when given.

    ``use_kernel`` defaults to ``x.is_cuda and h <= MAX_HIDDEN`` (wider rows take the reference). The kernels
    read an ``x`` whose two leading dims are strided (e.g. ``[b, s, ...]`` read as ``[s, b, ...]``) in place and
    return y contiguous in x's shape, dx in x's layout. Grads:
    dx in x's dtype, dweight in weight's dtype (fp32 sums), dgate in gate's dtype. The kernel gates the
    fp32 norm and rounds once; the gated reference rounds the norm to x's dtype first, as the KDA layer
    did (identical in fp32, within one rounding of x's dtype otherwise)."""
    if use_kernel is None:
        use_kernel = x.is_cuda and x.dim() >= 1 and x.shape[-1] <= MAX_HIDDEN
    _check(x, weight, gate, use_kernel)
    if use_kernel:
        return _RMSNormFunction.apply(x, weight, gate, float(eps))
    if gate is None:
        return rms_norm_reference(x, weight, eps)
    return gated_rms_norm_reference(x, weight, eps, gate)
