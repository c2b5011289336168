import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron_ext.moe.dispatcher import AllToAllDispatcher
from megatron_ext.moe.experts import GroupedExperts, ffn
from megatron_ext.moe.layer import MoELayer, moe_layer_spec
from megatron_ext.moe.quantile import Routing
from tests._dist import run_distributed
from tests.moe.test_moe_router import moe_config

SEQ, BATCH, HIDDEN = 6, 2, 16


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)  # the same random inputs whatever ran before


def _reference_moe(x, routing, w1, w2, gated=True):
    """out[n] = sum over kept slots of gate * expert(x[n]), one token at a time (fp64)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for e, g in zip(routing.experts[n].tolist(), routing.gates[n].tolist()):
            if e >= 0:
                out[n] += g * ffn(x[n].double(), w1[e].double(), w2[e].double(), F.silu, gated)
    return out.float()


def _random_routing(num_tokens, num_experts, k, drop_share, seed):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    dropped = torch.rand(num_tokens, k, generator=g) < drop_share
    experts = experts.masked_fill(dropped, -1)
    gates = torch.rand(num_tokens, k, generator=g).masked_fill(dropped, 0.0)
    zero = torch.zeros((), dtype=torch.int64)
    return Routing(experts, gates, dropped.sum(), zero)


def _dispatch_combine(dispatcher, experts, x, routing):
    from megatron_ext.moe.router import expert_counts

    counts = dispatcher.global_counts(expert_counts(routing.experts, dispatcher.num_experts))
    expert_input, tokens_per_expert, state = dispatcher.dispatch(x, routing, counts)
    static = dispatcher.ep_size == 1 and routing.num_kept is None  # one rank, kept-pair count not on the host
    assert expert_input.shape[0] == (routing.experts.numel() if static else int(tokens_per_expert.sum()))
    return dispatcher.combine(experts(expert_input, tokens_per_expert), routing.gates, state)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("num_kept_known", [True, False])
def test_dispatcher_skips_dropped_pairs_single_rank(use_grouped_mm, num_kept_known):
    """Compact buffers (the routing knows its kept-pair count) and static ``[N k]`` ones (it does not:
    no host read) give the reference output and the same gradients; the static buffer's dropped rows
    trail the experts' blocks, and what the experts leave in them never reaches the output."""
    config = moe_config()
    results = []
    for poison in (False, True):
        torch.manual_seed(3)
        experts = GroupedExperts(config, 8, None, None, seed=3, use_grouped_mm=use_grouped_mm)
        x = torch.randn(20, HIDDEN, requires_grad=True)
        routing = _random_routing(20, 8, 2, drop_share=0.3, seed=1)
        routing.experts[0] = -1  # a token with every slot dropped gets zeros
        routing.gates[0] = 0.0
        if num_kept_known:
            routing.num_kept = int((routing.experts >= 0).sum())
        if poison:  # whatever the rows past the experts' blocks hold must not matter
            forward = experts.forward

            def poisoned(tokens, tokens_per_expert):
                out = forward(tokens, tokens_per_expert)
                trailing = torch.arange(out.shape[0]) >= tokens_per_expert.sum()
                return out.masked_fill(trailing[:, None], float("nan"))
            experts.forward = poisoned
        out = _dispatch_combine(AllToAllDispatcher(8, None), experts, x, routing)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad, experts.w1.grad, experts.w2.grad))
        torch.testing.assert_close(out, _reference_moe(x.detach(), routing, experts.w1, experts.w2))
        assert out[0].abs().max() == 0
    for clean, poisoned in zip(*results):
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


def _layers(config, group, world):
    """The one-rank layer and the EP layer, from the same seed (so the same global weights)."""
    torch.manual_seed(0)
    reference = MoELayer(config, ProcessGroupCollection())
    torch.manual_seed(0)
    parallel = MoELayer(config, ProcessGroupCollection(ep=group, expt_dp=None))
    return reference, parallel


