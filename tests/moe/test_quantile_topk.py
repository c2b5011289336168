import pytest
import torch

from megatron_ext.moe.quantile import Routing, topk_routing


def _scores(n, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, e, generator=g).sigmoid()


def test_topk_routing_matches_torch_topk_with_bias_for_selection_only():
    scores = _scores(64, 16)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.3
    r = topk_routing(scores, 4, bias)
    ref = (scores + bias).topk(4, dim=1).indices
    assert torch.equal(r.experts, ref)
    picked = scores.gather(1, ref)
    torch.testing.assert_close(r.gates, picked / picked.sum(1, keepdim=True))
    assert r.dropped.item() == 0 and r.rerouted.item() == 0


def test_topk_routing_without_renormalisation_gives_raw_scores():
    scores = _scores(32, 8)
    r = topk_routing(scores, 2, renormalize=False)
    torch.testing.assert_close(r.gates, scores.topk(2, dim=1).values)


@pytest.mark.parametrize("bad", [
    dict(scores=torch.rand(4, 8, dtype=torch.float64), k=2),
    dict(scores=torch.rand(8), k=2),
    dict(scores=torch.rand(4, 8), k=9),
    dict(scores=torch.rand(4, 8), k=0),
    dict(scores=torch.rand(4, 8), k=2, bias=torch.zeros(7)),
])
def test_topk_routing_rejects_bad_input_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"^(scores|k|bias) must"):
        topk_routing(**bad)


def test_routing_validates_shapes_and_dtypes():
    experts = torch.zeros(3, 2, dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.int64)
    with pytest.raises(ValueError, match="Routing.gates"):
        Routing(experts, torch.zeros(3, 2, dtype=torch.float16), zero, zero)
    with pytest.raises(ValueError, match="Routing.dropped"):
        Routing(experts, torch.zeros(3, 2), torch.zeros(1, dtype=torch.int64), zero)
