import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.moe import quantile_capacity, quantile_rounds
from megatron_ext.moe.quantile import (capacity_routing, expert_capacity, gates_from_scores, histogram_bins,
                                       histogram_counts, topk_routing)


def skewed_scores(n, e, seed=0, skew=2.0):
    """Sigmoid scores with strong per-expert offsets, so a few experts are over-subscribed."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.linspace(-skew, skew, e)[torch.randperm(e, generator=g)]
    return (torch.randn(n, e, generator=g) + offsets).sigmoid()


def loads(experts, e):
    return torch.bincount(experts[experts >= 0], minlength=e)


def reference_capacity_routing(scores, k, capacity, num_bins, bias=None):
    """Loop-by-loop statement of the rules: each round a token proposes to its best experts that
    have room and it does not hold, one per free slot; an expert takes its best proposals by
    score bin, ties in token order, up to its room."""
    n, e = scores.shape
    biased = scores if bias is None else scores + bias
    bins = histogram_bins(scores, 0.0, 1.0, num_bins)
    held = [[] for _ in range(n)]
    room = [capacity] * e
    while True:
        proposals = {j: [] for j in range(e)}
        for i in range(n):
            free = k - len(held[i])
            order = sorted(range(e), key=lambda j: -biased[i, j].item())
            options = [j for j in order if room[j] > 0 and j not in held[i]][:free]
            for j in options:
                proposals[j].append(i)
        if not any(proposals.values()):
            break
        for j, tokens in proposals.items():
            tokens.sort(key=lambda i: (-bins[i, j].item(), i))
            for i in tokens[: room[j]]:
                held[i].append(j)
            room[j] -= min(room[j], len(tokens))
    return held


@pytest.mark.parametrize("capacity_factor", [0.6, 1.0, 1.3])
def test_capacity_routing_matches_the_loop_reference(capacity_factor):
    n, e, k = 48, 8, 3
    scores = skewed_scores(n, e, seed=3)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(4)) * 0.2
    num_bins = 16  # coarse on purpose: many ties inside boundary bins
    routing = capacity_routing(scores, k, capacity_factor, bias=bias, num_bins=num_bins)
    held = reference_capacity_routing(scores, k, expert_capacity(n, k, e, capacity_factor), num_bins, bias)
    for i in range(n):
        got = sorted(j for j in routing.experts[i].tolist() if j >= 0)
        assert got == sorted(held[i]), f"token {i}"
    assert routing.dropped.item() == sum(k - len(h) for h in held)


@pytest.mark.parametrize("capacity_factor", [0.5, 0.8, 1.0, 1.25, 2.0])
@pytest.mark.parametrize("num_bins", [4, 1000])
def test_capacity_is_a_hard_cap_and_nobody_loses_an_expert_that_has_room(capacity_factor, num_bins):
    n, e, k = 300, 16, 4
    scores = skewed_scores(n, e, seed=1)
    routing = capacity_routing(scores, k, capacity_factor, num_bins=num_bins)
    capacity = expert_capacity(n, k, e, capacity_factor)
    load = loads(routing.experts, e)
    assert load.max().item() <= capacity
    assert torch.equal(routing.global_load, load)
    # A token short of k experts: every expert it does not hold is full.
    for i in torch.nonzero((routing.experts < 0).any(dim=1)).flatten().tolist():
        held = set(routing.experts[i][routing.experts[i] >= 0].tolist())
        assert all(load[j].item() == capacity for j in range(e) if j not in held), f"token {i}"
    # No token holds an expert twice.
    kept = routing.experts.clamp(min=-1)
    for row in kept.tolist():
        ids = [j for j in row if j >= 0]
        assert len(ids) == len(set(ids))


def test_dropped_count_is_exact_when_over_full():
    n, e, k, cf = 256, 16, 4, 0.75
    routing = capacity_routing(skewed_scores(n, e, seed=2), k, cf)
    capacity = expert_capacity(n, k, e, cf)
    # Total demand exceeds total capacity and overflow can go anywhere: every expert fills up.
    assert loads(routing.experts, e).tolist() == [capacity] * e
    assert routing.dropped.item() == n * k - e * capacity == int((routing.experts < 0).sum())


def test_every_token_keeps_k_experts_when_capacity_leaves_room():
    n, e, k, cf = 300, 16, 4, 1.5  # (e - k + 1) * capacity > n * k: no drop is possible
    scores = skewed_scores(n, e, seed=5)
    routing = capacity_routing(scores, k, cf)
    assert routing.dropped.item() == 0 and bool((routing.experts >= 0).all())
    top_k = topk_routing(scores, k).experts
    outside = ~(routing.experts.unsqueeze(2) == top_k.unsqueeze(1)).any(dim=2)
    assert routing.rerouted.item() == int(outside.sum()) > 0  # skew forces overflow
    assert loads(routing.experts, e).max().item() <= expert_capacity(n, k, e, cf)


def test_gates_are_unbiased_scores_renormalised_over_kept_experts():
    n, e, k = 200, 16, 4
    scores = skewed_scores(n, e, seed=6)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(7))
    routing = capacity_routing(scores, k, 0.8, bias=bias)
    kept = routing.experts >= 0
    raw = scores.gather(1, routing.experts.clamp(min=0)) * kept
    some = kept.any(dim=1)
    torch.testing.assert_close(routing.gates[some], raw[some] / raw[some].sum(1, keepdim=True))
    torch.testing.assert_close(routing.gates.sum(1)[some], torch.ones(int(some.sum())))
    assert bool((routing.gates[~kept] == 0).all())
    plain = capacity_routing(scores, k, 0.8, bias=bias, renormalize=False)
    assert torch.equal(plain.experts, routing.experts)
    torch.testing.assert_close(plain.gates, raw)


def test_ample_capacity_is_plain_topk():
    scores = skewed_scores(128, 16, seed=8)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(9)) * 0.1
    routing = capacity_routing(scores, 4, 16.0, bias=bias)
    plain = topk_routing(scores, 4, bias)
    assert torch.equal(routing.experts, plain.experts)
    torch.testing.assert_close(routing.gates, plain.gates)
    assert routing.dropped.item() == 0 and routing.rerouted.item() == 0


def test_one_round_is_capped_top_k_without_overflow():
    n, e, k, cf = 200, 16, 4, 1.0
    scores = skewed_scores(n, e, seed=10)
    routing = capacity_routing(scores, k, cf, max_rounds=1)
    demand = loads(topk_routing(scores, k).experts, e)
    capacity = expert_capacity(n, k, e, cf)
    assert routing.rerouted.item() == 0
    assert routing.dropped.item() == int((demand - capacity).clamp(min=0).sum()) > 0
    assert torch.equal(loads(routing.experts, e), demand.clamp(max=capacity))


class _HostReads(TorchDispatchMode):
    """Counts ops that read a CUDA tensor back to the host (on any device), and tolist calls."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "_unique2",
               "repeat_interleave"}

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = []
        self.depth = 0
        tolist = torch.Tensor.tolist

        def counted(tensor):
            # count the outermost call only: an active TorchFunctionMode (cpu_compat's, once any test in the
            # process installed it) dispatches the patched method again from inside the original
            if self.depth == 0:
                self.reads.append("tolist")
            self.depth += 1
            try:
                return tolist(tensor)
            finally:
                self.depth -= 1

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        if name in self.SYNCING or boolean_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_host_reads_one_without_overflow_two_with_until_the_device_rounds_run_out(monkeypatch):
    """The GPU cost model (docs/quantile_balancing.md): one host read when nothing is over-subscribed;
    else a second after round 1's admission and DEVICE_ROUNDS overflow rounds, then one per further
    round. No nonzero or boolean indexing (each would be a read too)."""
    n, e, k = 512, 16, 4
    scores = skewed_scores(n, e, seed=13, skew=0.05)
    with _HostReads(monkeypatch) as ample:
        routing = capacity_routing(scores, k, 1.5)
    assert routing.rounds == 1 and routing.plain and ample.reads == ["tolist"]
    seen_rounds = set()
    for seed, skew, cf in [(13, 0.5, 1.25), (13, 2.0, 1.0), (14, 3.0, 0.9)]:
        with _HostReads(monkeypatch) as tight:
            routing = capacity_routing(skewed_scores(n, e, seed=seed, skew=skew), k, cf)
        assert set(tight.reads) == {"tolist"} and not routing.plain
        further = max(0, routing.rounds - 1 - quantile_capacity.DEVICE_ROUNDS)
        # a further round that finds nothing to propose costs its read but does not count
        assert len(tight.reads) - 2 - further in (0, 1), (routing.rounds, tight.reads)
        seen_rounds.add(routing.rounds)
    assert min(seen_rounds) <= 1 + quantile_capacity.DEVICE_ROUNDS < max(seen_rounds), seen_rounds


