"""Capacity mode of quantile balancing: a hard per-expert capacity enforced in the forward pass.

Algorithm (rounds of proposals; every decision depends only on global statistics and on the
global token order, so W ranks produce exactly the one-rank assignment of the concatenated
batch, rank 0's tokens first):

1. Each token with free slots proposes to its best untried experts (by biased score) that
   still have room, one proposal per free slot. Round 1 is the plain top-k.
2. Every rank histograms the scores of the proposals it holds, per expert; one all-reduce of
   the ``[E, num_bins]`` int64 counts gives the global demand ``D_j`` (round 1 also carries the
   token count, which fixes the capacity ``C``).
3. Expert j with ``D_j <= room_j`` accepts everything. Otherwise it accepts its ``room_j``
   best-scoring proposals: the global histogram locates the bin holding the lowest accepted
   rank; bins above it are accepted, bins below refused, and the boundary bin is resolved
   exactly in global token order from a tiny ``[world, E]`` all-reduce of each rank's count in
   that bin (each rank admits after its exclusive prefix). Interpolated thresholds alone could
   over-fill an expert whenever the boundary bin holds several proposals.
4. Refused proposals leave their experts full, so the next round only goes elsewhere; stop when
   a round refuses nothing, or when no refused token has an expert with room left.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_ext.moe.quantile_histogram import bin_of_rank, histogram_bins, histogram_counts
from megatron_ext.moe.quantile_routing import Routing, biased_scores, check_scores, gates_from_scores

__all__ = ["expert_capacity", "capacity_routing"]


def expert_capacity(num_tokens_global: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * num_tokens_global * k / num_experts)``: the (token, expert) pairs
    one expert accepts, summed over the group. Rounded to 1e-9 first so that float noise in
    ``capacity_factor`` (e.g. 1.1) cannot add a slot."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if num_experts < 1 or k < 1 or num_tokens_global < 0:
        raise ValueError(f"need num_experts >= 1, k >= 1, num_tokens_global >= 0; got "
                         f"{num_experts}, {k}, {num_tokens_global}")
    return math.ceil(round(capacity_factor * num_tokens_global * k / num_experts, 9))


# Candidates listed per token slot: with 2k, a token exhausts its list (and pays a full-row
# top-k to refresh it) only when its listed experts with room run short of its free slots.
_CANDIDATES_PER_SLOT = 2


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def _boundary_admission(proposals, valid, bins, boundary, admit_in_boundary, group):
    """Which proposals sitting in their expert's boundary bin are admitted: the first
    ``admit_in_boundary[j]`` of expert j's boundary-bin proposals in global token order."""
    num_experts = boundary.shape[0]
    in_boundary = (valid & (bins == boundary[proposals])).reshape(-1)
    # Few proposals sit in boundary bins: order just those. Row-major order is token order.
    where = in_boundary.nonzero().squeeze(1)
    expert = proposals.reshape(-1)[where]
    local = torch.bincount(expert, minlength=num_experts)
    order = torch.sort(expert, stable=True).indices
    start = local.cumsum(0) - local
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device) - start[expert[order]]
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        per_rank = torch.zeros(world, num_experts, dtype=torch.int64, device=proposals.device)
        per_rank[rank] = local
        _all_reduce(per_rank, group)
        position += per_rank[:rank].sum(dim=0)[expert]  # tokens of lower ranks come first
    admitted = torch.zeros_like(in_boundary)
    admitted[where] = position < admit_in_boundary[expert]
    return admitted.view_as(proposals)


