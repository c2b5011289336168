"""The KDA recurrence on ``[B, T, H, D]`` tensors: Triton on CUDA, the PyTorch reference on CPU."""

from __future__ import annotations

import torch

from kimi_kernels.kda import chunk_kda, kda_gate_lower_bound, kda_gate_softplus, naive_chunk_kda


def kda_gate(f, A_log, dt_bias, lower_bound: float | None) -> torch.Tensor:
    """The fp32 log-decay ``g`` from the raw gate input ``f`` (what the kernel computes in-kernel)."""
    if lower_bound is None:
        return kda_gate_softplus(f, A_log, dt_bias)
    return kda_gate_lower_bound(f, A_log, dt_bias, lower_bound)


def kda_core(q, k, v, f, beta, A_log, dt_bias, lower_bound: float | None) -> torch.Tensor:
    """``o [B, T, H, V]`` (q's dtype) of the delta rule with in-kernel gate and q/k L2 norm.

    ``f [B, T, H, K]`` is the raw gate input; ``lower_bound=None`` selects the softplus gate.
    ``beta [B, T, H]`` is already in (0, 1). On CPU the chunked PyTorch reference runs (fp32,
    autograd reaches ``A_log`` and ``dt_bias`` through the gate); Triton's interpreter would be
    orders of magnitude slower.
    """
    if q.is_cuda:
        o, _ = chunk_kda(
            q, k, v, f, beta,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        )
        return o
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    o, _ = naive_chunk_kda(q, k, v, g, beta, use_qk_l2norm=True)
    return o.to(q.dtype)
