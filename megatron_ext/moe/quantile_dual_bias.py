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

from megatron_ext.moe.quantile_histogram import (Bound, histogram_bins, histogram_counts, histogram_quantile,
                                                row_offsets)
from megatron_ext.moe.quantile_routing import check_scores

__all__ = ["dual_bias_range", "dual_bias_histogram", "dual_bias_update", "dual_bias_updates"]


def dual_bias_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram range ``(min b - 1, max b + 1)`` as fp32 0-dim tensors (no host sync). It holds
    every ``r_ij`` when scores lie in [0, 1]."""
    if bias.dim() != 1 or bias.dtype != torch.float32:
        raise ValueError(f"bias must be a 1-D fp32 tensor, got {bias.dtype} of shape {tuple(bias.shape)}")
    return bias.min() - 1.0, bias.max() + 1.0


def dual_bias_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, lo: Bound, hi: Bound,
                        num_bins: int = 1000, scale: torch.Tensor | None = None) -> torch.Tensor:
    """int64 counts ``[E, num_bins]`` of ``r_ij = alpha_i - s_ij`` over ``[lo, hi]`` (values
    outside fall in the edge bins). Counts from several microbatches or ranks simply add.
    ``scale``: ``num_bins / (hi - lo)`` when the caller keeps it with the range."""
    check_scores(scores, k, bias)
    num_experts = scores.shape[1]
    if k >= num_experts:
        raise ValueError(f"k must be < num_experts={num_experts} for the dual bias "
                         f"((k+1)-th largest score), got {k}")
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    alpha = (scores + bias).topk(k + 1, dim=1).values[:, k:]
    residual = alpha - scores
    offsets = row_offsets(num_experts, num_bins, scores.device)  # expert j's first bin; broadcasts over tokens
    return histogram_counts(offsets, histogram_bins(residual, lo, hi, num_bins, scale), num_experts, num_bins,
                            rows_are_offsets=True)


def dual_bias_update(counts: torch.Tensor, lo: Bound, hi: Bound, k: int) -> torch.Tensor:
    """New bias (fp32 ``[E]``): per expert the ``k / E`` quantile of its residuals, minus the
    mean over experts (only differences between experts change the routing)."""
    num_experts = counts.shape[0]
    if not isinstance(k, int) or not 1 <= k < num_experts:
        raise ValueError(f"k must be an int in [1, num_experts={num_experts}), got {k!r}")
    bias = histogram_quantile(counts, lo, hi, k / num_experts)
    return bias - bias.mean()


def dual_bias_updates(counts: torch.Tensor, biases: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`dual_bias_update` of several layers at once, each from its own range
    (:func:`dual_bias_range` of its bias), keeping the bias of a layer whose histogram is empty.

    ``counts``: int64 ``[L, E, num_bins]``; ``biases``: fp32 ``[L, E]``, the biases the histograms
    were binned with. Returns the new fp32 ``[L, E]`` biases, each row equal to what
    ``dual_bias_update`` gives for that layer alone (a row-wise computation; the re-centring mean
    is taken per layer, as there). About 40 kernels for all layers instead of about 55 per layer."""
    if counts.dim() != 3 or biases.shape != counts.shape[:2] or biases.dtype != torch.float32:
        raise ValueError(f"need counts [L, E, num_bins] and fp32 biases [L, E], got {tuple(counts.shape)} and "
                         f"{biases.dtype} {tuple(biases.shape)}")
    num_experts = counts.shape[1]
    if not isinstance(k, int) or not 1 <= k < num_experts:
        raise ValueError(f"k must be an int in [1, num_experts={num_experts}), got {k!r}")
    lo = biases.amin(dim=1, keepdim=True) - 1.0  # [L, 1]: dual_bias_range per layer
    hi = biases.amax(dim=1, keepdim=True) + 1.0
    quantiles = histogram_quantile(counts, lo, hi, k / num_experts)  # [L, E]
    # The mean per layer from the layer's own row: the same reduction as dual_bias_update's.
    means = torch.stack([row.mean() for row in quantiles]).unsqueeze(1)
    nonempty = counts.sum(dim=(1, 2)).unsqueeze(1) > 0
    return torch.where(nonempty, quantiles - means, biases)
