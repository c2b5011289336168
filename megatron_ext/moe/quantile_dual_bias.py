"""Dual-bias mode of quantile balancing (the cross-step bias published for Kimi K3).

Tokens select ``top-k(s_i + b)`` and are gated with ``s``. Token i takes expert j exactly when
``b_j > r_ij = alpha_i - s_ij`` with ``alpha_i`` the (k+1)-th largest of ``s_i + b``, so
expert j's load at bias b_j is the count of ``r_{:,j}`` below b_j; the bias that gives every
expert the uniform load ``N k / E`` is the ``k / E`` quantile of ``r_{:,j}``. After each step:

1. per microbatch, :func:`dual_bias_histogram` bins ``r`` per expert over a range fixed for the
   whole step by :func:`dual_bias_range` (from the bias at the step's start);
2. the caller sums the int64 counts over microbatches and all-reduces them over the
   data-parallel ranks (and any other ranks that hold different tokens);
3. :func:`dual_bias_update` takes the per-expert quantiles and re-centres them.

Dropless, causal (the bias only uses past steps), no step size.
"""

from __future__ import annotations

import torch

from megatron_ext.moe.quantile_histogram import Bound, histogram_bins, histogram_counts, histogram_quantile
from megatron_ext.moe.quantile_routing import check_scores

__all__ = ["dual_bias_range", "dual_bias_histogram", "dual_bias_update"]


def dual_bias_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram range ``(min b - 1, max b + 1)`` as fp32 0-dim tensors (no host sync). It holds
    every ``r_ij`` when scores lie in [0, 1]."""
    if bias.dim() != 1 or bias.dtype != torch.float32:
        raise ValueError(f"bias must be a 1-D fp32 tensor, got {bias.dtype} of shape {tuple(bias.shape)}")
    return bias.min() - 1.0, bias.max() + 1.0


def dual_bias_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, lo: Bound, hi: Bound,
                        num_bins: int = 1000) -> torch.Tensor:
    """int64 counts ``[E, num_bins]`` of ``r_ij = alpha_i - s_ij`` over ``[lo, hi]`` (values
    outside fall in the edge bins). Counts from several microbatches or ranks simply add."""
    check_scores(scores, k, bias)
    num_experts = scores.shape[1]
    if k >= num_experts:
        raise ValueError(f"k must be < num_experts={num_experts} for the dual bias "
                         f"((k+1)-th largest score), got {k}")
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    alpha = (scores + bias).topk(k + 1, dim=1).values[:, k:]
    residual = alpha - scores
    experts = torch.arange(num_experts, device=scores.device)  # broadcasts over tokens
    return histogram_counts(experts, histogram_bins(residual, lo, hi, num_bins), num_experts, num_bins)


def dual_bias_update(counts: torch.Tensor, lo: Bound, hi: Bound, k: int) -> torch.Tensor:
    """New bias (fp32 ``[E]``): per expert the ``k / E`` quantile of its residuals, minus the
    mean over experts (only differences between experts change the routing)."""
    num_experts = counts.shape[0]
    if not isinstance(k, int) or not 1 <= k < num_experts:
        raise ValueError(f"k must be an int in [1, num_experts={num_experts}), got {k!r}")
    bias = histogram_quantile(counts, lo, hi, k / num_experts)
    return bias - bias.mean()
