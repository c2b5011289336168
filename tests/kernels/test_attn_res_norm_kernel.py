"""Depth attention with the consumer's RMSNorm fused in (``out_norm_weight``), on the CPU interpreter.

Fused Triton kernel vs the plain-autograd reference ``depth_attention_norm_reference``
(RMSNorm of the rounded mix): every output and gradient (sources, query, key-norm weight,
output-norm weight) with random, non-zero inputs; several n and h (h not a power of two), 37
tokens (not a multiple of any tile). The cases run in a ``TRITON_INTERPRET=1`` subprocess
(tests/kernels/interpreter.py).
"""

import pytest
import torch

from kimi_kernels.attn_res import depth_attention, depth_attention_norm_reference
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

EPS, OUT_NORM_EPS = 1e-6, 1e-5
NAMES = ("normed", "d_sources", "d_query", "d_norm_weight", "d_out_norm_weight")


def _inputs(n, tokens, hidden, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, 1, 1, generator=gen) * 3 + 0.2  # sources of different sizes
    sources = (torch.randn(n, tokens, hidden, generator=gen) * scales).to(dtype)
    query = torch.randn(hidden, generator=gen) * 0.5
    norm_weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    out_norm_weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    grad_normed = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return sources, query, norm_weight, out_norm_weight, grad_normed


def _forward_backward(impl, sources, query, norm_weight, out_norm_weight, grad_normed, as_list=True):
    v = sources.clone().requires_grad_(True)
    params = [t.clone().requires_grad_(True) for t in (query, norm_weight, out_norm_weight)]
    if impl == "reference":
        out = depth_attention_norm_reference(v, *params, EPS, OUT_NORM_EPS)
    else:
        out = depth_attention(
            list(v.unbind(0)) if as_list else v, params[0], params[1], eps=EPS, impl=impl,
            out_norm_weight=params[2], out_norm_eps=OUT_NORM_EPS,
        )
    return (out, *torch.autograd.grad(out, (v, *params), grad_normed))


def _assert_all_close(got, want, rtol=1e-4, atol=1e-5):
    for name, a, b in zip(NAMES, got, want):
        assert b.abs().max() > 0, f"{name}: zero reference, the comparison would be vacuous"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * float(b.detach().abs().max()), msg=name)


@interpreter_case
@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("hidden", [32, 80])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_fused_norm_matches_reference_fp32(n, hidden, as_list):
    inputs = _inputs(n, 37, hidden, seed=10 * n + hidden)
    kernel = _forward_backward("triton", *inputs, as_list=as_list)
    reference = _forward_backward("reference", *inputs)
    if n == 1:  # one source: the softmax is constant, the mixer's parameters get exactly zero
        for a in kernel[2:4]:
            assert torch.equal(a, torch.zeros_like(a))
        kernel, reference = kernel[:2] + kernel[4:], reference[:2] + reference[4:]
        for name, a, b in zip(NAMES[:2] + NAMES[4:], kernel, reference):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.detach().abs().max()), msg=name)
        return
    _assert_all_close(kernel, reference)


@interpreter_case
@pytest.mark.parametrize("n", [2, 5])
def test_torch_recompute_path_matches_reference(n):
    inputs = _inputs(n, 37, 48, seed=n)
    _assert_all_close(_forward_backward("torch", *inputs), _forward_backward("reference", *inputs), rtol=1e-5)


@interpreter_case
@pytest.mark.parametrize("n", [2, 3, 5, 9])
def test_fused_norm_shipped_launch_per_width(n):
    # With the fused output norm, a width on each step of the launch tables (1 / 2 / 4 sources per row reduction
    # in the backward from n = 1 / 3 / 5; fused.BACKWARD_LAUNCH) gives the reference's output and grads.
    inputs = _inputs(n, 37, 48, seed=n)
    _assert_all_close(_forward_backward("triton", *inputs), _forward_backward("reference", *inputs))


