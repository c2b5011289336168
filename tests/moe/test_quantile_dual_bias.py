import pytest
import torch

from megatron_ext.moe.quantile import (
    dual_bias_histogram,
    dual_bias_range,
    dual_bias_update,
    histogram_bins,
    histogram_counts,
    histogram_quantile,
    topk_routing,
)


def _values(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    # Mixed shapes per row: narrow, wide, skewed; all inside [-2, 3].
    scale = torch.rand(rows, 1, generator=g) * 0.8 + 0.05
    return (torch.randn(rows, n, generator=g) * scale + torch.rand(rows, 1, generator=g)).clamp(-2.0, 3.0)


@pytest.mark.parametrize("n", [1, 2, 7, 500])
@pytest.mark.parametrize("num_bins", [10, 1000])
def test_histogram_quantile_is_within_one_bin_of_exact(n, num_bins):
    lo, hi, rows = -2.0, 3.0, 6
    values = _values(rows, n, seed=n + num_bins)
    index = torch.arange(rows).unsqueeze(1).expand_as(values)
    counts = histogram_counts(index, histogram_bins(values, lo, hi, num_bins), rows, num_bins)
    assert counts.dtype == torch.int64 and counts.sum().item() == rows * n
    width = (hi - lo) / num_bins
    for q in [0.0, 0.03125, 0.25, 0.5, 0.9, 1.0]:
        exact = torch.quantile(values, q, dim=1)
        for c in (counts, counts.float()):
            got = histogram_quantile(c, lo, hi, q)
            assert got.dtype == torch.float32
            assert (got - exact).abs().max().item() <= width * (1 + 1e-4), (q, c.dtype)


def test_histogram_quantile_per_row_q_and_empty_rows():
    counts = torch.tensor([[0, 4, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    got = histogram_quantile(counts, 0.0, 4.0, torch.tensor([0.5, 1.0, 0.5], dtype=torch.float64))
    assert 1.0 <= got[0].item() < 2.0 and 3.0 <= got[1].item() <= 4.0
    assert torch.isnan(got[2])
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(counts, 0.0, 4.0, 1.5)


def max_violation(experts, num_experts):
    load = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
    return ((load.max() - load.mean()) / load.mean()).item()


def test_dual_bias_drives_load_to_uniform_on_skewed_scores():
    n, e, k, microbatches = 2048, 16, 2, 2
    g = torch.Generator().manual_seed(0)
    offsets = torch.linspace(-1.5, 1.5, e)[torch.randperm(e, generator=g)]
    logits = torch.randn(microbatches, n, e, generator=g) + offsets
    batches = logits.sigmoid()
    bias = torch.zeros(e)
    unbiased = max_violation(topk_routing(batches.flatten(0, 1), k).experts, e)
    for _ in range(4):
        lo, hi = dual_bias_range(bias)  # fixed for the step
        counts = sum(dual_bias_histogram(s, bias, k, lo, hi) for s in batches)
        bias = dual_bias_update(counts, lo, hi, k)
        assert bias.dtype == torch.float32 and abs(bias.mean().item()) < 1e-5
    balanced = max_violation(topk_routing(batches.flatten(0, 1), k, bias).experts, e)
    # Fresh tokens from the same distribution: the bias generalises, not just fits.
    fresh = (torch.randn(4 * n, e, generator=g) + offsets).sigmoid()
    fresh_vio = max_violation(topk_routing(fresh, k, bias).experts, e)
    assert unbiased > 2.0
    assert balanced < 0.1 and fresh_vio < 0.15, (unbiased, balanced, fresh_vio)


def test_dual_bias_histogram_counts_residuals_against_the_k_plus_1th_score():
    n, e, k = 64, 8, 3
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(n, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.1
    lo, hi = dual_bias_range(bias)
    counts = dual_bias_histogram(scores, bias, k, lo, hi, num_bins=50)
    alpha = (scores + bias).sort(dim=1, descending=True).values[:, k : k + 1]
    residual = alpha - scores
    assert bool((residual >= lo).all() and (residual <= hi).all())
    ref = torch.stack([torch.histc(residual[:, j], 50, lo.item(), hi.item()) for j in range(e)])
    assert counts.sum().item() == n * e
    # Same bins up to values sitting exactly on an edge.
    assert (counts.float() - ref).abs().sum().item() <= 2


def test_dual_bias_rejects_k_equal_to_num_experts():
    with pytest.raises(ValueError, match="k must be < num_experts"):
        dual_bias_histogram(torch.rand(4, 4), torch.zeros(4), 4, -1.0, 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        dual_bias_range(torch.zeros(4, dtype=torch.float64))


def test_batched_updates_match_each_layer_exactly():
    from megatron_ext.moe.quantile_dual_bias import dual_bias_updates

    g = torch.Generator().manual_seed(3)
    layers, experts, k, num_bins = 3, 8, 2, 50
    biases = torch.randn(layers, experts, generator=g) * 0.1
    counts = torch.stack([
        dual_bias_histogram(torch.rand(40, experts, generator=g), biases[i], k, *dual_bias_range(biases[i]), num_bins)
        for i in range(layers)])
    counts[1] = 0  # an empty histogram keeps its layer's bias
    batched = dual_bias_updates(counts, biases, k)
    for i in range(layers):
        lo, hi = dual_bias_range(biases[i])
        own = dual_bias_update(counts[i], lo, hi, k) if counts[i].sum() > 0 else biases[i]
        assert torch.equal(batched[i], own), i
