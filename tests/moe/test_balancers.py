"""The balancer strategies (``megatron_ext.moe.balancers``) and the capacity routing's one-time choice of rounds
(``quantile_capacity.CapacityRouting``): the factory's map from ``moe_balancer``, its errors, the router's buffers
and state_dict keys (checkpoints and the converters depend on them), and where the Torch / Triton rounds and the
CUDA-graph replay are decided. The Torch and Triton rounds' equality through the same entry runs under the Triton
interpreter in tests/kernels/test_moe_routing.py."""

import pytest
import torch

from megatron_ext.errors import ConfigError
from megatron_ext.moe.balancers import (
    BALANCERS, AuxLoss, Capacity, DualBias, SignBias, TopK, build_balancer,
)
from megatron_ext.moe.quantile_capacity import CapacityRouting, capacity_routing
from megatron_ext.moe.quantile_rounds import KernelRounds, TorchRounds
from megatron_ext.moe.router import TopKRouter
from tests.moe.test_moe_router import moe_config

# (routing, bias, loss) classes of each moe_balancer value
EXPECTED_PARTS = {
    "none": (TopK, None, None),
    "aux_loss": (TopK, None, AuxLoss),
    "sign_bias": (TopK, SignBias, None),
    "qb_capacity": (Capacity, None, None),
    "qb_bias": (TopK, DualBias, None),
    "qb_both": (Capacity, DualBias, None),
}

# Taken from main before the balancers became strategy objects (commit d12b845): router state_dict keys and every
# registered buffer (name, dtype, shape) at E = 8, moe_qb_num_bins = 1000.
STATE_DICT_KEYS = {
    "none": ["weight"], "aux_loss": ["weight"], "qb_capacity": ["weight"],
    "sign_bias": ["weight", "expert_bias"], "qb_bias": ["weight", "expert_bias"], "qb_both": ["weight", "expert_bias"],
}
_STEP = [("step_routed_counts", torch.int64, (8,)), ("step_dropped_rerouted", torch.int64, (2,))]
_BIAS = [("expert_bias", torch.float32, (8,)), ("step_tokens_per_expert", torch.float32, (8,))]
_HISTOGRAM = [("step_residual_histogram", torch.int64, (8, 1000))]
BUFFERS = {
    "none": _STEP, "aux_loss": _STEP, "qb_capacity": _STEP,
    "sign_bias": _BIAS + _STEP, "qb_bias": _BIAS + _HISTOGRAM + _STEP, "qb_both": _BIAS + _HISTOGRAM + _STEP,
}


def _config(balancer, **overrides):
    settings = dict(moe_balancer=balancer)
    if balancer == "aux_loss":
        settings["moe_aux_loss_coeff"] = 1e-2
    if balancer in ("qb_capacity", "qb_both"):
        settings["moe_expert_capacity_factor"] = 1.0
    settings.update(overrides)
    return moe_config(**settings)


def test_every_balancer_value_has_its_parts():
    assert set(BALANCERS) == set(EXPECTED_PARTS)
    from megatron_ext.config import MOE_BALANCERS

    assert MOE_BALANCERS == BALANCERS  # the config validates against the factory's list
    for name, (routing, bias, loss) in EXPECTED_PARTS.items():
        balancer = build_balancer(_config(name))
        assert balancer.name == name
        assert type(balancer.routing) is routing, name
        assert (None if balancer.bias is None else type(balancer.bias)) is bias, name
        assert (None if balancer.loss is None else type(balancer.loss)) is loss, name


@pytest.mark.parametrize("overrides, match", [
    (dict(moe_balancer="bogus"), r"^moe_balancer='bogus'; allowed: none, aux_loss, sign_bias, qb_capacity, qb_bias, "
                                 r"qb_both$"),
    (dict(moe_balancer="qb_both", moe_qb_rounds_impl="cuda"), r"^moe_qb_rounds_impl='cuda'; allowed: auto, torch, "
                                                              r"triton$"),
])
def test_unknown_values_raise_a_config_error_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_balancer(_config(overrides.pop("moe_balancer"), **overrides))


@pytest.mark.parametrize("overrides, match", [
    (dict(moe_balancer="bogus"), r"^moe_balancer='bogus'; allowed: none, aux_loss"),
    (dict(moe_qb_rounds_impl="cuda"), r"^moe_qb_rounds_impl='cuda'; allowed: auto, torch, triton$"),
    # at start, not when the first layer is built (launch/train.py checks the config before any process group)
    (dict(moe_balancer="qb_both", moe_expert_capacity_factor=None),
     r"^moe_expert_capacity_factor must be > 0 when moe_balancer='qb_both', got None"),
    (dict(moe_balancer="qb_bias", moe_expert_capacity_factor=1.25),
     r"^moe_expert_capacity_factor is only used by moe_balancer in"),
])
def test_hybrid_config_names_the_key(overrides, match):
    from tests.parallel.harness import tiny_config

    with pytest.raises(ConfigError, match=match):
        tiny_config({}, True, **overrides)


