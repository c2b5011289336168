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

GPU cost model: the work is tiny, so the cost is kernel launches and host reads. A host read
drains the GPU, which then idles while the host launches the next small kernels; a host-bound step
pays for every launch instead. So the common case, no expert over-subscribed in round 1 (plain
top-k), is round 1 and one read. Otherwise round 1's admission and ``device_rounds`` overflow rounds
(dense ``[N, E]`` masks; a round with nothing left to move is a no-op) run before a second read,
which says whether a token could still move; only then does each further round read once.

``host_reads=False`` reads nothing: round 1's admission and exactly ``device_rounds`` overflow rounds
always run, so a token that could still move after them is dropped (the result of ``host_reads=True``
with ``max_rounds = 1 + device_rounds``), and the kept-pair count stays on the device (a one-rank
dispatcher then keeps static ``[N k]`` buffers): the layer has no host sync, as CUDA-graph capture
needs. On one CUDA rank these rounds run as Triton kernels (``ROUTING_KERNELS``; ``kernels/moe_routing``). By
itself it did not speed up the all-techniques benchmark step on the H200, which is bound by
the host's launch rate rather than by these reads (docs/quantile_balancing.md, "Host reads").
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_ext.moe.quantile_histogram import flat_counts, histogram_bins
from megatron_ext.moe.quantile_routing import Routing, biased_scores, check_scores, gates_from_scores

__all__ = ["expert_capacity", "capacity_routing"]


# Overflow rounds run between an over-subscribed call's two host reads (capacity_routing's device_rounds
# default): each costs ~40 small launches on [N, E] whether or not anything is left to move.
DEVICE_ROUNDS = 2

# One-rank CUDA routing without host reads runs its rounds as Triton kernels (kernels/moe_routing: three
# launches per round instead of ~40 PyTorch ops; the same result up to the order among equal biased scores).
# False: the PyTorch ops below (the benchmarks' ``+torch-rounds`` rows).
ROUTING_KERNELS = True


def expert_capacity(num_tokens_global: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * num_tokens_global * k / num_experts)``: the (token, expert) pairs
    one expert accepts, summed over the group. Rounded to 1e-9 first so that float noise in
    ``capacity_factor`` (e.g. 1.1) cannot add a slot; the same float64 steps as the device version
    (:func:`_device_capacity`), so that one rank and a group agree to the slot."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if num_experts < 1 or k < 1 or num_tokens_global < 0:
        raise ValueError(f"need num_experts >= 1, k >= 1, num_tokens_global >= 0; got "
                         f"{num_experts}, {k}, {num_tokens_global}")
    return math.ceil(round(float(num_tokens_global) * capacity_factor * k / num_experts * 1e9) / 1e9)


def _device_capacity(num_tokens_global: torch.Tensor, k: int, num_experts: int, capacity_factor: float
                     ) -> torch.Tensor:
    """:func:`expert_capacity` of a 0-d int64 device tensor (a group's token count), without a host read."""
    x = num_tokens_global.double() * capacity_factor * k / num_experts
    return torch.ceil(torch.round(x * 1e9) / 1e9).long()


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