def capacity_routing(scores: torch.Tensor, k: int, capacity_factor: float, *, bias: torch.Tensor | None = None,
                     num_bins: int = 1000, score_range: tuple[float, float] = (0.0, 1.0),
                     group=None, renormalize: bool = True, max_rounds: int | None = None) -> Routing:
    """Top-k routing where expert j accepts at most ``C = expert_capacity(N_global, k, E,
    capacity_factor)`` pairs over all ranks of ``group`` (None: this process alone).

    ``bias`` shifts selection only; gates are the unbiased scores of the final experts
    (renormalised over the kept ones unless ``renormalize=False``). ``score_range`` is the
    histogram range (sigmoid/softmax scores lie in [0, 1]); scores outside it fall in the edge
    bins, which coarsens who wins a contested expert but never breaks the capacity.
    ``max_rounds`` caps the overflow rounds (None: until nothing can move; at most E + 1).
    Slots are ordered by biased score, best first, dropped (-1) last. ``Routing.rounds`` says
    how many rounds ran.

    Collectives per call: one all-reduce of ``E * num_bins`` int64 (+1) per round, plus one of
    ``world * E`` int64 in rounds where some expert is over-subscribed. Host syncs per round:
    one read of three global totals (the loop exit), one in over-subscribed rounds (the
    boundary-bin proposals), one to gather the refused tokens and one to find those whose
    candidate list ran short.
    """
    check_scores(scores, k, bias)
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    lo, hi = score_range
    if not hi > lo:
        raise ValueError(f"score_range must be (lo, hi) with hi > lo, got {score_range}")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1 or None, got {max_rounds}")
    num_tokens, num_experts = scores.shape
    biased = biased_scores(scores, bias)
    # Every token's best experts in preference order, computed once: a round scans these
    # [N, c] lists instead of masking and re-sorting [N, E] rows. A token whose list runs out
    # of experts with room gets a fresh list of its best c experts with room that it does not
    # hold (room never grows back, so the list stays exact until it runs out again).
    width = min(num_experts, _CANDIDATES_PER_SLOT * k)
    candidates = biased.topk(width, dim=1).indices
    top_k = candidates[:, :k].clone()  # the lists get refreshed; `rerouted` compares with this
    candidate_bins = histogram_bins(scores.gather(1, candidates), lo, hi, num_bins)
    taken = torch.zeros_like(candidates, dtype=torch.bool)  # candidate already held
    experts = torch.full((num_tokens, k), -1, dtype=torch.int64, device=scores.device)
    # Round 1 is the plain top-k of every token; later rounds only revisit refused tokens.
    rows, room, capacity, round_index = None, None, 0, 0
    while max_rounds is None or round_index < max_rounds:
        if rows is None:
            proposals, bins = candidates[:, :k], candidate_bins[:, :k]
            valid, held = torch.ones_like(proposals, dtype=torch.bool), experts
        else:
            held, listed = experts[rows], taken[rows]
            proposals, bins = candidates[rows], candidate_bins[rows]
            available = ~listed & (room[proposals] > 0)
            valid = available & (available.cumsum(dim=1) <= (held < 0).sum(1, keepdim=True))
        hist = histogram_counts(proposals, bins, num_experts, num_bins, valid)
        # The token count rides along (fixed shape); round 1 uses it to fix the capacity.
        packed = _all_reduce(torch.cat([hist.reshape(-1), hist.new_tensor([num_tokens])]), group)
        hist = packed[:-1].view(num_experts, num_bins)
        demand = hist.sum(dim=1)
        # The one read-back every round needs (round 1: room is unknown yet, read max demand).
        excess = demand - (room if room is not None else 0)
        num_global, total_demand, max_excess = torch.stack([packed[-1], demand.sum(), excess.max()]).tolist()
        if room is None:
            capacity = expert_capacity(num_global, k, num_experts, capacity_factor)
            room = torch.full((num_experts,), capacity, dtype=torch.int64, device=scores.device)
            max_excess -= capacity
        if total_demand == 0:
            break
        accepted = valid
        if max_excess > 0:
            refused = (demand - room).clamp(min=0)
            accepted = valid & _accept(proposals, valid, bins, hist, refused, group)
        room = room - demand.minimum(room)
        new_held = _fill_free_slots(held, proposals, accepted)
        if rows is None:
            experts = new_held
            taken[:, :k] = accepted
        else:
            experts[rows] = new_held
            taken[rows] = listed | accepted
        round_index += 1
        if max_excess <= 0 or round_index == max_rounds:
            break
        # Only tokens just refused can gain anything: the others got all they asked for, and
        # room never grows back.
        refused_rows = (valid & ~accepted).any(dim=1).nonzero().squeeze(1)
        rows = refused_rows if rows is None else rows[refused_rows]
        if width < num_experts:
            _refresh_exhausted_lists(rows, candidates, candidate_bins, taken, experts, scores, biased, room,
                                     (lo, hi, num_bins))
    return _finish(scores, biased, experts, top_k, renormalize,
                   global_load=capacity - room, rounds=round_index)