@pytest.mark.parametrize("device_rounds", [0, 1, 3])
def test_without_host_reads_equals_host_reads_stopped_after_the_same_rounds(monkeypatch, device_rounds):
    """``host_reads=False``: no read at all, exactly ``1 + device_rounds`` rounds, and the result of the
    reading routing capped at that many rounds (a token that could still move is dropped); capacities
    hold either way."""
    n, e, k = 400, 16, 4
    bias = torch.randn(e, generator=torch.Generator().manual_seed(31)) * 0.1
    for seed, skew, cf in [(13, 0.05, 1.5), (21, 2.0, 1.0), (22, 3.0, 0.8)]:
        scores = skewed_scores(n, e, seed=seed, skew=skew)
        with _HostReads(monkeypatch) as host:
            got = capacity_routing(scores, k, cf, bias=bias, num_bins=32, device_rounds=device_rounds,
                                   host_reads=False)
        assert host.reads == []
        expected = capacity_routing(scores, k, cf, bias=bias, num_bins=32, max_rounds=1 + device_rounds)
        assert torch.equal(got.experts, expected.experts) and torch.equal(got.gates, expected.gates)
        assert torch.equal(got.global_load, expected.global_load)
        assert (got.dropped.item(), got.rerouted.item()) == (expected.dropped.item(), expected.rerouted.item())
        assert (got.rounds, got.num_kept, got.plain) == (1 + device_rounds, None, False)
        assert int(got.global_load.max()) <= expert_capacity(n, k, e, cf)
        if expected.plain:  # nothing over capacity: the plain top-k, slot order included
            assert torch.equal(got.experts, (scores + bias).topk(k, dim=1).indices)


