"""PyTorch reference of SwiGLU: the plain ops the fused kernels replace (and the CPU path)."""

import torch
import torch.nn.functional as F


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` with ``a, b = h.chunk(2, -1)``, computed in fp32 (fp64 stays fp64), returned in ``h``'s
    dtype. Autograd gives the gradient of ``h``."""
    compute = torch.promote_types(h.dtype, torch.float32)
    a, b = h.to(compute).chunk(2, dim=-1)
    return (F.silu(a) * b).to(h.dtype)
