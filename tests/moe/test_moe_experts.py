import pytest
import torch
import torch.nn.functional as F

from megatron_ext.moe.experts import GroupedExperts, ffn, grouped_ffn, grouped_mm_supported
from tests.moe.test_moe_router import moe_config


def _operands(num_experts=4, hidden=16, ffn_hidden=8, gated=True, counts=(5, 0, 7, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), hidden, generator=g)
    w1 = torch.randn(num_experts, hidden, (2 if gated else 1) * ffn_hidden, generator=g) * 0.3
    w2 = torch.randn(num_experts, ffn_hidden, hidden, generator=g) * 0.3
    return x, w1, w2, torch.tensor(counts)


def _fwd_bwd(use_grouped_mm, x, w1, w2, counts, gated):
    x, w1, w2 = (t.clone().requires_grad_() for t in (x, w1, w2))
    out = grouped_ffn(x, w1, w2, counts, F.silu, gated, use_grouped_mm)
    # A plain sum gives an expanded (stride-0) gradient, which _grouped_mm's backward rejects
    # unless we make it contiguous: keep it in the test.
    (out.sum() + (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()).backward()
    return out, x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_mm_matches_per_expert_loop_fwd_and_grads(gated):
    x, w1, w2, counts = _operands(gated=gated)
    assert grouped_mm_supported(x, w1, w2)
    grouped = _fwd_bwd(True, x, w1, w2, counts, gated)
    loop = _fwd_bwd(False, x, w1, w2, counts, gated)
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b)
    # And the loop is the per-token definition.
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    direct = torch.stack([ffn(x[i], w1[e], w2[e], F.silu, gated) for i, e in enumerate(expert_of_row)])
    torch.testing.assert_close(loop[0], direct)


def test_grouped_mm_support_check_rejects_misaligned_and_fp64():
    x, w1, w2, _ = _operands(ffn_hidden=6)  # 6 * 4 bytes is not 16-byte aligned
    assert not grouped_mm_supported(x, w1, w2)
    x, w1, w2, _ = _operands()
    assert not grouped_mm_supported(x.double(), w1.double(), w2.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_grouped_mm_runs_in_fp32_and_bf16(dtype):
    x, w1, w2, counts = (t.to(dtype) if t.is_floating_point() else t for t in _operands())
    out = grouped_ffn(x, w1, w2, counts, F.silu, True, use_grouped_mm=True)
    ref = grouped_ffn(x.float(), w1.float(), w2.float(), counts, F.silu, True, use_grouped_mm=False)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.float(), ref, **tol)


def test_gated_silu_goes_through_swiglu_and_other_activations_keep_plain_ops(monkeypatch):
    from megatron_ext.moe import experts

    h = torch.randn(7, 16)
    a, b = h.chunk(2, -1)
    # CPU fp32: the reference, numerically the ops this replaced.
    assert torch.equal(experts._activate(h, F.silu, True), F.silu(a) * b)
    calls = []
    monkeypatch.setattr(experts, "swiglu", lambda t: calls.append(t) or F.silu(t.chunk(2, -1)[0]))
    experts._activate(h, F.silu, True)
    ffn(h, torch.randn(16, 16), torch.randn(8, 16), F.silu, True)  # the loop fallback: same path
    assert len(calls) == 2
    assert torch.equal(experts._activate(h, F.gelu, True), F.gelu(a) * b)
    assert torch.equal(experts._activate(h, F.silu, False), F.silu(h))
    assert len(calls) == 2


def test_expert_params_are_marked_for_expert_data_parallel_and_follow_init_std():
    experts = GroupedExperts(moe_config(init_method_std=0.3), 8, None, None, seed=7)
    assert experts.w1.shape == (8, 16, 16) and experts.w2.shape == (8, 8, 16)
    for p in (experts.w1, experts.w2):
        assert p.allreduce is False
    assert 0.25 < experts.w1.std() < 0.35  # init_method: normal(0, 0.3)
    again = GroupedExperts(moe_config(init_method_std=0.3), 8, None, None, seed=7)
    assert torch.equal(again.w1, experts.w1)


@pytest.mark.gpu
def test_grouped_mm_matches_loop_on_gpu_in_bf16():
    x, w1, w2, counts = (t.cuda() for t in _operands(hidden=64, ffn_hidden=32, counts=(40, 0, 70, 30)))
    x, w1, w2 = x.bfloat16(), w1.bfloat16(), w2.bfloat16()
    assert grouped_mm_supported(x, w1, w2)
    out = grouped_ffn(x, w1, w2, counts, F.silu, True, use_grouped_mm=True)
    ref = grouped_ffn(x.float(), w1.float(), w2.float(), counts, F.silu, True, use_grouped_mm=False)
    # bf16 operands: relative error between 1e-3 and 1e-2 is bf16 rounding, not a bug.
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
