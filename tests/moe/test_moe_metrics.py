import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron_ext.moe.layer import MoELayer
from megatron_ext.moe.metrics import collect_moe_metrics, ep_load_factor, max_violation, reset_moe_step_statistics
from tests._dist import run_distributed
from tests.moe.test_moe_router import moe_config

E, HIDDEN = 8, 16


def _direct_maxvio(loads):
    mean = sum(loads) / len(loads)
    return (max(loads) - mean) / mean


def _direct_load_factor(loads, ep_size):
    per_rank = len(loads) // ep_size
    received = [sum(loads[r * per_rank:(r + 1) * per_rank]) for r in range(ep_size)]
    return max(received) / (sum(received) / ep_size)


@pytest.mark.parametrize("seed", range(5))
def test_maxvio_and_load_factor_equal_direct_computation_on_random_counts(seed):
    g = torch.Generator().manual_seed(seed)
    loads = torch.randint(0, 1000, (E,), generator=g)
    loads[int(torch.randint(0, E, (1,), generator=g))] += 1  # never all zero
    assert max_violation(loads) == pytest.approx(_direct_maxvio(loads.tolist()), rel=1e-12)
    for ep_size in (1, 2, 4, 8):
        assert ep_load_factor(loads, ep_size) == pytest.approx(_direct_load_factor(loads.tolist(), ep_size), rel=1e-12)
    assert max_violation(torch.zeros(E, dtype=torch.int64)) == 0.0


def _layer(group, balancer="qb_capacity", **overrides):
    if balancer in ("qb_capacity", "qb_both"):
        overrides.setdefault("moe_expert_capacity_factor", 1.25)
    config = moe_config(moe_balancer=balancer, **overrides)
    torch.manual_seed(0)
    layer = MoELayer(config, ProcessGroupCollection(ep=group, expt_dp=None))
    layer.set_layer_number(3)
    return layer


def _run_microbatches(layer, num_microbatches, seed):
    """Training forwards (and one eval forward that must not count); per-forward stats back."""
    g = torch.Generator().manual_seed(seed)
    per_forward = []
    layer.train()
    for _ in range(num_microbatches):
        layer(torch.randn(6, 2, HIDDEN, generator=g))
        r = layer.router
        per_forward.append((r.local_tokens_per_expert.clone(), r.global_tokens_per_expert.clone(),
                            int(r.last_dropped), int(r.last_rerouted)))
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(6, 2, HIDDEN, generator=g))
    return per_forward


def test_step_metrics_sum_the_microbatches_and_reset():
    layer = _layer(None, "qb_capacity", moe_expert_capacity_factor=1.0)
    layer.router.num_bins = 16  # coarse bins: ties in the boundary bin, so pairs get rerouted
    per_forward = _run_microbatches(layer, 3, seed=1)
    metrics = collect_moe_metrics([layer], ep_group=None)
    (m,) = metrics.layers
    global_counts = torch.stack([f[1] for f in per_forward]).sum(0)
    assert m.layer == 3
    assert m.global_tokens_per_expert == global_counts.tolist()
    assert m.local_tokens_per_expert == global_counts.tolist()  # one rank: local == global
    assert m.maxvio == pytest.approx(_direct_maxvio(global_counts.tolist()))
    assert m.dropped == sum(f[2] for f in per_forward)
    assert m.rerouted == sum(f[3] for f in per_forward)
    assert m.rerouted > 0
    assert m.ep_load_factor == 1.0
    # Capacity factor 1: every expert takes at most its share, so MaxVio stays ~0 per microbatch.
    assert m.maxvio <= 0.1
    scalars = metrics.scalars()
    assert scalars["moe/maxvio/layer_3"] == m.maxvio == scalars["moe/maxvio/mean"]
    assert scalars["moe/rerouted"] == m.rerouted
    assert int(layer.router.step_routed_counts.sum()) == 0  # reset for the next step
    assert collect_moe_metrics([layer], ep_group=None).layers[0].maxvio == 0.0


def test_a_step_that_logs_nothing_resets_without_reading():
    """The training loop collects metrics on logged steps only; the steps between call
    reset_moe_step_statistics, so a logged step's metrics are its own microbatches', not the window's."""
    layer = _layer(None)
    _run_microbatches(layer, 3, seed=5)  # a step that logs nothing
    assert int(layer.router.step_routed_counts.sum()) > 0
    reset_moe_step_statistics([layer])
    assert int(layer.router.step_routed_counts.sum()) == 0 and int(layer.router.step_dropped_rerouted.sum()) == 0
    per_forward = _run_microbatches(layer, 2, seed=6)
    got = collect_moe_metrics([layer], ep_group=None).layers[0]
    assert got.local_tokens_per_expert == (per_forward[0][0] + per_forward[1][0]).tolist()


