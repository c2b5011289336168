"""``dst.copy_(src)`` for a contiguous low-precision ``src`` into a contiguous fp32 ``dst`` of the same shape:
the Triton kernel (``fused.py``) for large CUDA tensors, torch's ``copy_`` otherwise (the reference, and the
faster choice for small tensors, where a Triton launch costs more host time than it saves)."""

import torch

__all__ = ["widening_copy_", "MIN_KERNEL_NUMEL"]

MIN_KERNEL_NUMEL = 1 << 20  # below: torch's copy_ (launch cost dominates)


def widening_copy_(dst: torch.Tensor, src: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    if use_kernel is None:
        use_kernel = (src.is_cuda and src.numel() >= MIN_KERNEL_NUMEL and src.is_contiguous()
                      and dst.is_contiguous() and src.dtype in (torch.bfloat16, torch.float16)
                      and dst.dtype == torch.float32 and dst.shape == src.shape)
    if not use_kernel:
        return dst.copy_(src)
    if dst.shape != src.shape or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"widening_copy_ needs contiguous tensors of one shape, got {tuple(src.shape)} -> "
                         f"{tuple(dst.shape)}")
    from kimi_kernels.cast_copy.fused import cast_copy

    cast_copy(src, dst)
    return dst