def capacity_routing(scores: torch.Tensor, k: int, capacity_factor: float, *, bias: torch.Tensor | None = None,
                     num_bins: int = 1000, score_range: tuple[float, float] = (0.0, 1.0),
                     group=None, renormalize: bool = True, max_rounds: int | None = None,
                     device_rounds: int | None = None, host_reads: bool = True) -> Routing:
    """Top-k routing where expert j accepts at most ``C = expert_capacity(N_global, k, E,
    capacity_factor)`` pairs over all ranks of ``group`` (None: this process alone).

    ``bias`` shifts selection only; gates are the unbiased scores of the final experts
    (renormalised over the kept ones unless ``renormalize=False``); only the gates carry
    gradients. ``score_range`` is the histogram range (sigmoid/softmax scores lie in [0, 1]);
    scores outside it fall in the edge bins, which coarsens who wins a contested expert but
    never breaks the capacity. ``max_rounds`` caps the overflow rounds (None: until nothing can
    move; at most E + 1). Slots are ordered by biased score, best first, dropped (-1) last.
    ``Routing.rounds`` says how many rounds ran. ``device_rounds`` (default ``DEVICE_ROUNDS``): the
    overflow rounds run before the host read; the result does not depend on it. ``host_reads=False``:
    no host read; exactly ``1 + device_rounds`` rounds run (capped by ``max_rounds``), a token that
    could still move after them is dropped, ``Routing.num_kept`` is None and ``Routing.rounds`` counts
    the rounds run, useful or not.

    Collectives per call: per round, one all-reduce of ``E * num_bins`` int64 (+1 in round 1) and
    one of ``world * E`` int64; ``1 + device_rounds`` rounds run (fewer with ``max_rounds``), more
    only when tokens can still move. Host reads: one, plus one per round beyond those (none without
    ``host_reads``).
    """
    check_scores(scores, k, bias)
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    lo, hi = score_range
    if not hi > lo:
        raise ValueError(f"score_range must be (lo, hi) with hi > lo, got {score_range}")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1 or None, got {max_rounds}")
    device_rounds = DEVICE_ROUNDS if device_rounds is None else device_rounds
    if not isinstance(device_rounds, int) or device_rounds < 0:
        raise ValueError(f"device_rounds must be an int >= 0 or None, got {device_rounds!r}")
    if not isinstance(host_reads, bool):
        raise ValueError(f"host_reads must be True or False, got {host_reads!r}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None  # a one-rank collective is an identity that still costs a launch and a sync
    with torch.no_grad():  # only the gates below are differentiable
        result = _route(scores.detach(), k, capacity_factor, bias, num_bins, lo, hi, group, max_rounds,
                        device_rounds, host_reads)
    gates = gates_from_scores(scores, result.experts, renormalize, all_kept=result.plain)
    return Routing(result.experts, gates, result.dropped, result.rerouted, global_load=result.global_load,
                   rounds=result.rounds, plain=result.plain, num_kept=result.num_kept)


def _route(scores, k, capacity_factor, bias, num_bins, lo, hi, group, max_rounds, device_rounds, host_reads):
    num_tokens, num_experts = scores.shape
    overflow_rounds = device_rounds if max_rounds is None else min(device_rounds, max_rounds - 1)
    if ROUTING_KERNELS and not host_reads and group is None and scores.is_cuda and num_tokens > 0:
        from kernels.moe_routing import capacity_rounds

        capacity = expert_capacity(num_tokens, k, num_experts, capacity_factor)
        experts, dropped, rerouted, load = capacity_rounds(scores, k, capacity, bias, num_bins, (lo, hi),
                                                           1 + overflow_rounds)
        return _Result(experts, dropped, rerouted, load, 1 + overflow_rounds, False, None)
    eb = num_experts * num_bins
    biased = biased_scores(scores, bias)
    # Round 1: every token proposes its plain top-k; bins come from the unbiased scores (the
    # bias is constant per expert, so the order inside an expert is the same).
    top_k = biased.topk(k, dim=1).indices
    bins = histogram_bins(scores.gather(1, top_k), lo, hi, num_bins)
    packed = flat_counts(bins.add(top_k, alpha=num_bins), eb + 1)  # the spare last slot carries the token count
    if group is not None:
        packed[eb:].fill_(num_tokens)  # a fill kernel; item assignment would copy from the host
    hist = _all_reduce(packed, group)[:eb].view(num_experts, num_bins)
    demand = hist.sum(dim=1)
    capacity = (expert_capacity(num_tokens, k, num_experts, capacity_factor) if group is None
                else _device_capacity(packed[eb], k, num_experts, capacity_factor))
    room = torch.zeros_like(demand).add_(capacity)
    excess = demand - room
    if host_reads:
        # The read of a call where nothing overflows (the common case): then the result is plain top-k.
        max_excess, total_demand = _read(excess.max(), demand.sum())
        if max_excess <= 0:
            zero = torch.zeros_like(demand[0])
            return _Result(top_k, zero, zero, demand, 1 if total_demand else 0, True, num_tokens * k)
    accepted = _admit(torch.ones_like(top_k, dtype=torch.bool), top_k, bins, hist, excess, num_experts, group)
    room = room - demand.minimum(room)
    experts = top_k.where(accepted, -1)
    if max_rounds == 1:
        experts, free = _kept_first(experts), (experts < 0).sum(dim=1)
        kept = _read(_kept_pairs(free, k))[0] if host_reads else None
        return _Result(experts, free.sum(), torch.zeros_like(demand[0]), capacity - room, 1, False, kept)
    overflow = _Overflow(scores, biased, experts, room, k, num_bins, lo, hi, group)
    for _ in range(overflow_rounds):
        overflow.step()
    if not host_reads:
        experts, free, rerouted = overflow.result(top_k)
        return _Result(experts, free.sum(), rerouted, capacity - overflow.room, 1 + overflow_rounds, False, None)
    # The second read: rounds that did something, whether a further round could move a token, kept pairs.
    active, movable, kept = _read(overflow.active, overflow.refused, _kept_pairs(overflow.free, k))
    rounds = 1 + active
    while movable and (max_rounds is None or rounds < max_rounds):  # rare: one read per round
        overflow.step()
        proposed, movable, kept = _read(overflow.demand.any(), overflow.refused, _kept_pairs(overflow.free, k))
        if not proposed:
            break
        rounds += 1
    experts, free, rerouted = overflow.result(top_k)
    return _Result(experts, free.sum(), rerouted, capacity - overflow.room, rounds, False, kept)


class _Result(NamedTuple):
    experts: torch.Tensor
    dropped: torch.Tensor
    rerouted: torch.Tensor
    global_load: torch.Tensor
    rounds: int
    plain: bool
    num_kept: int | None


def _read(*scalars: torch.Tensor) -> list[int]:
    """One host read of several 0-d tensors (bool or int)."""
    return torch.stack([t.to(torch.int64) for t in scalars]).tolist()


def _kept_pairs(free: torch.Tensor, k: int) -> torch.Tensor:
    return free.numel() * k - free.sum()


def _kept_first(experts):
    # Refused slots (-1) move behind the kept ones; top-k order is already by biased score.
    order = (experts >= 0).to(torch.int8).argsort(dim=1, descending=True, stable=True)
    return experts.gather(1, order)


class _Overflow:
    """Rounds 2, 3, ... on dense ``[N, E]`` masks whose column j is expert j. A token that holds k
    experts, or finds none with room, proposes nothing, so a round after the last useful one
    changes nothing. Per round, from group-wide counts (so every rank runs the same rounds):
    ``active`` counts the rounds with a proposal anywhere, ``demand`` is the last round's and
    ``refused`` says it refused one (only then can a further round move a token: after a round
    that refuses nothing, every token with a free slot holds every expert with room)."""

    def __init__(self, scores, biased, held_slots, room, k, num_bins, lo, hi, group):
        num_rows, num_experts = biased.shape
        self.k, self.num_bins, self.group, self.biased, self.room = k, num_bins, group, biased, room
        self.eb = num_experts * num_bins
        # A token's preference order and each expert's place in it (ties: lower expert id first).
        self.preference = biased.argsort(dim=1, descending=True, stable=True)
        self.place = torch.empty_like(self.preference).scatter_(
            1, self.preference, torch.arange(num_experts, device=biased.device).expand_as(self.preference))
        self.bins = histogram_bins(scores, lo, hi, num_bins)
        self.keys = self.bins + torch.arange(0, self.eb, num_bins, device=biased.device)
        held = torch.zeros(num_rows, num_experts + 1, dtype=torch.bool, device=biased.device)
        self.held = held.scatter_(1, held_slots.where(held_slots >= 0, num_experts), True)[:, :num_experts]
        self.free = (held_slots < 0).sum(dim=1, dtype=torch.int32)  # int32 like the cumsums: no casts
        self.active = torch.zeros((), dtype=torch.int64, device=biased.device)
        self.refused = torch.ones((), dtype=torch.bool, device=biased.device)  # round 1 over-subscribed
        self.demand: torch.Tensor | None = None  # the last round's demand, set by step()

    def step(self) -> None:
        """One round: each token proposes to its best ``free`` experts with room that it does not
        hold; each expert admits its best proposals up to its room (:func:`_admit`)."""
        available = ~self.held & (self.room > 0)
        ahead = available.gather(1, self.preference).cumsum(dim=1, dtype=torch.int32).gather(1, self.place)
        proposals = available & (ahead <= self.free.unsqueeze(1))
        # Non-proposals are counted in a spare copy (no atomic hot spot).
        counts = flat_counts(self.keys.where(proposals, self.keys + self.eb), 2 * self.eb)[:self.eb]
        hist = _all_reduce(counts, self.group).view(-1, self.num_bins)
        demand = hist.sum(dim=1)
        excess = demand - self.room
        proposals = _admit(proposals, None, self.bins, hist, excess, hist.shape[0], self.group)
        self.held |= proposals
        self.free = self.free - proposals.sum(dim=1, dtype=torch.int32)
        self.room = self.room - demand.minimum(self.room)
        self.demand = demand
        self.refused = (excess > 0).any()  # an excess needs a demand: no "and anyone proposed" needed
        self.active += demand.any()

    def result(self, top_k):
        """(experts ``[N, k]``: held experts by biased score, best first, then -1; free slots ``[N]``;
        rerouted pairs, those outside the token's plain top-k)."""
        order = self.biased.masked_fill(~self.held, -math.inf).topk(self.k, dim=1).indices
        experts = order.where(torch.arange(self.k, device=order.device) < (self.k - self.free).unsqueeze(1), -1)
        in_top_k = torch.zeros_like(self.held).scatter_(1, top_k, True)
        return experts, self.free, (self.held & ~in_top_k).sum()


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
