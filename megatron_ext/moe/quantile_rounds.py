"""The rounds of capacity routing, two kinds behind one interface (``quantile_capacity.CapacityRouting`` runs the
protocol of rounds and host reads over either): :class:`TorchRounds`, PyTorch ops on one rank or a group (round 1
on the top-k columns, later rounds on dense ``[N, E]`` masks, :class:`_Overflow`), and :class:`KernelRounds`,
Triton kernels on one CUDA rank (``kimi_kernels/moe_routing``). Also the capacity itself (:func:`expert_capacity`).

The interface: ``first()`` runs round 1's proposals and global histogram (the kernels run the whole round);
``first_refused_and_proposed()``; ``admit_first()``; ``step()`` (one overflow round); ``steps(n)`` (n of them,
one launch on the kernels); device scalars
``active()`` (overflow rounds with a proposal), ``refused()`` / ``proposed()`` (of the last round) and
``kept_pairs()``; ``result(rounds, kept, plain=False)`` -> :class:`RoundsResult`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_ext.moe.quantile_histogram import flat_counts, histogram_bins
from megatron_ext.moe.quantile_routing import biased_scores

__all__ = ["expert_capacity", "TorchRounds", "KernelRounds", "RoundsResult"]


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


class RoundsResult(NamedTuple):
    experts: torch.Tensor
    dropped: torch.Tensor
    rerouted: torch.Tensor
    global_load: torch.Tensor
    rounds: int
    plain: bool
    num_kept: int | None


class TorchRounds:
    """The rounds as PyTorch ops, on one rank or a group: round 1 on the top-k columns (its histogram's all-reduce
    also carries the token count, which fixes the capacity), later rounds on dense masks (:class:`_Overflow`)."""

    def __init__(self, scores, k, capacity_factor, bias, num_bins, lo, hi, group, max_steps):
        self.scores, self.k, self.capacity_factor, self.num_bins, self.lo, self.hi, self.group = (
            scores, k, capacity_factor, num_bins, lo, hi, group)
        self.biased = biased_scores(scores, bias)
        self.overflow: _Overflow | None = None

    def first(self) -> None:
        """Round 1's proposals (every token's plain top-k) and their global histogram; bins come from the
        unbiased scores (the bias is constant per expert, so the order inside an expert is the same)."""
        num_tokens, num_experts = self.scores.shape
        eb = num_experts * self.num_bins
        self.top_k = self.biased.topk(self.k, dim=1).indices
        self.bins = histogram_bins(self.scores.gather(1, self.top_k), self.lo, self.hi, self.num_bins)
        packed = flat_counts(self.bins.add(self.top_k, alpha=self.num_bins), eb + 1)  # last slot: the token count
        if self.group is not None:
            packed[eb:].fill_(num_tokens)  # a fill kernel; item assignment would copy from the host
        self.hist = _all_reduce(packed, self.group)[:eb].view(num_experts, self.num_bins)
        self.demand = self.hist.sum(dim=1)
        self.capacity = (expert_capacity(num_tokens, self.k, num_experts, self.capacity_factor) if self.group is None
                         else _device_capacity(packed[eb], self.k, num_experts, self.capacity_factor))
        self.room = torch.zeros_like(self.demand).add_(self.capacity)
        self.excess = self.demand - self.room

    def first_refused_and_proposed(self):
        return self.excess.max() > 0, self.demand.sum() > 0

    def admit_first(self) -> None:
        accepted = _admit(torch.ones_like(self.top_k, dtype=torch.bool), self.top_k, self.bins, self.hist,
                          self.excess, self.hist.shape[0], self.group)
        self.room = self.room - self.demand.minimum(self.room)
        self.experts = self.top_k.where(accepted, -1)

    def step(self) -> None:
        if self.overflow is None:
            self.overflow = _Overflow(self.scores, self.biased, self.experts, self.room, self.k, self.num_bins,
                                      self.lo, self.hi, self.group)
        self.overflow.step()

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()

    def active(self):  # overflow rounds in which someone proposed
        return self.overflow.active if self.overflow is not None else torch.zeros_like(self.demand[0])

    def refused(self):  # the last round refused a proposal (round 1 did, or the reads would have stopped)
        return self.overflow.refused if self.overflow is not None else torch.ones_like(self.demand[0])

    def proposed(self):
        return self.overflow.demand.any()

    def kept_pairs(self):
        free = self.overflow.free if self.overflow is not None else (self.experts < 0).sum(dim=1)
        return _kept_pairs(free, self.k)

    def result(self, rounds: int, kept: int | None, plain: bool = False) -> "RoundsResult":
        if plain:
            zero = torch.zeros_like(self.demand[0])
            return RoundsResult(self.top_k, zero, zero, self.demand, rounds, True, kept)
        if self.overflow is None:  # round 1 only
            experts = _kept_first(self.experts)
            return RoundsResult(experts, (experts < 0).sum(), torch.zeros_like(self.demand[0]),
                                self.capacity - self.room, rounds, False, kept)
        experts, free, rerouted = self.overflow.result(self.top_k)
        return RoundsResult(experts, free.sum(), rerouted, self.capacity - self.overflow.room, rounds, False, kept)


class KernelRounds:
    """The rounds as Triton kernels on one CUDA rank (``kimi_kernels/moe_routing``): round 1 is a whole round (its
    admission included), so the first read asks whether it refused anything."""

    def __init__(self, scores, k, capacity_factor, bias, num_bins, lo, hi, group, max_steps):
        from kimi_kernels.moe_routing import kernel_rounds

        if group is not None:
            raise ValueError("KernelRounds routes one rank; a capacity group needs TorchRounds (its admission "
                             "all-reduces between kernels)")
        num_tokens, num_experts = scores.shape
        capacity = expert_capacity(num_tokens, k, num_experts, capacity_factor)
        self.rounds = kernel_rounds(scores, k, capacity, bias, num_bins, (lo, hi), max_steps)

    def first(self) -> None:
        self.rounds.step()

    def first_refused_and_proposed(self):
        return self.rounds.flags[0, 1], self.rounds.flags[0, 0]

    def admit_first(self) -> None:  # done in first()
        pass

    def step(self) -> None:
        self.rounds.step()

    def steps(self, count: int) -> None:  # one launch for all of them
        self.rounds.step_many(count)

    def active(self):
        return self.rounds.flags[1:self.rounds.steps, 0].sum()

    def refused(self):
        return self.rounds.flags[self.rounds.steps - 1, 1]

    def proposed(self):
        return self.rounds.flags[self.rounds.steps - 1, 0]

    def kept_pairs(self):
        return self.rounds.admitted[0]

    def result(self, rounds: int, kept: int | None, plain: bool = False) -> "RoundsResult":
        experts, dropped, rerouted, load = self.rounds.result()
        return RoundsResult(experts, dropped, rerouted, load, rounds, plain, kept)


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