@pytest.mark.parametrize("balancer", list(EXPECTED_PARTS))
def test_router_state_dict_keys_and_buffers_are_those_of_main(balancer):
    router = TopKRouter(_config(balancer), seed=0)
    assert list(router.state_dict()) == STATE_DICT_KEYS[balancer]
    assert [(n, t.dtype, tuple(t.shape)) for n, t in router.named_buffers()] == BUFFERS[balancer]
    for name in ("expert_bias", "step_tokens_per_expert", "step_residual_histogram"):  # absent ones read as None
        assert (getattr(router, name) is None) == (name not in [n for n, *_ in BUFFERS[balancer]])
    router.bfloat16()  # module-wide casts leave the bias and its loads fp32
    if router.expert_bias is not None:
        assert router.expert_bias.dtype == router.step_tokens_per_expert.dtype == torch.float32


def test_rounds_and_graphs_are_decided_for_the_device_once():
    """"auto": Triton rounds on one CUDA rank, PyTorch elsewhere; "torch"/"triton" force the kind; CUDA graphs only
    on CUDA. (Placing for CUDA touches no GPU: nothing runs.)"""
    cases = [("auto", "cpu", TorchRounds), ("auto", "cuda", KernelRounds), ("torch", "cuda", TorchRounds),
             ("triton", "cpu", KernelRounds), ("triton", "cuda", KernelRounds), ("torch", "cpu", TorchRounds)]
    for rounds, device, kind in cases:
        assert CapacityRouting(2, 1.0, rounds=rounds, device=device).rounds_kind is kind, (rounds, device)
    graphed = CapacityRouting(2, 1.0, host_reads=False, cuda_graph=True, device="cpu")
    assert graphed.graphs is None  # off CUDA: eager, the same routing
    graphed.place("cuda")
    graphs = graphed.graphs
    assert graphs is not None and graphed.rounds_kind is KernelRounds
    graphed.place("cuda:1")  # the same kind of device: nothing changes, captured graphs are kept
    assert graphed.graphs is graphs
    with pytest.raises(ValueError, match="placed for cuda scores, got cpu"):
        graphed(torch.rand(4, 8))
    with pytest.raises(ValueError, match="moe_qb_cuda_graph=True needs moe_qb_host_reads=False"):
        CapacityRouting(2, 1.0, cuda_graph=True, host_reads=True)
    with pytest.raises(ValueError, match="rounds must be one of"):
        CapacityRouting(2, 1.0, rounds="cuda")


def test_the_router_places_its_capacity_routing_when_it_moves():
    """The router decides the rounds from its weight's device at construction and again in ``_apply`` (a model
    built on the CPU and moved to the GPU takes the Triton rounds there, as the per-call check did before)."""
    router = TopKRouter(_config("qb_both", moe_qb_host_reads=False), seed=0)
    capacity = router.balancer.routing.capacity
    assert capacity.device_type == "cpu" and capacity.rounds_kind is TorchRounds
    capacity.place("cuda")  # as if built on a GPU
    router.float()  # _apply: placed again for the weight's device
    assert capacity.device_type == "cpu" and capacity.rounds_kind is TorchRounds


def test_the_router_routes_through_its_capacity_routing_as_the_function_does():
    """The router's capacity routing (settings fixed at construction) gives what ``capacity_routing`` gives for
    the same settings, with the bias; eval routes by plain top-k."""
    router = TopKRouter(_config("qb_both", moe_qb_num_bins=64, moe_expert_capacity_factor=0.8), seed=0).train()
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(8) * 0.1)
        router.weight[2] += 1.0
    x = torch.randn(64, 16)
    scores = router.scores(x)
    expected = capacity_routing(scores, 2, 0.8, bias=router.expert_bias, num_bins=64)
    got, _ = router(x)
    for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert not got.plain and got.dropped + got.rerouted > 0
    router.eval()
    assert torch.equal(router(x)[0].experts, (scores + router.expert_bias).topk(2, dim=1).indices)


def test_rounds_impl_is_a_user_key_and_not_structural():
    """``--moe-qb-rounds-impl`` reaches launch/train.py; a checkpoint resumes under either kind of rounds."""
    from megatron_ext.config import USER_FIELDS
    from megatron_ext.training.checkpoint_compat import STRUCTURAL_MODEL_KEYS

    assert "moe_qb_rounds_impl" in USER_FIELDS and "moe_qb_rounds_impl" not in STRUCTURAL_MODEL_KEYS
