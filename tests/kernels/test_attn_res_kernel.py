"""Fused Triton depth-attention kernel vs the PyTorch reference, on the CPU interpreter.

The cases run in a ``TRITON_INTERPRET=1`` subprocess started by ``test_cases_under_interpreter``
(see tests/kernels/interpreter.py). Inputs are fp32/fp16 (the interpreter's bf16 maths is
wrong); bf16 on the GPU lives in test_attn_res_gpu.py.
"""

import pytest
import torch

from kimi_kernels.attn_res import depth_attention, depth_attention_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


def _inputs(n, tokens, hidden, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, 1, 1, generator=gen) * 3 + 0.2  # sources of different sizes
    sources = (torch.randn(n, tokens, hidden, generator=gen) * scales).to(dtype)
    query = torch.randn(hidden, generator=gen) * 0.5
    norm_weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    grad_out = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return sources, query, norm_weight, grad_out


def _forward_backward(impl, sources, query, norm_weight, grad_out, as_list):
    v = sources.clone().requires_grad_(True)
    w = query.clone().requires_grad_(True)
    g = norm_weight.clone().requires_grad_(True)
    if impl == "reference":
        out = depth_attention_reference(v, w, g)
    else:
        out = depth_attention(list(v.unbind(0)) if as_list else v, w, g, impl=impl)
    return (out, *torch.autograd.grad(out, (v, w, g), grad_out))


@interpreter_case
@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("hidden", [32, 48])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_kernel_matches_reference_fp32(n, hidden, as_list):
    inputs = _inputs(n, 37, hidden, seed=10 * n + hidden)
    kernel = _forward_backward("triton", *inputs, as_list=as_list)
    reference = _forward_backward("reference", *inputs, as_list=as_list)
    for name, a, b in zip(("out", "d_sources", "d_query", "d_norm_weight"), kernel, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@interpreter_case
def test_kernel_matches_reference_fp16():
    sources, query, norm_weight, grad_out = _inputs(4, 37, 48, seed=1, dtype=torch.float16)
    kernel = _forward_backward("triton", sources, query, norm_weight, grad_out, as_list=True)
    # Ground truth: the same fp16 inputs in fp32 maths; the kernel rounds only its outputs.
    reference = _forward_backward("reference", sources.float(), query, norm_weight, grad_out.float(), as_list=True)
    assert kernel[0].dtype == kernel[1].dtype == torch.float16
    for name, a, b in zip(("out", "d_sources"), kernel, reference):
        torch.testing.assert_close(a.float(), b, rtol=2e-3, atol=2e-3, msg=name)
    # The backward takes c = sum_i a_i (dout . v_i) as dout . out with the fp16-rounded output
    # (as flash attention does), so the query / norm-weight grads (sums over all tokens of
    # dlogit terms) carry that rounding: compared in norm.
    for name, a, b in zip(("d_query", "d_norm_weight"), kernel[2:], reference[2:]):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-3, name


@interpreter_case
@pytest.mark.parametrize("n", [2, 5])
def test_kernel_zero_query_gives_uniform_average(n):
    sources, _, norm_weight, _ = _inputs(n, 37, 48, seed=n)
    out = depth_attention(sources, torch.zeros(48), norm_weight, impl="triton")
    torch.testing.assert_close(out, sources.mean(0), rtol=1e-6, atol=1e-6)


@interpreter_case
def test_kernel_single_source_is_returned_unchanged():
    sources, query, norm_weight, _ = _inputs(1, 37, 32)
    out = depth_attention([sources[0]], query, norm_weight, impl="triton")
    torch.testing.assert_close(out, sources[0], rtol=1e-6, atol=1e-6)


@interpreter_case
def test_kernel_saves_inputs_output_and_lse_and_is_deterministic():
    sources, query, norm_weight, grad_out = _inputs(3, 37, 32, seed=4)
    v = sources.requires_grad_(True)
    w = query.requires_grad_(True)
    g = norm_weight.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = depth_attention(v, w, g, impl="triton")
    # The inputs, the output itself (its consumer keeps it anyway) and one fp32 number per token.
    expected = {v.data_ptr(), w.data_ptr(), g.data_ptr(), out.data_ptr()}
    extra = [t for t in saved if t.data_ptr() not in expected]
    assert {t.data_ptr() for t in saved} - {t.data_ptr() for t in extra} == expected
    assert len(extra) == 1 and extra[0].shape == (37,) and extra[0].dtype == torch.float32
    assert len(saved) == 5
    first = torch.autograd.grad(out, (v, w, g), grad_out, retain_graph=True)
    second = torch.autograd.grad(out, (v, w, g), grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@interpreter_case
def test_kernel_keeps_sbh_shape_and_param_dtypes():
    sources, query, norm_weight, _ = _inputs(3, 12, 32)
    sbh = [s.view(4, 3, 32) for s in sources.unbind(0)]  # three [s, b, h] tensors
    w = query.requires_grad_(True)
    g = norm_weight.half().requires_grad_(True)  # a low-precision norm weight gets its own dtype back
    out = depth_attention(sbh, w, g, impl="triton")
    assert out.shape == (4, 3, 32)
    dw, dg = torch.autograd.grad(out.sum(), (w, g))
    assert dw.dtype == torch.float32 and dg.dtype == torch.float16


@interpreter_case
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9])
def test_shipped_launch_per_width_matches_reference(n):
    # The launch tables (fused.FORWARD_LAUNCH, fused.BACKWARD_LAUNCH) pick the sources per row reduction and a
    # register cap by the call's width: a width on each of their steps (the backward's 1 / 2 / 4 sources per
    # reduction from n = 1 / 3 / 5, batches padded at n = 3, 5, 7, the forward's cap from n = 7) gives the
    # reference's output and grads. Several tokens per tile (h = 48 pads to 64), 37 tokens: a partial last tile.
    import kimi_kernels.attn_res.fused as fused

    forward, backward = fused.FORWARD_LAUNCH.for_call(48, n), fused.BACKWARD_LAUNCH.for_call(48, n)
    assert forward.batch == 4 and backward.batch == (1 if n < 3 else 2 if n < 5 else 4)
    assert forward.maxnreg == (128 if n >= 7 else None)
    inputs = _inputs(n, 37, 48, seed=n)
    kernel = _forward_backward("triton", *inputs, as_list=True)
    reference = _forward_backward("reference", *inputs, as_list=True)
    for name, a, b in zip(("out", "d_sources", "d_query", "d_norm_weight"), kernel, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"n={n} {name}")


