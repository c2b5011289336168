"""Quantile-balancing routing math (DESIGN.md section 3) as pure functions.

Scores in (``[N, E]`` fp32, e.g. sigmoid of router logits), a :class:`Routing` out. No modules
and no state: the router/dispatcher modules own the bias buffer and the process groups.

* plain routing: :func:`topk_routing` (evaluation/inference, and with the dual bias);
* capacity mode: :func:`capacity_routing`, in-pass hard per-expert capacity (training only);
* dual-bias mode: :func:`dual_bias_range`, :func:`dual_bias_histogram`, :func:`dual_bias_update`,
  a cross-step bias added to the scores for selection only.

See docs/quantile_balancing.md for the algorithms, guarantees and costs.
"""

from megatron_ext.moe.quantile_capacity import capacity_routing, expert_capacity
from megatron_ext.moe.quantile_dual_bias import dual_bias_histogram, dual_bias_range, dual_bias_update
from megatron_ext.moe.quantile_histogram import bin_of_rank, histogram_bins, histogram_counts, histogram_quantile
from megatron_ext.moe.quantile_routing import Routing, gates_from_scores, topk_routing

__all__ = [
    "Routing",
    "topk_routing",
    "gates_from_scores",
    "expert_capacity",
    "capacity_routing",
    "histogram_bins",
    "histogram_counts",
    "bin_of_rank",
    "histogram_quantile",
    "dual_bias_range",
    "dual_bias_histogram",
    "dual_bias_update",
]
