"""One-rank checks of the Block AttnRes model, run in one spawned process (see test_model.py).

Every check builds models from the same seed under one set of process groups and returns
tensors for the tests to compare, so a single process start serves them all.
"""

from __future__ import annotations

import functools

import torch

from megatron_ext import cpu_compat
from tests.attn_res import reference, runner
from tests.parallel import harness


def _model(**overrides):
    from megatron_ext.model import build_model

    config = harness.tiny_config({}, False, **overrides)
    torch.manual_seed(harness.SEED)
    return build_model(config)


def _batch():
    mb = harness.microbatches_for_rank(harness.make_batches())[0]
    return mb["tokens"], mb["position_ids"]


def _logits_and_grads(model, logits_fn, probe):
    model.zero_grad(set_to_none=True)
    logits = logits_fn()
    (logits * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def reference_check(num_blocks: int):
    """The model vs :func:`reference.reference_logits` on the same weights (random mixers)."""
    model = _model(attn_res=True, attn_res_num_blocks=num_blocks)
    runner.randomise_mixers([model])
    tokens, pos = _batch()
    probe = torch.randn(*tokens.shape, model.config.padded_vocab_size(), generator=torch.Generator().manual_seed(3))
    block_size = 2 * model.config.num_layers // num_blocks
    got = _logits_and_grads(model, lambda: model(tokens, pos, None), probe)
    want = _logits_and_grads(model, lambda: reference.reference_logits(model, tokens, pos, block_size), probe)
    return got, want


def one_block_vs_standard(random_queries: bool):
    """N = 1 with zero pseudo-queries vs the standard residual model with the same layer weights."""
    eps = dict(layernorm_epsilon=1e-12)
    standard = _model(**eps)
    attn_res = _model(attn_res=True, attn_res_num_blocks=1, **eps)
    missing, unexpected = attn_res.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and missing and all("mixer" in k for k in missing), (missing, unexpected)
    runner.randomise_mixers([attn_res])  # random key norms: irrelevant while the queries are 0
    if not random_queries:
        for module in attn_res.modules():
            if hasattr(module, "query"):
                torch.nn.init.zeros_(module.query)
    tokens, pos = _batch()
    probe = torch.randn(*tokens.shape, standard.config.padded_vocab_size(), generator=torch.Generator().manual_seed(4))
    return (
        _logits_and_grads(standard, lambda: standard(tokens, pos, None), probe),
        _logits_and_grads(attn_res, lambda: attn_res(tokens, pos, None), probe),
    )


def mixer_inputs_at_init(num_blocks: int, fuse_norm: bool):
    """Freshly built model: (sublayer name, sources, mixer output, the consumer's norm applied to
    the mean of the sources) for every depth mixer (which returns ``norm(mix)``)."""
    model = _model(attn_res=True, attn_res_num_blocks=num_blocks, attn_res_fuse_norm=fuse_norm)
    seen = []

    def hook(module, args, out, name):
        sources, norm = [s.detach() for s in args[0]], args[2]
        seen.append((name, sources, out.detach(), norm(sum(sources) / len(sources))))

    for name, module in model.named_modules():
        if name.endswith("mixer"):
            module.register_forward_hook(functools.partial(hook, name=name))
    tokens, pos = _batch()
    with torch.no_grad():
        model(tokens, pos, None)
    return seen


RECOMPUTE_FIRST_LAYER = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)


def inplace_source_grads(num_blocks: int, **overrides):
    """Logits and grads with in-place source-grad sums off and on, and per tracked block the
    number of contributions added into its ``SourceGrad`` in the backward pass."""
    from kimi_kernels.attn_res import SourceGrad
    from megatron_ext.attn_res import state as state_module

    tokens, pos = _batch()
    results, counts = [], {}
    add_, track = SourceGrad.add_, state_module.track_source_grad

    def counting_add(self, grad):
        counts[id(self)] += 1
        return add_(self, grad)

    def counting_track(source):
        tracked, source_grad = track(source)
        counts[id(source_grad)] = 0
        return tracked, source_grad

    for inplace in (False, True):
        model = _model(
            attn_res=True, attn_res_num_blocks=num_blocks, attn_res_inplace_source_grads=inplace, **overrides
        )
        runner.randomise_mixers([model])
        probe = torch.randn(*tokens.shape, model.config.padded_vocab_size(), generator=torch.Generator().manual_seed(5))
        SourceGrad.add_, state_module.track_source_grad = counting_add, counting_track
        try:
            results.append(_logits_and_grads(model, lambda: model(tokens, pos, None), probe))
        finally:
            SourceGrad.add_, state_module.track_source_grad = add_, track
    return results[0], results[1], list(counts.values())