@interpreter_case
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_source_grads_summed_in_place_equal_autograd_sums(impl, fused_norm):
    # Sources read by several calls (as the embedding and block sums are), plus one ordinary
    # autograd consumer: tracked sources get the same grads as plain autograd gives, with and without
    # the sublayer norm fused into the mix (whose weight's grad must not change either).
    from kimi_kernels.attn_res import track_source_grad

    gen = torch.Generator().manual_seed(5)
    tokens, hidden = 21, 48
    leaves = [(torch.randn(tokens, hidden, generator=gen) * (1 + i)).requires_grad_(True) for i in range(4)]
    queries = [torch.randn(hidden, generator=gen) * 0.5 for _ in range(4)]
    gamma = 1 + 0.3 * torch.randn(hidden, generator=gen)
    out_gamma = (1 + 0.3 * torch.randn(hidden, generator=gen)).requires_grad_(True) if fused_norm else None
    weights = torch.randn(tokens, hidden, generator=gen)
    wrt = [*leaves, out_gamma] if fused_norm else leaves

    def loss(track):
        sources = [t * 1.0 for t in leaves]
        grads = [None] * len(sources)
        if track:
            sources, grads = map(list, zip(*(track_source_grad(t) for t in sources)))
        total = 0
        for k, w in enumerate(queries):
            out = depth_attention(sources[: k + 1], w, gamma, impl=impl, source_grads=grads[: k + 1],
                                  out_norm_weight=out_gamma)
            total = total + (out * weights).sum() ** 2 / 100
        return total + (sources[0] * sources[2]).sum()  # a consumer outside depth attention

    expected = torch.autograd.grad(loss(False), wrt)
    tracked_loss = loss(True)
    got = torch.autograd.grad(tracked_loss, wrt, retain_graph=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = torch.autograd.grad(tracked_loss, wrt)  # a second backward starts from zero again
    for a, b in zip(again, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