@interpreter_case
def test_fused_norm_fp16_close_to_unfused():
    # fp16 inputs: the fused op vs the unfused pair (mix kernel, then the separate norm) on
    # the same fp16 tensors; both round the mix to fp16 before the norm.
    from kimi_kernels.attn_res.naive import rms_norm_reference

    sources, query, norm_weight, out_norm_weight, grad = _inputs(4, 37, 48, seed=2, dtype=torch.float16)
    fused = _forward_backward("triton", sources, query, norm_weight, out_norm_weight, grad)
    v = sources.clone().requires_grad_(True)
    params = [t.clone().requires_grad_(True) for t in (query, norm_weight, out_norm_weight)]
    mixed = depth_attention(list(v.unbind(0)), params[0], params[1], eps=EPS, impl="triton")
    out = rms_norm_reference(mixed, params[2], OUT_NORM_EPS)
    unfused = (out, *torch.autograd.grad(out, (v, *params), grad))
    assert fused[0].dtype == fused[1].dtype == torch.float16
    torch.testing.assert_close(fused[0], unfused[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(fused[1].float(), unfused[1].float(), rtol=5e-3, atol=5e-3)
    for name, a, b in zip(NAMES[2:], fused[2:], unfused[2:]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 5e-3, name


@interpreter_case
def test_fused_norm_zero_gamma_entries_and_param_dtypes():
    # Zeros in the output norm's weight (the fused backward does not divide by it) and a
    # low-precision weight, whose grad comes back in its own dtype.
    sources, query, norm_weight, out_norm_weight, grad = _inputs(3, 37, 48, seed=3)
    out_norm_weight[::5] = 0.0
    kernel = _forward_backward("triton", sources, query, norm_weight, out_norm_weight, grad)
    _assert_all_close(kernel, _forward_backward("reference", sources, query, norm_weight, out_norm_weight, grad))
    g = out_norm_weight.half().requires_grad_(True)
    out = depth_attention(list(sources.unbind(0)), query, norm_weight, impl="triton", out_norm_weight=g)
    (dg,) = torch.autograd.grad(out.sum(), (g,))
    assert dg.dtype == torch.float16


@interpreter_case
def test_fused_norm_saves_inputs_output_lse_rstd_and_is_deterministic():
    sources, query, norm_weight, out_norm_weight, grad = _inputs(3, 37, 32, seed=4)
    leaves = [t.requires_grad_(True) for t in (sources, query, norm_weight, out_norm_weight)]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        normed = depth_attention(leaves[0], *leaves[1:3], impl="triton", out_norm_weight=leaves[3])
    # The inputs, the mix output (not the returned normed tensor) and two fp32 numbers per token.
    inputs = {t.data_ptr() for t in leaves}
    assert normed.data_ptr() not in {t.data_ptr() for t in saved}
    assert inputs <= {t.data_ptr() for t in saved}
    extra = [t for t in saved if t.data_ptr() not in inputs]
    assert sorted(tuple(t.shape) for t in extra) == [(37,), (37,), (37, 32)], [t.shape for t in extra]
    first = torch.autograd.grad(normed, leaves, grad, retain_graph=True)
    second = torch.autograd.grad(normed, leaves, grad)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def finish_kernel_parameter_grads(param_dtype, device="cpu"):
    """(kernel grads, torch products of the fp32 sums, the fp32 products) of one fused-norm call's
    parameters: the finish kernel's grad_query = g * gamma, grad_norm_weight = g * w, grad_out_norm = g_o
    against the torch ops they replaced; also checks that the source grads are the same either way."""
    from kimi_kernels.attn_res import backward as launchers, fused

    sources, query, norm_weight, out_norm_weight, grad = (t.to(device) for t in _inputs(4, 37, 48, seed=5))
    query, norm_weight, out_norm_weight = (t.to(param_dtype) for t in (query, norm_weight, out_norm_weight))
    views = list(sources.unbind(0))
    out, lse, _, out_rstd = fused.fused_depth_attention_forward(views, query, norm_weight, EPS, out_norm_weight,
                                                                OUT_NORM_EPS)

    def backward(parameter_grads):
        dests = [torch.empty_like(v) for v in views]
        return launchers.fused_depth_attention_backward_sums(
            views, query, norm_weight, EPS, out, lse, grad, dests, [False] * len(views), out_norm_weight,
            OUT_NORM_EPS, out_rstd, need_out_norm_weight=True, parameter_grads=parameter_grads), dests

    in_kernel, dests_kernel = backward(True)
    sums, dests_sums = backward(False)
    assert in_kernel.g is None and all(torch.equal(a, b) for a, b in zip(dests_kernel, dests_sums))
    got = (in_kernel.grad_query, in_kernel.grad_norm_weight, in_kernel.grad_out_norm_weight)
    exact = (sums.g * norm_weight.float(), sums.g * query.float(), sums.g_out_norm)
    want = (*launchers.parameter_grads(sums.g, query, norm_weight), sums.g_out_norm.to(param_dtype))
    for g in got:
        assert g.dtype == param_dtype and g.abs().max() > 0
    return got, want, exact


@interpreter_case
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finish_kernel_parameter_grads_equal_the_torch_products(param_dtype):
    # Bit-identical to the torch products in fp32 and fp16. The interpreter rounds fp32 -> bf16 by truncation
    # (the GPU rounds to nearest, tests/kernels/test_attn_res_gpu.py checks bit equality there): in bf16, within
    # one unit in the last place of the exact fp32 product.
    got, want, exact = finish_kernel_parameter_grads(param_dtype)
    for g, w, e in zip(got, want, exact):
        if param_dtype == torch.bfloat16:
            ulp = torch.finfo(torch.bfloat16).eps * e.abs().clamp_min(1e-30)
            assert ((g.float() - e).abs() <= ulp).all()
        else:
            assert torch.equal(g, w)


@interpreter_case
@pytest.mark.parametrize("programs", [1, 16, 37])
def test_finish_kernel_sums_equal_an_fp64_sum(programs):
    # The [rows, programs, h] partial sums reduced over programs (the loop unrolled, one reduction at the end)
    # against an fp64 sum; programs not a multiple of the launch table's finish_block_p and h = 48 not a multiple
    # of its finish_block (both masks).
    from kimi_kernels.attn_res import fused
    from kimi_kernels.attn_res.preload_bwd import _depth_attention_finish_kernel

    rows, hidden = 3, 48
    partial = torch.randn(rows, programs, hidden, generator=torch.Generator().manual_seed(programs)) * 4
    sums = torch.full((rows, hidden), float("nan"))
    launch = fused.BACKWARD_LAUNCH
    _depth_attention_finish_kernel[(-(-hidden // launch.finish_block),)](
        partial, sums, partial, partial, partial, partial, partial, hidden, P=programs, ROWS=rows,
        BLOCK_P=launch.finish_block_p, BLOCK=launch.finish_block, PARAMETER_GRADS=False)
    torch.testing.assert_close(sums.double(), partial.double().sum(dim=1), rtol=1e-6, atol=1e-5)
