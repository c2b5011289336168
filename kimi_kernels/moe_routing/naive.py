"""PyTorch reference of one-rank capacity routing in rounds, written for clarity rather than speed.

Each round, every token proposes to its best experts (by biased score) that it does not hold and that
still have room, one proposal per free slot; expert j admits its ``room_j`` best proposals, best meaning
a higher score bin, then an earlier token. Round 1 is the round where nothing is held (the plain top-k).
This is the rule ``megatron_ext.moe.quantile_capacity`` resolves from histograms; here it is a sort.
"""

from __future__ import annotations

import torch


def score_bins(scores: torch.Tensor, lo: float, hi: float, num_bins: int) -> torch.Tensor:
    """int64 bin of each score in ``num_bins`` equal bins over ``[lo, hi]`` (edge bins take the rest),
    with the fp32 arithmetic of ``quantile_histogram.histogram_bins``."""
    scale = torch.tensor(num_bins / (hi - lo), dtype=torch.float32)
    return ((scores - lo) * scale).clamp_(0, num_bins - 1).long()


def capacity_rounds_reference(scores, k, capacity, bias=None, num_bins=1000, score_range=(0.0, 1.0), rounds=3):
    """(experts ``[N, k]`` int64: held experts by biased score then -1; dropped pairs; rerouted pairs (held
    outside the plain top-k); per-expert load ``[E]``), all int64, after ``rounds`` rounds."""
    num_tokens, num_experts = scores.shape
    biased = scores if bias is None else scores + bias
    preference = biased.argsort(dim=1, descending=True, stable=True)
    bins = score_bins(scores, *score_range, num_bins)
    held = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    room = torch.full((num_experts,), capacity, dtype=torch.int64)
    tokens = torch.arange(num_tokens)
    for _ in range(rounds):
        free = k - held.sum(dim=1)
        available = (~held & (room > 0)).gather(1, preference)
        proposed_in_order = available & (available.cumsum(dim=1) <= free.unsqueeze(1))
        proposals = torch.zeros_like(held).scatter_(1, preference, proposed_in_order)
        for expert in range(num_experts):
            who = tokens[proposals[:, expert]]
            # best first: higher bin, then lower token id (who is ascending, the sort is stable)
            ranked = who[bins[who, expert].argsort(descending=True, stable=True)]
            admitted = ranked[:int(room[expert])]
            held[admitted, expert] = True
            room[expert] -= admitted.numel()
    held_in_order = held.gather(1, preference)
    kept = held.sum(dim=1)
    experts = torch.full((num_tokens, k), -1, dtype=torch.int64)
    for token in range(num_tokens):
        experts[token, :kept[token]] = preference[token][held_in_order[token]]
    rerouted = held_in_order[:, k:].sum()
    return experts, (k - kept).sum(), rerouted, capacity - room