def fuse_norm_on_off(num_blocks: int, **overrides):
    """Logits and grads with the sublayer norms fused into the depth mixes and run separately
    (same weights: random mixers and norm weights), and the number of fused norms."""
    from megatron_ext.attn_res.layer import fusable_norm

    tokens, pos = _batch()
    results = []
    for fuse in (False, True):
        model = _model(attn_res=True, attn_res_num_blocks=num_blocks, attn_res_fuse_norm=fuse, **overrides)
        runner.randomise_mixers_and_norms([model])
        probe = torch.randn(*tokens.shape, model.config.padded_vocab_size(), generator=torch.Generator().manual_seed(6))
        results.append(_logits_and_grads(model, lambda: model(tokens, pos, None), probe))
    fused = sum(fusable_norm(m) for m in model.modules())
    return results[0], results[1], fused


def run_fuse_norm_triton(rank, world_size):
    """:func:`fuse_norm_on_off` with the Triton kernels (run with TRITON_INTERPRET=1 set)."""
    from megatron_ext.parallel import initialize_parallel

    cpu_compat.install()
    initialize_parallel(harness.tiny_config({}, False), harness.SEED)
    return fuse_norm_on_off(2, attn_res_impl="triton")


def pair_backward_on_off(num_blocks: int, **overrides):
    """Logits and grads with the layers' two mixers sharing one backward pass over their common
    blocks (``attn_res_pair_backward``) and without (random mixers and norm weights), and the
    number of pairs whose backward actually ran paired."""
    from kimi_kernels.attn_res import pair as pair_module

    tokens, pos = _batch()
    results, paired = [], []
    defer = pair_module.DepthPair.defer

    def counting_defer(self, *args, **kwargs):
        paired.append(1)
        return defer(self, *args, **kwargs)

    for on in (False, True):
        model = _model(attn_res=True, attn_res_num_blocks=num_blocks, attn_res_pair_backward=on, **overrides)
        runner.randomise_mixers_and_norms([model])
        probe = torch.randn(*tokens.shape, model.config.padded_vocab_size(), generator=torch.Generator().manual_seed(7))
        pair_module.DepthPair.defer = counting_defer
        try:
            results.append(_logits_and_grads(model, lambda: model(tokens, pos, None), probe))
        finally:
            pair_module.DepthPair.defer = defer
    return results[0], results[1], len(paired)


def run_pair_backward_triton(rank, world_size):
    """:func:`pair_backward_on_off` with the Triton kernels (run with TRITON_INTERPRET=1 set):
    blocks of 2 sublayers (the benchmark's schedule), Full AttnRes, blocks of 2 with the first
    layer recomputed."""
    from megatron_ext.parallel import initialize_parallel

    cpu_compat.install()
    initialize_parallel(harness.tiny_config({}, False), harness.SEED)
    return {
        "blocks_of_2": pair_backward_on_off(4, attn_res_impl="triton"),
        "full": pair_backward_on_off(8, attn_res_impl="triton"),
        "recompute": pair_backward_on_off(4, attn_res_impl="triton", **RECOMPUTE_FIRST_LAYER),
    }


def run_all(rank, world_size):
    from megatron_ext.parallel import initialize_parallel

    cpu_compat.install()
    initialize_parallel(harness.tiny_config({}, False), harness.SEED)
    return {
        "reference_full": reference_check(8),
        "reference_blocks": reference_check(2),
        "one_block_zero_queries": one_block_vs_standard(random_queries=False),
        "one_block_random_queries": one_block_vs_standard(random_queries=True),
        "init_mixers": mixer_inputs_at_init(2, fuse_norm=False),
        "init_mixers_fused_norm": mixer_inputs_at_init(2, fuse_norm=True),
        "inplace_blocks": inplace_source_grads(2),
        "inplace_full": inplace_source_grads(8),
        "inplace_recompute": inplace_source_grads(2, **RECOMPUTE_FIRST_LAYER),
        "fuse_norm_blocks": fuse_norm_on_off(2),
        "fuse_norm_full": fuse_norm_on_off(8),
        "fuse_norm_recompute": fuse_norm_on_off(2, **RECOMPUTE_FIRST_LAYER),
        "fuse_norm_no_inplace": fuse_norm_on_off(2, attn_res_inplace_source_grads=False),
        "saved_bytes_standard": saved_activation_bytes(),
        "saved_bytes_full_attn_res": saved_activation_bytes(attn_res=True, attn_res_num_blocks=8),
    }


def saved_activation_bytes(**overrides) -> tuple[int, int]:
    """(bytes of distinct storages autograd saves in one forward, bytes of one [s, b, h])."""
    model = _model(**overrides)
    tokens, pos = _batch()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, pos, None)
    return sum(storages.values()), tokens.numel() * model.config.hidden_size * 4
