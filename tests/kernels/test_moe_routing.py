"""Capacity routing rounds: Triton kernels vs the PyTorch reference (naive.py, a per-expert sort) and vs
``CapacityRouting``'s PyTorch rounds without host reads (histogram admission). All three must agree
to the bit: experts, dropped, rerouted, per-expert load. CPU: Triton interpreter in a subprocess; GPU: the
benchmark's shapes."""

import pytest
import torch

from kimi_kernels.moe_routing import capacity_rounds, capacity_rounds_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


def make_scores(num_tokens, num_experts, skew, seed, device="cpu", bias=True):
    """Sigmoid scores with per-expert offsets (``skew``: some experts over-subscribed) and a small bias."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g) + torch.linspace(-skew, skew, num_experts)
    expert_bias = 0.1 * torch.randn(num_experts, generator=g) if bias else None
    return logits.sigmoid().to(device), None if expert_bias is None else expert_bias.to(device)


def torch_rounds(scores, k, capacity_factor, bias, num_bins, rounds):
    from megatron_ext.moe.quantile_capacity import CapacityRouting

    routing = CapacityRouting(k, capacity_factor, num_bins=num_bins, device_rounds=rounds - 1, host_reads=False,
                              rounds="torch", device=scores.device)
    result = routing(scores, bias)
    return result.experts, result.dropped, result.rerouted, result.global_load


def assert_same_routing(got, expected):
    for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert (got.rounds, got.plain, got.num_kept) == (expected.rounds, expected.plain, expected.num_kept)


def assert_same(got, expected):
    for name, a, b in zip(("experts", "dropped", "rerouted", "load"), got, expected):
        assert a.dtype == b.dtype == torch.int64, (name, a.dtype, b.dtype)
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs:\n{a}\n{b}"


@interpreter_case
@pytest.mark.parametrize("num_tokens,num_experts,k,capacity_factor,num_bins,rounds", [
    (300, 16, 4, 1.0, 64, 3),     # token count off the program tile, typical overflow
    (257, 12, 3, 0.8, 5, 2),      # E not a power of two; 5 bins: crowded boundary bins resolved in token order
    (100, 8, 2, 1.3, 1000, 1),    # round 1 alone (plain top-k admission)
    (64, 16, 8, 0.5, 16, 4),      # tight capacity: pairs dropped, four rounds
])
def test_kernels_equal_the_reference_and_the_pytorch_rounds(num_tokens, num_experts, k, capacity_factor, num_bins,
                                                            rounds):
    from megatron_ext.moe.quantile_capacity import expert_capacity

    scores, bias = make_scores(num_tokens, num_experts, 2.0, seed=num_tokens)
    capacity = expert_capacity(num_tokens, k, num_experts, capacity_factor)
    got = capacity_rounds(scores, k, capacity, bias, num_bins, (0.0, 1.0), rounds)
    assert_same(got, capacity_rounds_reference(scores, k, capacity, bias, num_bins, (0.0, 1.0), rounds))
    assert_same(got, torch_rounds(scores, k, capacity_factor, bias, num_bins, rounds))
    assert (got[3] <= capacity).all() and (got[3] == capacity).any()  # the capacity binds in every case


@interpreter_case
def test_admission_carries_its_place_across_token_blocks(monkeypatch):
    """Boundary-bin proposals of one expert spread over several admission blocks (ADMIT_TOKENS cut to 32):
    the count carried between blocks decides who gets the last slots. Two bins, so most proposals share the
    boundary bin; no bias."""
    from kimi_kernels.moe_routing import fused

    monkeypatch.setattr(fused, "ADMIT_TOKENS", 32)
    scores, _ = make_scores(150, 8, 1.0, seed=3, bias=False)
    got = capacity_rounds(scores, 2, 30, None, 2, (0.0, 1.0), 3)
    assert_same(got, capacity_rounds_reference(scores, 2, 30, None, 2, (0.0, 1.0), 3))
    assert (got[3] == 30).sum() >= 4  # several experts filled exactly, through their boundary bins


@interpreter_case
def test_saturated_scores_and_scores_outside_the_range_fill_the_edge_bins():
    """Scores of exactly 1, and some past the histogram range on both sides, land in the edge bins; equal
    biased scores break toward the lower expert id; a zero capacity drops everything."""
    scores, _ = make_scores(90, 8, 0.0, seed=5, bias=False)
    scores[::3] = 1.0
    scores[1::7, :3] = torch.tensor([1.5, -0.25, 2.0])
    for capacity in (20, 0):
        got = capacity_rounds(scores, 3, capacity, None, 10, (0.0, 1.0), 3)
        assert_same(got, capacity_rounds_reference(scores, 3, capacity, None, 10, (0.0, 1.0), 3))
    assert got[1] == 90 * 3 and (got[0] == -1).all()


@interpreter_case
@pytest.mark.parametrize("host_reads,max_rounds,device_rounds", [
    (True, None, 2),   # the default: reads after round 1 and after the device rounds, then one per round
    (True, None, 0),   # every overflow round behind its own read
    (True, 1, 2),      # round 1 only
    (True, 3, 1),      # capped by max_rounds
    (False, None, 2),  # no reads, stopped after three rounds
    (False, 1, 2),
    (False, None, None),  # no reads, every round that can matter (what one CUDA rank runs by default)
])
@pytest.mark.parametrize("capacity_factor", [0.7, 1.0, 4.0])  # 4.0: nobody over-subscribed, plain top-k
def test_capacity_routing_on_the_kernels_equals_the_pytorch_rounds(host_reads, max_rounds, device_rounds,
                                                                   capacity_factor):
    """The protocol of rounds and host reads on the Triton rounds: the same routing, round count, plain flag and
    kept-pair count as on the PyTorch rounds (gates too: they come from the same experts), through the same
    entry (``capacity_routing(..., rounds=...)``)."""
    from megatron_ext.moe.quantile import capacity_routing
    from megatron_ext.moe.quantile_capacity import rounds_that_can_matter

    scores, bias = make_scores(200, 16, 2.0, seed=7)
    settings = dict(bias=bias, num_bins=50, max_rounds=max_rounds, device_rounds=device_rounds,
                    host_reads=host_reads)
    expected = capacity_routing(scores, 4, capacity_factor, **settings)  # CPU scores, "auto": the PyTorch rounds
    assert_same_routing(capacity_routing(scores, 4, capacity_factor, rounds="torch", **settings), expected)
    got = capacity_routing(scores, 4, capacity_factor, rounds="triton", **settings)
    for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert (got.rounds, got.plain, got.num_kept) == (expected.rounds, expected.plain, expected.num_kept)
    assert expected.plain == (capacity_factor == 4.0 and host_reads)
    if host_reads and max_rounds is None and device_rounds == 0 and capacity_factor < 4.0:
        assert expected.rounds > 1  # overflow rounds ran, each behind its own read
    if not host_reads and device_rounds is None:  # lossless: the reading routing, most rounds skipped
        reading = capacity_routing(scores, 4, capacity_factor, rounds="triton", bias=bias, num_bins=50)
        for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
            assert torch.equal(getattr(got, name), getattr(reading, name)), name
        assert got.rounds == 1 + rounds_that_can_matter(200, 4, 16, capacity_factor) > reading.rounds


@interpreter_case
def test_a_round_after_one_that_refused_nothing_skips_on_the_device():
    """Once a round refuses nothing nobody can move: the next round's kernels return at once (they write no
    proposal and no flag), which is what makes queuing every possible round cheap. Before that, a round after a
    refusal runs."""
    from kimi_kernels.moe_routing import kernel_rounds
    from megatron_ext.moe.quantile_capacity import expert_capacity

    scores, bias = make_scores(120, 8, 2.0, seed=3)
    rounds = kernel_rounds(scores, 2, expert_capacity(120, 2, 8, 1.0), bias, 32, (0.0, 1.0), max_steps=10)
    steps = 0
    while True:
        rounds.step()
        steps += 1
        if rounds.flags[steps - 1, 1] == 0:  # this round refused nothing
            break
    assert steps > 2  # overflow rounds did work before it
    held = rounds.held.clone()
    rounds.proposals.fill_(7)
    rounds.step()
    assert (rounds.proposals == 7).all() and torch.equal(rounds.held, held)  # skipped: nothing written
    assert rounds.flags[steps].tolist() == [0, 0] and (rounds.hist == 0).all()


@interpreter_case
@pytest.mark.parametrize("first_steps,max_steps", [(1, 12), (3, 12), (1, 4)])
def test_rounds_in_one_launch_equal_one_launch_each(first_steps, max_steps):
    """``step_many`` (every round in one launch, the programs in step through a grid-wide sync) leaves the state
    one launch per round leaves, bit for bit: held experts, room, every round's flags, admitted pairs and the
    result; rounds after the last useful one write nothing. Under the interpreter the launch has one program (the
    GPU tests run it at one per SM through capacity_routing). More rounds than max_steps are refused."""
    from kimi_kernels.moe_routing import kernel_rounds
    from megatron_ext.moe.quantile_capacity import expert_capacity

    scores, bias = make_scores(300, 16, 2.0, seed=5)
    engines = [kernel_rounds(scores, 4, expert_capacity(300, 4, 16, 0.9), bias, 64, (0.0, 1.0), max_steps)
               for _ in range(2)]
    each, together = engines
    for _ in range(max_steps):
        each.step()
    for _ in range(first_steps):
        together.step()
    together.step_many(max_steps - first_steps)
    for name in ("held", "room", "_flags", "admitted", "hist"):
        assert torch.equal(getattr(each, name), getattr(together, name)), name
    assert_same(together.result(), each.result())
    useful = int(each.flags[:, 0].sum())
    assert 2 < useful < max_steps if max_steps > 4 else useful == max_steps  # rounds skipped / all of them ran
    with pytest.raises(RuntimeError, match="max_steps"):
        together.step_many(1)


@interpreter_case
def test_an_expert_over_by_one_pair_is_not_plain_top_k():
    """8 tokens, top-1, 4 experts: capacity 2 and three tokens prefer expert 0. The first read must see its
    single refusal (a plain result would put 3 pairs on expert 0) and the next round moves that token."""
    from megatron_ext.moe.quantile import capacity_routing

    favourite = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    scores = (torch.rand(8, 4, generator=torch.Generator().manual_seed(1)) * 0.5).scatter_(1, favourite[:, None], 0.9)
    got = capacity_routing(scores, 1, 1.0, num_bins=16, rounds="triton")
    assert not got.plain and got.rounds == 2 and got.rerouted == 1 and got.dropped == 0
    assert torch.bincount(got.experts[:, 0], minlength=4).tolist() == [2, 2, 2, 2]


@interpreter_case
@pytest.mark.parametrize("host_reads", [True, False])
def test_router_on_triton_and_torch_rounds_routes_the_same(host_reads):
    """``moe_qb_rounds_impl`` triton vs torch through the router (qb_both, CPU fp32 under the interpreter): the
    same routing, statistics and dual-bias updates over a few steps."""
    from megatron_ext.moe.quantile_rounds import KernelRounds, TorchRounds
    from megatron_ext.moe.router import TopKRouter, update_expert_biases
    from tests.moe.test_moe_router import moe_config

    routers = {}
    for impl, kind in (("torch", TorchRounds), ("triton", KernelRounds)):
        config = moe_config(moe_balancer="qb_both", moe_expert_capacity_factor=0.8, moe_qb_num_bins=32,
                            moe_qb_host_reads=host_reads, moe_qb_rounds_impl=impl)
        routers[impl] = router = TopKRouter(config, seed=5).train()
        assert router.balancer.routing.capacity.rounds_kind is kind
        with torch.no_grad():
            router.weight[1] += 1.0
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(96, 16, generator=generator)
        got, expected = routers["triton"](x)[0], routers["torch"](x)[0]
        for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
        assert (got.rounds, got.plain, got.num_kept) == (expected.rounds, expected.plain, expected.num_kept)
        for router in routers.values():
            update_expert_biases([router], None)
        assert torch.equal(routers["triton"].expert_bias, routers["torch"].expert_bias)
        assert torch.equal(routers["triton"].step_dropped_rerouted, routers["torch"].step_dropped_rerouted)
    assert routers["torch"].step_dropped_rerouted.sum() > 0  # the capacity bound


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="scores must be fp32"):
        capacity_rounds(torch.rand(4, 8, dtype=torch.float64), 2, 3)
    with pytest.raises(ValueError, match="rounds >= 1"):
        capacity_rounds(torch.rand(4, 8), 2, 3, rounds=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [64, 256])
def test_capacity_routing_with_reads_on_the_kernels_equals_the_pytorch_rounds_on_gpu(num_experts):
    """The default eager call (host reads, rounds until nothing moves) on the Triton rounds (what "auto" picks on
    one CUDA rank) against the PyTorch rounds, at the benchmark's shapes."""
    from megatron_ext.moe.quantile import capacity_routing
    from megatron_ext.moe.quantile_capacity import CapacityRouting, rounds_that_can_matter
    from megatron_ext.moe.quantile_rounds import KernelRounds

    assert CapacityRouting(8, 1.0, device="cuda").rounds_kind is KernelRounds
    scores, bias = make_scores(16384, num_experts, 2.0, seed=num_experts, device="cuda")
    expected = capacity_routing(scores, 8, 1.0, bias=bias, rounds="torch", host_reads=True)
    got = capacity_routing(scores, 8, 1.0, bias=bias, host_reads=True)
    for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert (got.rounds, got.plain, got.num_kept) == (expected.rounds, expected.plain, expected.num_kept)
    assert not expected.plain and expected.rerouted > 0  # overflow rounds ran
    # One CUDA rank's default: no reads, every round that can matter (all but the useful ones skipped on the
    # device), replayed from a CUDA graph: the same routing, no host sync after the capture.
    graphed = CapacityRouting(8, 1.0, device="cuda")
    assert not graphed.reads and graphed.graphs is not None
    graphed(scores, bias)  # captures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lossless = graphed(scores, bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("experts", "gates", "dropped", "rerouted", "global_load"):
        assert torch.equal(getattr(lossless, name), getattr(expected, name)), name
    assert lossless.rounds == 1 + rounds_that_can_matter(16384, 8, num_experts, 1.0)  # E at factor 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [64, 256])
