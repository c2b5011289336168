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

GPU cost model: the work is tiny, so the cost is kernel launches and host syncs. Round 1 works
on the ``[N, k]`` top-k and reads one ``[E + 1]`` vector back; when no expert is over-subscribed
(the common case) that is the whole call, about 20 launches. Otherwise only the tokens refused
in round 1 can move later; they are gathered once (one more host read) and every later round
runs on dense, fixed-shape ``[M, E]`` masks in expert order (no per-round compaction or list
refresh), with one host read per round: the stop test.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_ext.moe.quantile_histogram import flat_counts, histogram_bins
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


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def capacity_routing(scores: torch.Tensor, k: int, capacity_factor: float, *, bias: torch.Tensor | None = None,
                     num_bins: int = 1000, score_range: tuple[float, float] = (0.0, 1.0),
                     group=None, renormalize: bool = True, max_rounds: int | None = None) -> Routing:
    """Top-k routing where expert j accepts at most ``C = expert_capacity(N_global, k, E,
    capacity_factor)`` pairs over all ranks of ``group`` (None: this process alone).

    ``bias`` shifts selection only; gates are the unbiased scores of the final experts
    (renormalised over the kept ones unless ``renormalize=False``); only the gates carry
    gradients. ``score_range`` is the histogram range (sigmoid/softmax scores lie in [0, 1]);
    scores outside it fall in the edge bins, which coarsens who wins a contested expert but
    never breaks the capacity. ``max_rounds`` caps the overflow rounds (None: until nothing can
    move; at most E + 1). Slots are ordered by biased score, best first, dropped (-1) last.
    ``Routing.rounds`` says how many rounds ran.

    Collectives per call: one all-reduce of ``E * num_bins`` int64 (+1 in round 1) per round,
    plus one of ``world * E`` int64 in rounds where some expert is over-subscribed. Host reads:
    one per round (the stop test), plus one to gather the tokens refused in round 1.
    """
    check_scores(scores, k, bias)
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    lo, hi = score_range
    if not hi > lo:
        raise ValueError(f"score_range must be (lo, hi) with hi > lo, got {score_range}")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1 or None, got {max_rounds}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None  # a one-rank collective is an identity that still costs a launch and a sync
    with torch.no_grad():  # only the gates below are differentiable
        experts, dropped, rerouted, global_load, rounds, plain = _route(
            scores.detach(), k, capacity_factor, bias, num_bins, lo, hi, group, max_rounds)
    return Routing(experts, gates_from_scores(scores, experts, renormalize, all_kept=plain), dropped, rerouted,
                   global_load=global_load, rounds=rounds, plain=plain)


def _route(scores, k, capacity_factor, bias, num_bins, lo, hi, group, max_rounds):
    num_tokens, num_experts = scores.shape
    eb = num_experts * num_bins
    biased = biased_scores(scores, bias)
    # Round 1: every token proposes its plain top-k; bins come from the unbiased scores (the
    # bias is constant per expert, so the order inside an expert is the same).
    top_k = biased.topk(k, dim=1).indices
    bins = histogram_bins(scores.gather(1, top_k), lo, hi, num_bins)
    keys = bins.add(top_k, alpha=num_bins)
    packed = flat_counts(keys, eb + 1)  # the spare last slot carries the token count
    if group is not None:
        packed[eb:].fill_(num_tokens)  # a fill kernel; item assignment would copy from the host
    hist = _all_reduce(packed, group)[:eb].view(num_experts, num_bins)
    demand = hist.sum(dim=1)
    # The one host read of a call without overflow: demand per expert and the global count.
    host = torch.cat([demand, packed[eb:]]).tolist()
    host_demand, num_global = host[:num_experts], (host[-1] if group is not None else num_tokens)
    capacity = expert_capacity(num_global, k, num_experts, capacity_factor)
    zeros = torch.zeros(2, dtype=torch.int64, device=scores.device)
    if sum(host_demand) == 0:  # no tokens anywhere: no round ran
        return top_k, zeros[0], zeros[1], demand, 0, True
    if max(host_demand) <= capacity:  # nobody over-subscribed: plain top-k
        return top_k, zeros[0], zeros[1], demand, 1, True

    room = torch.full_like(demand, capacity)
    # The top-k proposals sit at columns top_k: dense [N, E] views only where token order matters.
    accepted = _admit(torch.ones_like(top_k, dtype=torch.bool), top_k, bins, hist, demand - room, num_experts,
                      group)
    room = room - demand.minimum(room)
    experts = top_k.where(accepted, -1)
    if max_rounds == 1:
        return *_finish(experts, capacity, room, 1), False
    # Only tokens refused in round 1 can gain anything later (the others hold k experts, and
    # room never grows back): gather them once.
    rows = (~accepted).any(dim=1).nonzero().squeeze(1)
    held, free, room, rounds = _overflow_rounds(scores[rows], biased[rows], experts[rows], room, k, num_bins, lo, hi,
                                          group, max_rounds)
    # Final slots of those rows: held experts by biased score, best first, then -1.
    order = biased[rows].masked_fill(~held, -math.inf).topk(k, dim=1).indices
    num_held = (k - free).unsqueeze(1)
    experts[rows] = order.where(torch.arange(k, device=order.device) < num_held, -1)
    in_top_k = torch.zeros_like(held).scatter_(1, top_k[rows], True)
    rerouted = (held & ~in_top_k).sum()
    return experts, free.sum(), rerouted, capacity - room, 1 + rounds, False


