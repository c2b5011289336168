"""MoE combine: Triton kernels vs the PyTorch reference (CPU: Triton interpreter, fp32/fp16, in a subprocess
started by ``test_cases_under_interpreter``; GPU: bf16)."""

import pytest
import torch

from kimi_kernels.moe_combine import combine_reference, moe_combine
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)


def make_case(num_tokens, top_k, hidden, dropped, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    pairs = num_tokens * top_k
    pair_order = torch.randperm(pairs, generator=g)[: pairs - dropped]
    source = torch.full((pairs,), len(pair_order), dtype=torch.long)
    source[pair_order] = torch.arange(len(pair_order))
    rows = torch.randn(len(pair_order), hidden, generator=g).to(dtype)
    gates = torch.rand(num_tokens, top_k, generator=g)
    cotangent = torch.randn(num_tokens, hidden, generator=g)
    return [t.to(device) for t in (rows, gates, source, cotangent)]


def run(rows, gates, source, cotangent, use_kernel):
    r, g = rows.clone().requires_grad_(), gates.clone().requires_grad_()
    out = moe_combine(r, g, source, use_kernel=use_kernel)
    (out.float() * cotangent).sum().backward()
    return out, r.grad, g.grad


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@interpreter_case
@pytest.mark.parametrize("num_tokens,top_k,hidden,dropped", [(37, 4, 300, 0), (37, 4, 300, 29), (16, 8, 256, 5),
                                                              (5, 2, 40, 7)])
def test_kernel_matches_reference_fp32(num_tokens, top_k, hidden, dropped):
    """Token and column counts off the tile sizes; with and without dropped pairs (the last case drops
    every pair of some tokens)."""
    case = make_case(num_tokens, top_k, hidden, dropped, torch.float32)
    ours, ref = run(*case, use_kernel=True), run(*case, use_kernel=False)
    for a, b, name in zip(ours, ref, ("out", "d_rows", "d_gates")):
        assert rel_err(a, b) < 1e-5, name
    assert ours[2].dtype == torch.float32 and ours[0].dtype == torch.float32


@interpreter_case
def test_kernel_fp16_accumulates_in_fp32():
    case = make_case(40, 8, 128, 3, torch.float16, seed=1)
    ours, ref = run(*case, use_kernel=True), run(*case, use_kernel=False)
    assert ours[0].dtype == torch.float16 and ours[1].dtype == torch.float16
    assert rel_err(ours[0], ref[0]) < 2e-3 and rel_err(ours[1], ref[1]) < 2e-3 and rel_err(ours[2], ref[2]) < 1e-5


def test_bad_inputs_are_refused():
    rows, gates, source, _ = make_case(4, 2, 8, 0, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        moe_combine(rows, gates.double(), source)
    with pytest.raises(ValueError, match="source"):
        moe_combine(rows, gates, source[:-1])


def test_reference_equals_the_definition():
    rows, gates, source, _ = make_case(9, 3, 16, 4, torch.float64)
    out = combine_reference(rows, gates, source)
    for n in range(9):
        expected = sum(gates[n, j] * rows[source[n * 3 + j]] for j in range(3) if source[n * 3 + j] < len(rows))
        torch.testing.assert_close(out[n], torch.as_tensor(expected, dtype=torch.float64) + 0 * out[n])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_matches_fp32_reference():
    rows, gates, source, cot = make_case(4096, 8, 2048, 300, torch.float32, seed=2, device="cuda")
    ours = run(rows.bfloat16(), gates, source, cot, use_kernel=True)
    ref = run(rows, gates, source, cot, use_kernel=False)
    assert rel_err(ours[0], ref[0]) < 1e-2 and rel_err(ours[1], ref[1]) < 1e-2 and rel_err(ours[2], ref[2]) < 1e-2



@interpreter_case
@pytest.mark.parametrize("dropped", [0, 29])
def test_dispatch_backward_through_the_kernel_equals_gather_and_sum(dropped):
    """The dispatcher's token-gather backward (``sum_slot_grads``): the combine kernel with unit gates equals
    gather-then-sum, with and without dropped pairs (their tokens' rows stay exactly zero where all slots
    dropped)."""
    from megatron_ext.moe.dispatcher import sum_slot_grads

    rows, _, source, _ = make_case(37, 4, 300, dropped, torch.float32, seed=dropped)
    kernel = sum_slot_grads(rows, source, 37, 4, use_kernel=True)
    plain = sum_slot_grads(rows, source, 37, 4, use_kernel=False)
    torch.testing.assert_close(kernel, plain, rtol=1e-6, atol=1e-6)
    assert kernel.abs().sum() > 0