def test_kernels_equal_the_pytorch_rounds_on_gpu(num_experts):
    """The end-to-end benchmark's routing shape (16384 tokens, top-8, 1000 bins, capacity factor 1.0, three
    rounds) and a 256-expert one: bit-equal to the PyTorch rounds on the GPU."""
    from megatron_ext.moe.quantile_capacity import expert_capacity

    scores, bias = make_scores(16384, num_experts, 2.0, seed=num_experts, device="cuda")
    capacity = expert_capacity(16384, 8, num_experts, 1.0)
    got = capacity_rounds(scores, 8, capacity, bias, 1000, (0.0, 1.0), 3)
    assert_same(got, torch_rounds(scores, 8, 1.0, bias, 1000, 3))
    assert got[2] > 0 and got[3].max() == capacity  # overflow was routed


@pytest.mark.gpu
def test_a_one_launch_grid_too_large_to_be_resident_is_refused_not_hung():
    """The one-launch rounds sync across their grid, so every program must be resident at once. Launched as a
    cooperative grid, a grid larger than the GPU holds (here 4096 token tiles, forced past the one-per-SM cap) is
    refused by the driver instead of waiting forever in the first sync. A child process: a hang fails the test at
    its timeout instead of stalling the suite."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    child = textwrap.dedent("""
        import torch
        from kimi_kernels.moe_routing import fused, kernel_rounds
        fused._resident_programs = lambda device: 1 << 30  # as if every token tile could be resident
        scores = torch.rand(65536, 64, device="cuda")
        rounds = kernel_rounds(scores, 8, 7000, None, 1000, (0.0, 1.0), 4)
        rounds.step()
        rounds.step_many(3)
        torch.cuda.synchronize()
    """)
    root = Path(__file__).resolve().parents[2]
    ran = subprocess.run([sys.executable, "-c", child], cwd=root, capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0 and "cooperative" in ran.stderr.lower(), ran.stderr[-2000:]