def test_without_host_reads_the_default_rounds_give_the_reading_result(monkeypatch):
    """``host_reads=False`` with ``device_rounds`` left at None runs every round that can matter
    (``min(E, N k // C)`` overflow rounds): no read, and bit for bit the routing with reads however many rounds
    that needed, so nothing is dropped that the reads would place; stopping earlier drops what could have moved."""
    n, e, k = 300, 16, 4
    bias = torch.randn(e, generator=torch.Generator().manual_seed(41)) * 0.1
    needed = []
    for seed, skew, cf in [(21, 2.0, 1.0), (22, 3.0, 0.8), (23, 4.0, 1.25), (24, 0.05, 3.0)]:
        scores = skewed_scores(n, e, seed=seed, skew=skew)
        with _HostReads(monkeypatch) as host:
            got = capacity_routing(scores, k, cf, bias=bias, num_bins=32, host_reads=False)
        bound = min(e, n * k // expert_capacity(n, k, e, cf))
        assert host.reads == [] and (got.rounds, got.num_kept) == (1 + bound, None)
        expected = capacity_routing(scores, k, cf, bias=bias, num_bins=32, host_reads=True)
        assert expected.rounds <= 1 + bound
        for name in ("experts", "gates", "global_load", "dropped", "rerouted"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (seed, name)
        needed.append(expected.rounds)
        if expected.rounds > 1 + quantile_capacity.DEVICE_ROUNDS:
            short = capacity_routing(scores, k, cf, bias=bias, num_bins=32, device_rounds=1, host_reads=False)
            assert short.dropped.item() > expected.dropped.item()  # stopping early drops what could have moved
    assert max(needed) > 1 + quantile_capacity.DEVICE_ROUNDS and min(needed) == 1, needed


def test_the_round_bound_is_reached_when_every_round_fills_one_expert(monkeypatch):
    """All tokens rank the experts alike (k = 1): round r fills expert r, so N = 100 tokens at C = 8 need
    ceil(100 / 8) = 13 rounds, exactly round 1 and the bound's 100 // 8 = 12 overflow rounds; one round fewer
    drops the last expert's tokens."""
    n, e, k, cf = 100, 16, 1, 1.25
    order = torch.linspace(1.0, 0.1, e)  # the same expert ranking for every token, distinct scores per token
    scores = order + torch.rand(n, 1, generator=torch.Generator().manual_seed(3)) * 1e-3
    capacity = expert_capacity(n, k, e, cf)
    bound = quantile_capacity.rounds_that_can_matter(n, k, e, cf)
    assert (capacity, bound) == (8, 12)
    with _HostReads(monkeypatch) as host:
        got = capacity_routing(scores, k, cf, num_bins=32, host_reads=False)
    assert host.reads == []
    expected = capacity_routing(scores, k, cf, num_bins=32, host_reads=True)
    assert expected.rounds == 1 + bound == got.rounds
    assert torch.equal(got.experts, expected.experts) and got.dropped.item() == expected.dropped.item() == 0
    short = capacity_routing(scores, k, cf, num_bins=32, device_rounds=bound - 1, host_reads=False)
    assert short.dropped.item() == n - bound * capacity  # the 4 tokens the 13th round would place
    assert quantile_capacity.rounds_that_can_matter(n, k, e, cf, group=object()) == e  # a group's N is unknown


def test_host_reads_and_graphs_are_decided_per_device():
    """Left at None, one CUDA rank on the Triton rounds reads nothing and replays a graph; the CPU, and forced
    PyTorch rounds, read. Explicit settings win; a graph needs no reads. (Placing for CUDA runs nothing.)"""
    from megatron_ext.moe.quantile_capacity import CapacityRouting

    def layout(device, **settings):
        routing = CapacityRouting(2, 1.0, device=device, **settings)
        return routing.reads, routing.graphs is not None

    assert layout("cuda") == (False, True)
    assert layout("cpu") == (True, False)
    assert layout("cuda", rounds="torch") == (True, False)
    assert layout("cuda", host_reads=True) == (True, False)
    assert layout("cuda", cuda_graph=False) == (False, False)  # eager, lossless, no reads
    assert layout("cpu", cuda_graph=True) == (False, False)  # no graph off CUDA; still no reads
    assert layout("cpu", host_reads=False) == (False, False)
    routing = CapacityRouting(2, 1.0, device="cpu")
    routing.place("cuda")  # a model built on the CPU and moved to the GPU decides again
    assert (routing.reads, routing.graphs is not None) == (False, True)


def test_device_capacity_equals_the_host_formula():
    """A group computes the capacity on the device from its all-reduced token count; one rank on the host.
    They must agree to the slot, float noise included (1.1 * 100 * 8 / 64 is 13.750000000000002)."""
    gen = torch.Generator().manual_seed(5)
    factors = [0.3, 0.6, 1.0, 1.1, 1.25, 1.3, 2.0, 0.7, 1.15]
    for _ in range(400):
        n = int(torch.randint(0, 200_000, (1,), generator=gen))
        e = int(torch.randint(1, 257, (1,), generator=gen))
        k = int(torch.randint(1, min(e, 16) + 1, (1,), generator=gen))
        cf = factors[int(torch.randint(0, len(factors), (1,), generator=gen))]
        host = expert_capacity(n, k, e, cf)
        assert quantile_rounds._device_capacity(torch.tensor(n), k, e, cf).item() == host, (n, k, e, cf)
    assert expert_capacity(100, 8, 64, 1.1) == 14


@pytest.mark.parametrize("device_rounds", [0, 1, 5])
def test_result_does_not_depend_on_the_rounds_run_before_the_read(device_rounds):
    n, e, k = 300, 16, 4
    scores = skewed_scores(n, e, seed=21, skew=2.0)
    bias = torch.randn(e, generator=torch.Generator().manual_seed(22)) * 0.1
    expected = capacity_routing(scores, k, 1.0, bias=bias, num_bins=32)
    got = capacity_routing(scores, k, 1.0, bias=bias, num_bins=32, device_rounds=device_rounds)
    assert expected.rounds > 3
    assert torch.equal(got.experts, expected.experts) and torch.equal(got.global_load, expected.global_load)
    assert (got.rounds, got.dropped.item(), got.rerouted.item(), got.num_kept) == \
        (expected.rounds, expected.dropped.item(), expected.rerouted.item(), expected.num_kept)
    assert got.num_kept == int((got.experts >= 0).sum())


def test_only_the_gates_carry_gradients():
    scores = skewed_scores(200, 16, seed=14).requires_grad_()
    routing = capacity_routing(scores, 4, 0.8)
    weights = torch.randn(routing.gates.shape, generator=torch.Generator().manual_seed(15))
    (routing.gates * weights).sum().backward()
    again = scores.detach().clone().requires_grad_()
    (gates_from_scores(again, routing.experts) * weights).sum().backward()
    torch.testing.assert_close(scores.grad, again.grad)


def test_histogram_counts_skips_invalid_entries():
    g = torch.Generator().manual_seed(16)
    rows, bins = torch.randint(0, 5, (300,), generator=g), torch.randint(0, 7, (300,), generator=g)
    valid = torch.rand(300, generator=g) < 0.3
    expected = torch.zeros(5, 7, dtype=torch.int64)
    for r, b in zip(rows[valid].tolist(), bins[valid].tolist()):
        expected[r, b] += 1
    assert torch.equal(histogram_counts(rows, bins, 5, 7, valid), expected)


@pytest.mark.parametrize("bad, match", [
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(num_bins=0), "num_bins"),
    (dict(score_range=(1.0, 0.0)), "score_range"),
    (dict(max_rounds=0), "max_rounds"),
    (dict(device_rounds=-1), "device_rounds"),
    (dict(host_reads=0), "host_reads"),
    (dict(host_reads="no"), "host_reads must be True, False or None"),
])
def test_capacity_routing_rejects_bad_arguments(bad, match):
    kwargs = dict(capacity_factor=1.0) | bad
    with pytest.raises(ValueError, match=match):
        capacity_routing(torch.rand(8, 4), 2, **kwargs)


@pytest.mark.gpu
def test_capacity_routing_on_cuda_equals_cpu():
    scores = skewed_scores(4096, 64, seed=11)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(12)) * 0.1
    cpu = capacity_routing(scores, 8, 1.0, bias=bias)
    gpu = capacity_routing(scores.cuda(), 8, 1.0, bias=bias.cuda())
    assert torch.equal(gpu.experts.cpu(), cpu.experts)
    torch.testing.assert_close(gpu.gates.cpu(), cpu.gates)
    assert gpu.dropped.item() == cpu.dropped.item() and gpu.rerouted.item() == cpu.rerouted.item()
