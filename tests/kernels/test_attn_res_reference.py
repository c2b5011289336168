"""Block AttnRes depth attention: the PyTorch reference, its recompute form and the public API."""

import pytest
import torch

from kimi_kernels.attn_res import depth_attention, depth_attention_reference
from kimi_kernels.attn_res.naive import depth_attention_recompute


def _inputs(n, tokens, hidden, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # Give sources different scales so the RMSNorm and the softmax both matter.
    scales = torch.rand(n, 1, 1, generator=gen) * 3 + 0.2
    sources = (torch.randn(n, tokens, hidden, generator=gen) * scales).to(dtype)
    query = torch.randn(hidden, generator=gen) * 0.5
    norm_weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    return sources, query, norm_weight


def test_reference_matches_definition():
    sources, query, norm_weight = _inputs(4, 11, 24)
    v = sources.double()
    keys = v / v.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm_weight.double()
    weights = torch.softmax((keys * query.double()).sum(-1), dim=0)  # [n, T]
    expected = (weights[..., None] * v).sum(0)
    out = depth_attention_reference(sources, query, norm_weight, 1e-6)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_zero_query_gives_uniform_average(n):
    sources, _, norm_weight = _inputs(n, 9, 16, seed=n)
    out = depth_attention(sources, torch.zeros(16), norm_weight, impl="torch")
    torch.testing.assert_close(out, sources.mean(0), rtol=1e-6, atol=1e-6)


def test_single_source_is_returned_unchanged():
    sources, query, norm_weight = _inputs(1, 9, 16)
    out = depth_attention(sources, query, norm_weight, impl="torch")
    torch.testing.assert_close(out, sources[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("as_list", [False, True])
def test_recompute_matches_plain_autograd(as_list):
    sources, query, norm_weight = _inputs(5, 13, 40, seed=3)
    grad_out = torch.randn(13, 40, generator=torch.Generator().manual_seed(7))

    def grads(fn):
        v = sources.clone().requires_grad_(True)
        w = query.clone().requires_grad_(True)
        g = norm_weight.clone().requires_grad_(True)
        out = fn(list(v.unbind(0)) if as_list else v, w, g)
        return (out, *torch.autograd.grad(out, (v, w, g), grad_out))

    plain = grads(lambda v, w, g: depth_attention_reference(torch.stack(v) if as_list else v, w, g))
    recompute = grads(depth_attention_recompute)
    for name, a, b in zip(("out", "d_sources", "d_query", "d_norm_weight"), recompute, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _saved_tensors(fn, *args):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


def test_recompute_saves_only_its_inputs():
    sources, query, norm_weight = _inputs(5, 13, 40)
    v = sources.requires_grad_(True)
    w = query.requires_grad_(True)
    g = norm_weight.requires_grad_(True)
    saved = _saved_tensors(depth_attention, list(v.unbind(0)), w, g, 1e-6, "torch")
    input_ptrs = {t.data_ptr() for t in (*v.unbind(0), w, g)}
    assert len(saved) == 7
    assert {t.data_ptr() for t in saved} == input_ptrs
    # The plain reference keeps fp32 keys and more: the recompute form must keep strictly less.
    plain = _saved_tensors(depth_attention_reference, v, w, g)
    assert sum(t.numel() for t in plain) > 2 * v.numel()


def test_list_and_stacked_inputs_agree_and_keep_shape():
    sources, query, norm_weight = _inputs(3, 12, 16)
    stacked = sources.view(3, 4, 3, 16)  # [n, s, b, h]
    out_stacked = depth_attention(stacked, query, norm_weight, impl="torch")
    out_list = depth_attention(list(stacked.unbind(0)), query, norm_weight, impl="torch")
    assert out_stacked.shape == (4, 3, 16)
    torch.testing.assert_close(out_stacked, out_list, rtol=0, atol=0)


def test_bf16_sources_give_bf16_output_close_to_fp32():
    sources, query, norm_weight = _inputs(4, 10, 32, dtype=torch.bfloat16)
    out = depth_attention(sources, query, norm_weight, impl="torch")
    assert out.dtype == torch.bfloat16
    expected = depth_attention_reference(sources.float(), query, norm_weight)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(impl="cuda"), "impl must be one of"),
        (dict(sources=[]), "non-empty sequence"),
        (dict(sources=[torch.randn(4, 8), torch.randn(4, 6)]), r"sources\[1\]"),
        (dict(sources=torch.randn(3, 4, 8).to(torch.int32)), "dtype"),
        (dict(query=torch.randn(7)), "query must have shape"),
        (dict(norm_weight=torch.randn(8, 1)), "norm_weight must have shape"),
        (dict(sources=torch.randn(65, 2, 8)), "number of sources"),
        (dict(impl="triton"), "needs CUDA tensors"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(kwargs, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = dict(sources=torch.randn(3, 4, 8), query=torch.randn(8), norm_weight=torch.randn(8), impl="torch")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        depth_attention(**args)
