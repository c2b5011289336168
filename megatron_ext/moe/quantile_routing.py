"""The routing result and plain top-k routing, shared by both quantile-balancing modes.

Gates always come from the unbiased scores of the experts a token ends on; a bias (dual-bias
mode) only changes which experts are selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Routing", "topk_routing", "gates_from_scores", "check_scores", "biased_scores"]


@dataclass
class Routing:
    """Where each token goes and with what weight.

    experts:  ``[N, k]`` int64 expert ids per (token, slot); -1 where the pair was dropped.
    gates:    ``[N, k]`` fp32 unbiased scores of the kept experts (renormalised over the kept
              ones when the caller asked for it); 0 where dropped.
    dropped:  scalar int64, local count of dropped (token, slot) pairs.
    rerouted: scalar int64, local count of kept pairs whose expert is outside the token's
              plain top-k (by biased score).
    global_load: ``[E]`` int64 kept pairs per expert summed over the routing group, where the
              routing function got it for free (capacity mode); None otherwise.
    rounds:   proposal rounds run (capacity mode; the cost driver); None otherwise.
    plain:    known on the host: ``experts`` is the plain top-k (no ``-1``; ``dropped`` and
              ``rerouted`` are 0), so consumers may skip the work for dropped pairs. False when
              unknown.
    num_kept: known on the host: this rank's kept (token, slot) pairs (the dispatcher's buffer
              size without a host read); None when unknown.
    """

    experts: torch.Tensor
    gates: torch.Tensor
    dropped: torch.Tensor
    rerouted: torch.Tensor
    global_load: torch.Tensor | None = None
    rounds: int | None = None
    plain: bool = False
    num_kept: int | None = None

    def __post_init__(self):
        if self.experts.dtype != torch.int64 or self.experts.dim() != 2:
            raise ValueError(f"Routing.experts must be a 2-D int64 tensor, got {self.experts.dtype} "
                             f"of shape {tuple(self.experts.shape)}")
        if self.gates.shape != self.experts.shape or self.gates.dtype != torch.float32:
            raise ValueError(f"Routing.gates must be fp32 of shape {tuple(self.experts.shape)}, got "
                             f"{self.gates.dtype} of shape {tuple(self.gates.shape)}")
        for name in ("dropped", "rerouted"):
            value = getattr(self, name)
            if value.dim() != 0 or value.dtype != torch.int64:
                raise ValueError(f"Routing.{name} must be a scalar int64 tensor, got {value.dtype} "
                                 f"of shape {tuple(value.shape)}")
        if self.global_load is not None and (self.global_load.dim() != 1 or self.global_load.dtype != torch.int64):
            raise ValueError(f"Routing.global_load must be a 1-D int64 tensor or None, got "
                             f"{self.global_load.dtype} of shape {tuple(self.global_load.shape)}")


def check_scores(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> None:
    """Raise a ValueError naming the argument when scores/k/bias are not usable."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != torch.float32:
        got = f"{scores.dtype} of shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores)
        raise ValueError(f"scores must be a 2-D [num_tokens, num_experts] fp32 tensor, got {got}")
    num_experts = scores.shape[1]
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an int in [1, num_experts={num_experts}], got {k!r}")
    if bias is not None:
        if bias.shape != (num_experts,) or bias.dtype != torch.float32:
            raise ValueError(f"bias must be an fp32 tensor of shape ({num_experts},), got {bias.dtype} "
                             f"of shape {tuple(bias.shape)}")
        if bias.device != scores.device:
            raise ValueError(f"bias must be on the scores' device {scores.device}, got {bias.device}")


def gates_from_scores(scores: torch.Tensor, experts: torch.Tensor, renormalize: bool = True,
                      all_kept: bool = False) -> torch.Tensor:
    """Unbiased scores of ``experts`` (``-1`` = dropped gives 0), optionally renormalised over
    the kept experts of each token (the sigmoid-router convention; softmax routers opt out).
    ``all_kept``: the caller knows there is no ``-1`` (the masking, an identity then, is skipped)."""
    if all_kept:
        gates = scores.gather(1, experts)
    else:
        kept = experts >= 0
        gates = scores.gather(1, experts.clamp(min=0)) * kept
    if renormalize:
        # A token with every slot dropped keeps all-zero gates instead of 0/0.
        gates = gates / gates.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).tiny)
    return gates


def biased_scores(scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return scores if bias is None else scores + bias


def topk_routing(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None, *,
                 renormalize: bool = True) -> Routing:
    """Plain top-k of ``scores + bias`` (bias only selects); gates from ``scores``.

    Slots are ordered by biased score, best first. Nothing is dropped or rerouted.
    """
    check_scores(scores, k, bias)
    experts = biased_scores(scores, bias).topk(k, dim=1).indices
    zeros = torch.zeros(2, dtype=torch.int64, device=scores.device)
    return Routing(experts, gates_from_scores(scores, experts, renormalize, all_kept=True), zeros[0], zeros[1],
                   plain=True, num_kept=experts.numel())