def test_bias_statistics_and_tensorboard_calls():
    layer = _layer(None, "sign_bias")
    bias = torch.randn(E, generator=torch.Generator().manual_seed(5))
    layer.router.expert_bias.copy_(bias)
    _run_microbatches(layer, 2, seed=2)
    metrics = collect_moe_metrics([layer], ep_group=None)
    (m,) = metrics.layers
    assert (m.bias_mean, m.bias_std, m.bias_min, m.bias_max) == pytest.approx(
        (bias.mean().item(), bias.std(unbiased=False).item(), bias.min().item(), bias.max().item()), rel=1e-6)
    assert metrics.scalars()["moe/bias_std/layer_3"] == pytest.approx(m.bias_std)

    calls = []

    class Recorder:  # the MetricsLogger methods log_tensorboard uses
        def add_scalar(self, tag, value, iteration):
            calls.append(("scalar", tag, value, iteration))

        def add_histogram(self, tag, values, iteration):
            calls.append(("hist", tag, values.tolist(), iteration))

        def add_bar_histogram(self, tag, heights, iteration):
            calls.append(("bars", tag, list(heights), iteration))

        def add_image(self, tag, image, iteration):
            calls.append(("image", tag, image, iteration))

    metrics.log_tensorboard(Recorder(), 7, rank=5)  # a logged step without images: this rank's run only
    assert calls == [("scalar", "moe/ep_rank_load/layer_3", 1.0, 7),  # EP1: the rank is the whole group
                     ("hist", "moe/tokens_per_expert/rank_5/layer_3", m.received_tokens_per_expert, 7),
                     ("scalar", "moe/ep_rank_load/mean", 1.0, 7)]
    calls.clear()
    metrics.log_tensorboard(Recorder(), 8, rank=5, global_logger=Recorder())
    assert calls[3] == ("bars", "moe/expert_load/layer_3", m.global_tokens_per_expert, 8)
    kind, tag, image, iteration = calls[4]
    assert (kind, tag, iteration) == ("image", "moe/load_heatmap", 8)
    assert image.shape == (560, 1000, 3) and image.dtype == np.uint8 and image.std() > 20  # a figure, not blank
    assert metrics.expert_load_record() == {"moe/tokens_per_expert": {"3": m.global_tokens_per_expert}}
    assert metrics.load_matrix().tolist() == [[c / (sum(m.global_tokens_per_expert) / E)
                                               for c in m.global_tokens_per_expert]]


def _ep2_worker(rank, world):
    group = dist.new_group(list(range(world)))
    layer = _layer(group, "qb_capacity")
    per_forward = _run_microbatches(layer, 2, seed=10 + rank)  # each rank routes its own tokens
    metrics = collect_moe_metrics([layer], ep_group=group, dp_group=group)
    local = torch.stack([f[0] for f in per_forward]).sum(0)
    return metrics, local, torch.stack([f[1] for f in per_forward]).sum(0)


@pytest.mark.slow
def test_ep2_global_metrics_agree_on_both_ranks_and_equal_direct_computation():
    results = run_distributed(_ep2_worker, 2)
    (m0,), (m1,) = results[0][0].layers, results[1][0].layers
    global_counts = results[0][1] + results[1][1]
    assert torch.equal(results[0][2], global_counts)  # the layer's per-forward global counts
    for m, (_, local, _) in zip((m0, m1), results):
        assert m.global_tokens_per_expert == global_counts.tolist()
        assert m.local_tokens_per_expert == local.tolist()
        assert m.maxvio == pytest.approx(_direct_maxvio(global_counts.tolist()))
        assert m.ep_load_factor == pytest.approx(_direct_load_factor(global_counts.tolist(), 2))
    assert (m0.dropped, m0.rerouted) == (m1.dropped, m1.rerouted)
    assert m0.received_tokens_per_expert == global_counts[:E // 2].tolist()
    assert m1.received_tokens_per_expert == global_counts[E // 2:].tolist()
    received = [sum(m0.received_tokens_per_expert), sum(m1.received_tokens_per_expert)]
    assert (m0.ep_rank_load, m1.ep_rank_load) == pytest.approx([r / (sum(received) / 2) for r in received])
    assert m0.ep_most_loaded_rank == m1.ep_most_loaded_rank == received.index(max(received))
    assert results[0][0].scalars() == results[1][0].scalars()
    assert results[0][0].scalars()["moe/ep_size"] == 2
