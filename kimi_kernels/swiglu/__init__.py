"""SwiGLU of the routed experts' gated FFN (``_activate`` in ``megatron_ext/moe/experts.py``):

    a, b = h.chunk(2, -1);  y = silu(a) * b     computed in fp32, returned in h's dtype

Entry point :func:`swiglu`: the Triton kernels (``fused.py``: forward reads h and writes y; backward reads
h and dy and writes dh [..., 2f] directly, with no silu/mul/cat chain in between) for CUDA tensors, the
PyTorch reference (``naive.py``) otherwise.
"""

import torch

from kimi_kernels.swiglu.naive import swiglu_reference

__all__ = ["swiglu", "swiglu_reference", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        from kimi_kernels.swiglu.fused import swiglu_fwd

        shape, width = h.shape, h.shape[-1]
        h2 = h.contiguous().view(-1, width)
        y = swiglu_fwd(h2)
        ctx.save_for_backward(h2)  # not y: backward recomputes sigmoid(a) from h
        ctx.shape = shape
        return y.view(*shape[:-1], width // 2)

    @staticmethod
    def backward(ctx, dy):
        from kimi_kernels.swiglu.fused import swiglu_bwd

        (h2,) = ctx.saved_tensors
        dh = swiglu_bwd(dy.contiguous().view(h2.shape[0], h2.shape[1] // 2), h2)
        return dh.view(ctx.shape)


def _check(h, use_kernel):
    if h.dim() < 1:
        raise ValueError(f"h must be [..., 2f] (at least 1-D), got a {h.dim()}-D tensor")
    if h.shape[-1] == 0 or h.shape[-1] % 2:
        raise ValueError(f"h's last dim must be 2f with f > 0 (the a and b halves), got {h.shape[-1]}")
    if use_kernel and h.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the kernel takes fp32/fp16/bf16 h, got {h.dtype}")


def swiglu(h: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """``h [..., 2f]`` -> ``silu(a) * b`` ``[..., f]`` in h's dtype, computed in fp32 (``a, b = h.chunk(2, -1)``).

    ``use_kernel`` defaults to ``h.is_cuda`` for fp32/fp16/bf16 h (other dtypes take the reference). The
    gradient of h comes back in h's dtype, both halves written by one kernel."""
    if use_kernel is None:
        use_kernel = h.is_cuda and h.dtype in SUPPORTED_DTYPES
    _check(h, use_kernel)
    if use_kernel:
        return _SwiGLUFunction.apply(h)
    return swiglu_reference(h)
