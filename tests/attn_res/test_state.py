"""DepthState's block tracking (in-place source grads) and DepthMixer's checked-once fast path."""

from types import SimpleNamespace

import pytest
import torch

from kimi_kernels.attn_res import SourceGrad, depth_attention
from megatron_ext.attn_res import DepthMixer, DepthState

HIDDEN = 16


def _mixer(seed: int) -> DepthMixer:
    config = SimpleNamespace(layernorm_epsilon=1e-6, attn_res_impl="torch", hidden_size=HIDDEN, sequence_parallel=False)
    mixer = DepthMixer(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mixer.query.copy_(torch.randn(HIDDEN, generator=g))
        mixer.key_norm_weight.copy_(1 + 0.3 * torch.randn(HIDDEN, generator=g))
    return mixer


def _run(track: bool, embedding: torch.Tensor, mixers, calls: int = 2):
    """A chain of stand-in sublayers (blocks of 2): each output is 0.5 * tanh of its mixed input.
    Every mixer runs ``calls`` times (the first call is checked, later ones take the fast path)."""
    state = DepthState.entering([embedding], track=track)
    total = 0
    for j, mixer in enumerate(mixers):
        for _ in range(calls):
            h = mixer(state.sources(), state.source_grads())
        total = total + h.square().sum()
        state = state.add(0.5 * torch.tanh(h), close=j % 2 == 1)
    final = mixers[0](state.sources(), state.source_grads())
    return state, total + final.sum()


def test_tracked_chain_equals_autograd_and_fast_path_equals_checked_call():
    mixers = [_mixer(seed) for seed in range(6)]
    embedding = torch.randn(3, 2, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    params = [p for m in mixers for p in m.parameters()]
    state, loss = _run(True, embedding, mixers)
    assert len(state.blocks) == 4 and all(isinstance(g, SourceGrad) for g in state.block_grads)
    got = torch.autograd.grad(loss, [embedding, *params])
    _, plain_loss = _run(False, embedding, mixers)
    want = torch.autograd.grad(plain_loss, [embedding, *params])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # The fast path (every mixer's second call) gives what the public op gives.
    sources = state.sources()
    torch.testing.assert_close(
        mixers[1](sources), depth_attention(sources, mixers[1].query, mixers[1].key_norm_weight, 1e-6, "torch")
    )


def test_blocks_are_tracked_only_where_autograd_records():
    embedding = torch.randn(3, 2, HIDDEN, requires_grad=True)
    with torch.no_grad():
        state = DepthState.entering([embedding], track=True).add(embedding * 2, close=True)
    assert state.block_grads == [None, None]
    state = DepthState.entering([embedding.detach()], track=True).add(embedding, close=False)
    assert state.block_grads == [None] and state.source_grads() == [None, None]
    assert DepthState.entering([embedding], track=False).source_grads() is None


def test_sources_entering_the_state_must_match_b0():
    state = DepthState.entering([torch.randn(3, 2, HIDDEN)])
    with pytest.raises(ValueError, match="sublayer output"):
        state.add(torch.randn(4, 2, HIDDEN), close=False)
    with pytest.raises(ValueError, match="sublayer output"):
        state.add(torch.randn(3, 2, HIDDEN, dtype=torch.float64), close=True)
    with pytest.raises(ValueError, match="block"):
        DepthState.entering([torch.randn(3, 2, HIDDEN), torch.randn(3, 1, HIDDEN)])
    transposed = torch.randn(2, 3, HIDDEN).transpose(0, 1)
    assert state.add(transposed, close=False).partial.is_contiguous()


def test_mixer_checks_again_when_the_sources_change():
    mixer = _mixer(0)
    mixer([torch.randn(3, 2, HIDDEN), torch.randn(3, 2, HIDDEN)])
    with pytest.raises(ValueError, match="sources\\[1\\]"):  # a new shape: checked, not fast-pathed
        mixer([torch.randn(5, 2, HIDDEN), torch.randn(3, 2, HIDDEN)])
    with pytest.raises(ValueError, match="query must have shape"):
        mixer([torch.randn(3, 2, 8)])