def _ep_parity_worker(rank, world, cases, checkpoint_dir):
    group = dist.new_group(list(range(world)))
    for config_overrides, use_grouped_mm in cases:  # one process start (megatron import) for all
        _check_ep_parity(rank, world, group, moe_config(**config_overrides), use_grouped_mm)
    _check_sharded_state_dict_is_global(rank, world, group)
    _check_checkpoint_reshards_ep2_to_ep1(rank, world, group, checkpoint_dir)
    return True


def _check_checkpoint_reshards_ep2_to_ep1(rank, world, group, checkpoint_dir):
    """Save with EP2 through megatron.core.dist_checkpointing, load into EP1 layers (experts
    replicated over an expert-DP group of 2): every rank gets the global weights."""
    from megatron.core import dist_checkpointing
    from megatron_ext import cpu_compat

    cpu_compat.install()  # Megatron's checkpoint writer names CUDA devices
    config = moe_config(moe_balancer="sign_bias", moe_shared_expert_intermediate_size=8)
    metadata = {"dp_cp_group": group}
    torch.manual_seed(0)
    saved = MoELayer(config, ProcessGroupCollection(ep=group))
    with torch.no_grad():  # every tensor differs from a fresh init, and per rank
        for p in saved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
        saved.router.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(9)))
    dist_checkpointing.save(saved.sharded_state_dict(metadata=metadata), checkpoint_dir)

    torch.manual_seed(1)
    loaded = MoELayer(config, ProcessGroupCollection(ep=None, expt_dp=group))
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(metadata=metadata), checkpoint_dir))
    for name in ("w1", "w2"):
        pieces = [torch.empty_like(getattr(saved.experts, name)) for _ in range(world)]
        dist.all_gather(pieces, getattr(saved.experts, name).detach(), group=group)
        assert torch.equal(getattr(loaded.experts, name), torch.cat(pieces)), name
    for name in ("router.weight", "router.expert_bias", "shared_expert.w1", "shared_expert.w2"):
        expected = saved.state_dict()[name].clone()  # replicated tensors: rank 0's copy is written
        dist.broadcast(expected, src=0, group=group)
        assert torch.equal(loaded.state_dict()[name], expected), name


def _check_sharded_state_dict_is_global(rank, world, group):
    """Expert tensors are checkpointed as global [E, ...] tensors, this rank's slice at its EP
    offset, behind any prepended (e.g. layer) axes; so an EP2 checkpoint loads at any EP."""
    config = moe_config(moe_balancer="sign_bias")
    torch.manual_seed(0)
    layer = MoELayer(config, ProcessGroupCollection(ep=group))
    sharded = layer.sharded_state_dict(prefix="layers.", sharded_offsets=((0, 3, 5),),
                                       metadata={"dp_cp_group": group})
    num_local = config.num_moe_experts // world
    for name, param in (("w1", layer.experts.w1), ("w2", layer.experts.w2)):
        tensor = sharded[f"layers.experts.{name}"]
        assert tensor.key == f"layers.experts.{name}" and tensor.data is param
        assert tensor.global_shape == (5, config.num_moe_experts) + tuple(param.shape[1:])
        assert tensor.global_offset == (3, rank * num_local) + (0,) * (param.dim() - 1)
        assert tensor.replica_id == (0, 0, 0)  # no expert-DP replicas: every rank writes its slice
    bias = sharded["layers.router.expert_bias"]  # replicated over the group: only rank 0 writes
    assert bias.global_offset == (3, 0) and bias.replica_id[-1] == rank
    assert "layers.router.step_tokens_per_expert" not in sharded


