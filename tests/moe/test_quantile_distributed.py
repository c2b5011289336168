"""Quantile routing on W gloo ranks equals the one-rank routing of the concatenated batch."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.moe.quantile import (
    capacity_routing,
    dual_bias_histogram,
    dual_bias_range,
    dual_bias_update,
    expert_capacity,
)
from tests._dist import run_distributed

NUM_EXPERTS, K = 16, 4
# (capacity_factor, num_bins, host_reads): over-full, tight, loose; coarse bins put many ties in the
# boundary bin, so admission order across ranks matters; the last two without host reads (1 + 1 rounds).
CASES = [(0.7, 8, True), (1.0, 1000, True), (1.25, 4, True), (0.7, 8, False), (1.0, 16, False)]


def rank_sizes(world_size):
    return [40 + 13 * r for r in range(world_size)]  # uneven on purpose


def global_inputs(world_size, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(rank_sizes(world_size))
    offsets = torch.linspace(-2.0, 2.0, NUM_EXPERTS)[torch.randperm(NUM_EXPERTS, generator=g)]
    scores = (torch.randn(n, NUM_EXPERTS, generator=g) + offsets).sigmoid()
    bias = torch.randn(NUM_EXPERTS, generator=g) * 0.2
    return scores, bias


def route_all_cases(scores, bias, group):
    out = []
    for capacity_factor, num_bins, host_reads in CASES:
        r = capacity_routing(scores, K, capacity_factor, bias=bias, num_bins=num_bins, group=group,
                             host_reads=host_reads, device_rounds=None if host_reads else 1)
        out.append((r.experts, r.gates, r.dropped, r.rerouted, r.global_load))
    lo, hi = dual_bias_range(bias)
    counts = dual_bias_histogram(scores, bias, K, lo, hi, num_bins=100)
    if group is not None:
        dist.all_reduce(counts, group=group)
    out.append(dual_bias_update(counts, lo, hi, K))
    return out


def _route_on_rank(rank, world_size, seed):
    scores, bias = global_inputs(world_size, seed)
    sizes = rank_sizes(world_size)
    start = sum(sizes[:rank])
    return route_all_cases(scores[start : start + sizes[rank]], bias, dist.group.WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_routing_equals_one_rank_on_concatenated_batch(world_size):
    seed = 11 + world_size
    per_rank = run_distributed(_route_on_rank, world_size, seed)
    scores, bias = global_inputs(world_size, seed)
    reference = route_all_cases(scores, bias, None)
    n = scores.shape[0]
    for case, (capacity_factor, _, _) in enumerate(CASES):
        experts, gates, dropped, rerouted, _ = reference[case]
        assert torch.equal(torch.cat([r[case][0] for r in per_rank]), experts), CASES[case]
        assert torch.equal(torch.cat([r[case][1] for r in per_rank]), gates)
        assert sum(r[case][2] for r in per_rank).item() == dropped.item()
        assert sum(r[case][3] for r in per_rank).item() == rerouted.item()
        load = torch.bincount(experts[experts >= 0], minlength=NUM_EXPERTS)
        assert load.max().item() <= expert_capacity(n, K, NUM_EXPERTS, capacity_factor)
        assert all(torch.equal(r[case][4], load) for r in per_rank)
    # The cases are not trivial: something was rerouted, and the over-full one dropped.
    assert reference[0][2].item() > 0 and all(reference[c][3].item() > 0 for c in range(len(CASES)))
    for r in per_rank:
        torch.testing.assert_close(r[-1], reference[-1], rtol=0, atol=1e-6)