def _finish(experts, capacity, room, rounds):
    # Refused slots (-1) move behind the kept ones; top-k order is already by biased score.
    kept = experts >= 0
    order = kept.to(torch.int8).argsort(dim=1, descending=True, stable=True)
    return experts.gather(1, order), (~kept).sum(), torch.zeros_like(room[0]), capacity - room, rounds


def _overflow_rounds(scores, biased, held_slots, room, k, num_bins, lo, hi, group, max_rounds):
    """Rounds 2, 3, ... for the ``M`` tokens refused in round 1, on ``[M, E]`` masks whose column
    j is expert j. Returns (``held [M, E]`` bool, ``free [M]`` slots left, ``room [E]``, rounds run)."""
    num_rows, num_experts = biased.shape
    eb = num_experts * num_bins
    # A token's preference order and each expert's place in it (ties: lower expert id first).
    preference = biased.argsort(dim=1, descending=True, stable=True)
    place = torch.empty_like(preference).scatter_(
        1, preference, torch.arange(num_experts, device=preference.device).expand_as(preference))
    bins = histogram_bins(scores, lo, hi, num_bins)
    keys = bins + torch.arange(0, eb, num_bins, device=bins.device)
    spare_keys = keys + eb  # non-proposals are counted in a spare copy (no atomic hot spot)
    held = torch.zeros(num_rows, num_experts + 1, dtype=torch.bool, device=biased.device)
    held = held.scatter_(1, held_slots.where(held_slots >= 0, num_experts), True)[:, :num_experts]
    free = (held_slots < 0).sum(dim=1, dtype=torch.int32)  # int32 like the cumsums: no casts
    rounds = 0
    while max_rounds is None or rounds + 1 < max_rounds:
        # Each token proposes to its best `free` experts with room that it does not hold.
        available = ~held & (room > 0)
        ahead = available.gather(1, preference).cumsum(dim=1, dtype=torch.int32).gather(1, place)
        proposals = available & (ahead <= free.unsqueeze(1))
        hist = _all_reduce(flat_counts(keys.where(proposals, spare_keys), 2 * eb)[:eb], group)
        hist = hist.view(num_experts, num_bins)
        demand = hist.sum(dim=1)
        excess = demand - room
        host_demand, host_excess = torch.stack([demand, excess]).tolist()  # the stop test
        if sum(host_demand) == 0:  # no refused token has an expert with room left
            break
        rounds += 1
        if max(host_excess) > 0:
            proposals = _admit(proposals, None, bins, hist, excess, num_experts, group)
        held |= proposals
        free = free - proposals.sum(dim=1, dtype=torch.int32)
        room = room - demand.minimum(room)
        if max(host_excess) <= 0:
            break
    return held, free, room, rounds


def _admit(proposals, columns, bins, hist, excess, num_experts, group):
    """Which proposals are accepted: expert j keeps its best ``demand_j - excess_j`` (all of them
    when ``excess_j <= 0``). With ``cum`` the running count over ascending bins, the boundary bin
    ``b_j`` is the first with ``cum > excess_j`` (it holds the lowest admitted one): bins above it
    are in, bins below out, and ``b_j`` admits ``cum[b_j] - excess_j`` in global token order.

    ``proposals``/``bins``: ``[M, w]``; entry ``(i, s)`` is expert ``columns[i, s]``, or expert
    ``s`` when ``columns`` is None (then ``w = E``)."""
    cum = hist.cumsum(dim=1)
    # The clamp only matters when excess >= demand (no room), and then the quota below is 0.
    boundary = (cum <= excess.unsqueeze(1)).sum(dim=1).clamp_(max=hist.shape[1] - 1)
    quota = cum.gather(1, boundary.unsqueeze(1)).squeeze(1) - excess
    if columns is not None:
        boundary = boundary[columns]
    at_boundary = proposals & (bins == boundary)
    dense = at_boundary
    if columns is not None:  # a token proposes to an expert at most once
        dense = torch.zeros(bins.shape[0], num_experts, dtype=torch.bool, device=bins.device)
        dense.scatter_(1, columns, at_boundary)
    # 1-based place among the expert's boundary-bin proposals in token order: a scan along
    # tokens, run on a transposed int32 copy (contiguous, which the CPU needs to be fast).
    position = torch.empty(num_experts, bins.shape[0], dtype=torch.int32, device=bins.device)
    position = position.copy_(dense.t()).cumsum_(dim=1).t()
    if group is not None:  # boundary-bin proposals of lower ranks come first
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        per_rank = torch.zeros(world, num_experts, dtype=torch.int64, device=bins.device)
        per_rank[rank] = position[-1] if position.shape[0] else 0
        quota = quota - _all_reduce(per_rank, group)[:rank].sum(dim=0)
    if columns is not None:
        position, quota = position.gather(1, columns), quota[columns]
    return (proposals & (bins > boundary)) | (at_boundary & (position <= quota))