def _refresh_exhausted_lists(rows, candidates, candidate_bins, taken, experts, scores, biased, room, binning):
    """Give each token of ``rows`` whose list holds fewer experts with room than it has free
    slots a new list: its best ``c`` experts by biased score among those with room that it does
    not hold ([F, E] work for those F tokens only; one host read to find them)."""
    free = (experts[rows] < 0).sum(dim=1)
    available = (~taken[rows] & (room[candidates[rows]] > 0)).sum(dim=1)
    tokens = rows[available < free]
    if tokens.numel() == 0:
        return
    num_experts, width = biased.shape[1], candidates.shape[1]
    held = experts[tokens]
    unavailable = torch.zeros(tokens.numel(), num_experts + 1, dtype=torch.bool, device=biased.device)
    unavailable.scatter_(1, torch.where(held >= 0, held, num_experts), True)  # -1 -> spare column
    unavailable = unavailable[:, :num_experts] | (room <= 0).unsqueeze(0)
    # Unavailable experts may fill the tail of a short list; they stay unavailable for good.
    fresh = biased[tokens].masked_fill(unavailable, -math.inf).topk(width, dim=1).indices
    candidates[tokens] = fresh
    candidate_bins[tokens] = histogram_bins(scores[tokens].gather(1, fresh), *binning)
    taken[tokens] = unavailable.gather(1, fresh)


def _accept(proposals, valid, bins, hist, refused, group):
    """Expert j refuses its ``refused[j]`` lowest-scoring proposals: the lowest admitted one has
    ascending rank ``refused[j]``; bins above that one's bin are in, bins below are out, and the
    boundary bin admits its remaining quota in global token order."""
    oversubscribed = refused > 0
    boundary, below = bin_of_rank(hist, refused)
    boundary = torch.where(oversubscribed, boundary, -1)  # -1: every bin is above the boundary
    in_boundary_bin = hist.gather(1, boundary.clamp(min=0).unsqueeze(1)).squeeze(1)
    admit_in_boundary = torch.where(oversubscribed, in_boundary_bin - (refused - below), 0)
    admitted = _boundary_admission(proposals, valid, bins, boundary, admit_in_boundary, group)
    return (bins > boundary[proposals]) | admitted


def _fill_free_slots(held, proposals, accepted):
    """Rows keep their experts first and free slots (-1) last; accepted proposals fill the free
    slots in order."""
    k = held.shape[1]
    slot = (held >= 0).sum(1, keepdim=True) + accepted.cumsum(1) - 1
    slot = torch.where(accepted, slot, k)  # a spare column takes the rest
    widened = torch.cat([held, held.new_full((held.shape[0], 1), -1)], dim=1)
    widened.scatter_(1, slot, torch.where(accepted, proposals, -1))
    return widened[:, :k]


def _finish(scores, biased, experts, top_k, renormalize, global_load, rounds) -> Routing:
    kept = experts >= 0
    order = biased.gather(1, experts.clamp(min=0)).masked_fill(~kept, -math.inf).argsort(dim=1, descending=True, stable=True)
    experts = experts.gather(1, order)
    kept = experts >= 0
    in_top_k = (experts.unsqueeze(2) == top_k.unsqueeze(1)).any(dim=2)
    return Routing(
        experts=experts,
        gates=gates_from_scores(scores, experts, renormalize),
        dropped=(~kept).sum(),
        rerouted=(kept & ~in_top_k).sum(),
        global_load=global_load,
        rounds=rounds,
    )