def _check_ep_parity(rank, world, group, config, use_grouped_mm):
    reference, parallel = _layers(config, group, world)
    for layer in (reference, parallel):
        layer.experts.use_grouped_mm = use_grouped_mm
    local = slice(rank * config.num_moe_experts // world, (rank + 1) * config.num_moe_experts // world)
    assert torch.equal(parallel.experts.w1, reference.experts.w1[local])  # EP-independent init
    assert torch.equal(parallel.router.weight, reference.router.weight)
    if reference.router.expert_bias is not None:  # a non-zero bias must select identically
        bias = torch.randn(config.num_moe_experts, generator=torch.Generator().manual_seed(5)) * 0.2
        reference.router.expert_bias.copy_(bias)
        parallel.router.expert_bias.copy_(bias)

    g = torch.Generator().manual_seed(11)
    x_all = torch.randn(SEQ * world, BATCH, HIDDEN, generator=g)
    probe_all = torch.randn(SEQ * world, BATCH, HIDDEN, generator=g)
    mine = slice(rank * SEQ, (rank + 1) * SEQ)

    x_ref = x_all.clone().requires_grad_()
    out_ref, bias = reference(x_ref)
    assert bias is None and out_ref.shape == x_ref.shape
    (out_ref * probe_all).sum().backward()
    x_par = x_all[mine].clone().requires_grad_()
    out_par, _ = parallel(x_par)
    (out_par * probe_all[mine]).sum().backward()

    torch.testing.assert_close(out_par, out_ref[mine])
    torch.testing.assert_close(x_par.grad, x_ref.grad[mine])
    torch.testing.assert_close(parallel.experts.w1.grad, reference.experts.w1.grad[local])
    torch.testing.assert_close(parallel.experts.w2.grad, reference.experts.w2.grad[local])
    # Replicated params see this rank's tokens only: their grads sum to the reference (as DP would).
    replicated = [("router", parallel.router.weight, reference.router.weight)]
    if parallel.shared_expert is not None:
        replicated += [("shared.w1", parallel.shared_expert.w1, reference.shared_expert.w1),
                       ("shared.w2", parallel.shared_expert.w2, reference.shared_expert.w2)]
    for name, p, ref in replicated:
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, ref.grad, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(parallel.router.global_tokens_per_expert, reference.router.local_tokens_per_expert)
    if config.moe_expert_capacity_factor is not None:
        from megatron_ext.moe.quantile import expert_capacity

        tokens = SEQ * BATCH * world
        capacity = expert_capacity(tokens, config.moe_router_topk, config.num_moe_experts,
                                   config.moe_expert_capacity_factor)
        assert parallel.router.global_tokens_per_expert.max() <= capacity
        assert reference.router.last_rerouted > 0  # the capacity actually bit

    # Bias updates: statistics all-reduced over the group give the one-rank update.
    reference.router.update_expert_bias(None)
    parallel.router.update_expert_bias(group)
    if reference.router.expert_bias is not None:
        torch.testing.assert_close(parallel.router.expert_bias, reference.router.expert_bias)

    # Dropped pairs through the real all-to-all, against the per-token definition.
    routing_all = _random_routing(SEQ * world, config.num_moe_experts, config.moe_router_topk, 0.3, seed=2)
    routing = Routing(routing_all.experts[mine], routing_all.gates[mine], routing_all.dropped, routing_all.rerouted)
    out = _dispatch_combine(parallel.dispatcher, parallel.experts, x_all[mine, 0], routing)
    expected = _reference_moe(x_all[mine, 0], routing, reference.experts.w1, reference.experts.w2)
    torch.testing.assert_close(out, expected)


def test_ep2_matches_one_rank_output_and_grads_and_checkpoints_global_experts(tmp_path):
    """EP2 vs one rank on the concatenated tokens: softmax + shared expert through
    torch._grouped_mm, sigmoid + a non-zero sign bias through the per-expert loop, quantile
    capacity routing over the EP group with the dual bias, and without host reads; then the sharded
    state dict layout and an EP2 -> EP1 checkpoint round trip."""
    cases = [
        (dict(moe_router_score_function="softmax", moe_shared_expert_intermediate_size=8), None),
        (dict(moe_balancer="sign_bias", moe_router_bias_update_rate=1e-2), False),
        (dict(moe_balancer="qb_both", moe_expert_capacity_factor=1.0, moe_qb_num_bins=64), None),
        # no host reads: the one-rank reference keeps static buffers, EP2 reads only its split sizes
        (dict(moe_balancer="qb_capacity", moe_expert_capacity_factor=0.8, moe_qb_host_reads=False,
              moe_qb_device_rounds=1), False),
    ]
    assert run_distributed(_ep_parity_worker, 2, cases, str(tmp_path)) == [True, True]


def test_moe_layer_is_a_transformer_layer_mlp():
    """Built by Megatron's TransformerLayer from the spec; the layer adds x + moe(x) with grads."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    config = moe_config(moe_shared_expert_intermediate_size=8, hidden_dropout=0.0)
    torch.manual_seed(0)
    submodules = TransformerLayerSubmodules(mlp=moe_layer_spec(), mlp_bda=get_bias_dropout_add)
    block = TransformerLayer(config, submodules, layer_number=3, pg_collection=ProcessGroupCollection())
    moe = block.mlp
    assert isinstance(moe, MoELayer) and moe.layer_number == 3
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    out, _ = block(x, attention_mask=None)

    tokens = x.detach().reshape(-1, HIDDEN)
    routing, _ = moe.router(tokens)
    expected = _reference_moe(tokens, routing, moe.experts.w1, moe.experts.w2)
    expected += ffn(tokens, moe.shared_expert.w1, moe.shared_expert.w2, F.silu, True)
    torch.testing.assert_close(out.detach(), x.detach() + expected.view_as(x))
    (out * torch.randn_like(out)).sum().backward()
    for p in (x, moe.router.weight, moe.experts.w1, moe.experts.w2, moe.shared_expert.w1):
        assert p.grad is not None and p.grad.abs().max() > 0


@pytest.mark.parametrize("overrides,match", [
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size must be 1"),
    (dict(num_moe_experts=None, moe_ffn_hidden_size=None), "num_moe_experts must be"),
])
def test_bad_layout_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(moe_config(**overrides), ProcessGroupCollection())


@pytest.mark.gpu
def test_layer_runs_on_cuda_in_bf16_and_grouped_mm_matches_loop():
    config = moe_config(hidden_size=64, moe_ffn_hidden_size=32, params_dtype=torch.bfloat16,
                        use_cpu_initialization=False, moe_shared_expert_intermediate_size=32)
    outputs = []
    for use_grouped_mm in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(config, ProcessGroupCollection(), use_grouped_mm=use_grouped_mm)
        assert layer.experts.w1.is_cuda and layer.experts.w1.dtype == torch.bfloat16
        torch.manual_seed(1)
        x = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
        out, _ = layer(x)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        outputs.append((out.float(), x.grad.float(), layer.experts.w1.grad.float(), layer.router.weight.grad.float()))
    for grouped, loop in zip(*outputs):
        torch.testing.assert_close(grouped, loop, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("balancer, host_reads", [("none", True), ("qb_capacity", True), ("qb_capacity", False)])
def test_one_rank_routing_and_dispatch_read_the_host_at_most_once(monkeypatch, balancer, host_reads):
    """With one EP rank the dispatcher takes its buffer size from the routing (``num_kept``): plain
    top-k reads nothing back, capacity routing only its own reads (two when something overflows), and
    none without host reads (``moe_qb_host_reads: false``: static ``[N k]`` buffers)."""
    from tests.moe.test_quantile_capacity import _HostReads

    capacity = balancer == "qb_capacity"
    layer = MoELayer(moe_config(moe_balancer=balancer, moe_expert_capacity_factor=1.0 if capacity else None,
                                moe_qb_host_reads=host_reads), ProcessGroupCollection())
    tokens = torch.randn(64, HIDDEN, requires_grad=True)
    with _HostReads(monkeypatch) as host:
        routing, counts = layer.router(tokens)
        expert_input, tokens_per_expert, state = layer.dispatcher.dispatch(
            tokens, routing, layer.dispatcher.global_counts(counts))
        out = layer.dispatcher.combine(layer.experts(expert_input, tokens_per_expert), routing.gates, state)
        out.sum().backward()
    assert host.reads == (["tolist", "tolist"] if capacity and host_reads else [])
    kept = int((routing.experts >= 0).sum())
    assert expert_input.shape[0] == (kept if host_reads else routing.experts.numel())
    assert routing.num_kept == (kept if host_reads else None)
    assert capacity == (routing.dropped.item() > 0)  # the capacity case overflows: kept < N k


def test_layer_without_host_reads_equals_the_layer_with_them():
    """``moe_qb_host_reads: false`` (no host read, static buffers) gives the same output, gradients and
    router statistics as the reading layer whenever its device rounds are enough to finish."""
    results = []
    for host_reads in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(moe_config(moe_balancer="qb_capacity", moe_expert_capacity_factor=0.9,
                                    moe_qb_host_reads=host_reads, moe_qb_device_rounds=8),
                         ProcessGroupCollection())
        torch.manual_seed(1)
        x = torch.randn(SEQ * 4, BATCH, HIDDEN, requires_grad=True)
        out, _ = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        router = layer.router
        results.append((out, x.grad, layer.experts.w1.grad, layer.experts.w2.grad, router.weight.grad,
                        router.last_dropped, router.last_rerouted, router.step_routed_counts))
    assert results[0][5] > 0 and results[0][6] > 0  # the case drops and reroutes
    for with_reads, without in zip(*results):
        torch.testing.assert_close(without, with_reads, rtol=0, atol=0)


@pytest.mark.gpu
def test_layer_without_host_reads_never_syncs_on_cuda_and_equals_the_reading_layer():
    """On the GPU in bf16: forward and backward of the capacity-routed layer without host reads, eager and
    with the routing replayed from a CUDA graph (``moe_qb_cuda_graph``), and with the settings left at their
    defaults (one CUDA rank: no reads, every round, graphed), run under ``set_sync_debug_mode("error")`` (no
    host sync anywhere: routing, static dispatch, grouped GEMMs over trailing dropped rows, combine), and give
    the reading layer's numbers."""
    config = dict(hidden_size=64, moe_ffn_hidden_size=32, params_dtype=torch.bfloat16, use_cpu_initialization=False,
                  moe_balancer="qb_capacity", moe_expert_capacity_factor=0.9)
    results = []
    for host_reads, graph, rounds in ((True, False, 8), (False, False, 8), (False, True, 8), (None, None, None)):
        torch.manual_seed(0)
        layer = MoELayer(moe_config(moe_qb_host_reads=host_reads, moe_qb_cuda_graph=graph,
                                    moe_qb_device_rounds=rounds, **config), ProcessGroupCollection())
        capacity = layer.router.balancer.routing.capacity
        assert (capacity.reads, capacity.graphs is not None) == (bool(host_reads), host_reads is None or graph)
        torch.manual_seed(1)
        x = torch.randn(128, 2, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
        weights = torch.linspace(-1, 1, x.numel(), device="cuda").view_as(x)
        for call in range(2):  # the first call compiles and loads kernels (and captures the graph)
            layer.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            if not capacity.reads and call:
                torch.cuda.set_sync_debug_mode("error")
            try:
                out, _ = layer(x)
                (out.float() * weights).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert layer.router.last_dropped.item() > 0
        results.append((out.float(), x.grad.float(), layer.experts.w1.grad.float(), layer.experts.w2.grad.float(),
                        layer.router.weight.grad.float()))
    for with_reads, without, graphed, default in zip(*results):
        assert torch.isfinite(without).all()
        torch.testing.assert_close(without, with_reads, rtol=1e-2, atol=1e-3)
        assert torch.equal(graphed, without)  # the same kernels, replayed
        assert torch.equal(default, graphed)  # eight experts: eight device rounds are every round
