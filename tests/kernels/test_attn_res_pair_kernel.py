"""Paired depth-attention backward (kimi_kernels/attn_res/pair.py) and the preload backward kernel, on
the CPU interpreter (fp32): grads equal the unpaired kernels' and the ``torch`` path's.

The cases run in a ``TRITON_INTERPRET=1`` subprocess started by ``test_cases_under_interpreter``.
"""

import pytest
import torch

from kimi_kernels.attn_res import DepthPair, depth_attention, track_source_grad
from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

TOKENS, HIDDEN = 21, 48  # h pads to 64: masked columns


def _leaves(num_blocks, first_partial, fused_norm, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = [(torch.randn(TOKENS, HIDDEN, generator=gen) * (0.5 + i)).requires_grad_(True) for i in range(num_blocks)]
    partial = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_(True) if first_partial else None
    params = []
    for _ in range(3):  # first call, second call, a later "final" call reading every block
        query = (torch.randn(HIDDEN, generator=gen) * 0.5).requires_grad_(True)
        gamma = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).requires_grad_(True)
        gamma_o = (1 + 0.3 * torch.randn(HIDDEN, generator=gen)).requires_grad_(True) if fused_norm else None
        params.append((query, gamma, gamma_o))
    weights = [torch.randn(TOKENS, HIDDEN, generator=gen) for _ in range(3)]
    return blocks, partial, params, weights


def _layer(impl, paired, num_blocks, first_partial, fused_norm, seed=0, with_final=True):
    """A layer as the model runs it: mix 1 over the (tracked) blocks (+ a partial sum), a stand-in
    sublayer, its output added to the partial sum, mix 2 over the blocks + that partial; a final
    mix over the blocks is differentiated first (so the blocks' grads are accumulated into).
    Returns the grads of every leaf."""
    blocks, partial, params, weights = _leaves(num_blocks, first_partial, fused_norm, seed)
    tracked = [track_source_grad(b) for b in blocks]
    sources = [t for t, _ in tracked]
    grads = [g for _, g in tracked]
    link = DepthPair(params[1][0], params[1][1]) if paired else None

    def mix(srcs, sgs, k, role):
        query, gamma, gamma_o = params[k]
        return depth_attention(srcs, query, gamma, eps=1e-6, impl=impl, source_grads=sgs, out_norm_weight=gamma_o,
                               out_norm_eps=1e-5, pair=role)

    first_sources = sources + ([partial] if partial is not None else [])
    first_grads = grads + ([None] if partial is not None else [])
    x = mix(first_sources, first_grads, 0, link.first if link else None)
    new = torch.tanh(x) * 0.7  # the sublayer
    p = new if partial is None else partial + new
    y = mix(sources + [p], grads + [None], 1, link.second if link else None)
    loss = (y * weights[1]).sum() + (torch.sigmoid(x) * weights[0]).sum()
    if with_final:
        loss = loss + (mix(sources, grads, 2, None) * weights[2]).sum()
    leaves = blocks + ([partial] if partial is not None else []) + [t for prm in params for t in prm if t is not None]
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _compare(got, want, rtol=1e-4, atol=1e-5):
    """atol relative to each tensor's largest value (fp32 sums over h and tokens of large terms)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None or not a.any(), i
            continue
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale, msg=f"leaf {i}")


@interpreter_case
@pytest.mark.parametrize("fused_norm", [False, True], ids=["mix", "mix+rmsnorm"])
@pytest.mark.parametrize("num_blocks, first_partial", [(1, False), (3, False), (2, True)])
def test_paired_backward_equals_unpaired_and_torch(num_blocks, first_partial, fused_norm):
    args = (num_blocks, first_partial, fused_norm)
    paired = _layer("triton", True, *args)
    unpaired = _layer("triton", False, *args)
    reference = _layer("torch", False, *args)
    _compare(paired, reference)
    _compare(unpaired, reference)
    # the paired second call takes the softmax backward's c from its stored output, the unpaired preload
    # kernel from the sources (docs/attn_res.md, Precision of c): equal to that output's amplified rounding
    _compare(paired, unpaired)


@interpreter_case
def test_paired_backward_without_a_later_reader():
    # No final mix: the pair's backward is the first contribution to the blocks (plain writes).
    _compare(_layer("triton", True, 3, False, True, with_final=False),
             _layer("torch", False, 3, False, True, with_final=False))


@interpreter_case
def test_untracked_or_different_sources_are_not_paired():
    blocks, _, params, _ = _leaves(2, False, False, 3)
    link = DepthPair(params[1][0], params[1][1])
    x = depth_attention(blocks, params[0][0], params[0][1], impl="triton", pair=link.first)
    y = depth_attention(blocks + [torch.tanh(x)], params[1][0], params[1][1], impl="triton", pair=link.second)
    got = torch.autograd.grad(y.sum(), blocks + [params[1][0]])
    x = depth_attention(blocks, params[0][0], params[0][1], impl="triton")
    y = depth_attention(blocks + [torch.tanh(x)], params[1][0], params[1][1], impl="triton")
    _compare(got, torch.autograd.grad(y.sum(), blocks + [params[1][0]]))


@interpreter_case
@pytest.mark.parametrize("fused_norm", [True, False], ids=["mix+rmsnorm", "mix"])
def test_deferred_grads_never_collected_raise(fused_norm):
    # The second call defers the shared blocks' grads to the first, whose backward never runs
    # here (its output does not reach the loss): taking the blocks' sums must fail loudly. Calls without
    # the fused norm are not paired (their c would come from a bf16 output): nothing is deferred.
    blocks, partial, params, _ = _leaves(2, True, fused_norm, 4)
    tracked = [track_source_grad(b) for b in blocks]
    sources, grads = [t for t, _ in tracked], [g for _, g in tracked]
    link = DepthPair(params[1][0], params[1][1])
    depth_attention(sources, params[0][0], params[0][1], impl="triton", source_grads=grads, pair=link.first,
                    out_norm_weight=params[0][2])
    y = depth_attention(sources + [partial], params[1][0], params[1][1], impl="triton",
                        source_grads=grads + [None], pair=link.second, out_norm_weight=params[1][2])
    if fused_norm:
        with pytest.raises(RuntimeError, match="deferred"):
            torch.autograd.grad(y.sum(), blocks)
        return
    got = torch.autograd.grad(y.sum(), blocks)
    y = depth_attention(blocks + [partial], params[1][0], params[1][1], impl="torch")
    _compare(got, torch.autograd.grad(y.sum(), blocks))


@interpreter_case
@pytest.mark.parametrize("hidden", [32, 80])
def test_backward_kernel_matches_reference(hidden):
    # n in {1, 4, 9}, h a power of two or not.
    from kimi_kernels.attn_res import depth_attention_reference

    gen = torch.Generator().manual_seed(hidden)
    for n in (1, 4, 9):
        v = (torch.randn(n, 13, hidden, generator=gen) * (torch.rand(n, 1, 1, generator=gen) * 3 + 0.2))
        w = torch.randn(hidden, generator=gen) * 0.5
        g = 1 + 0.3 * torch.randn(hidden, generator=gen)
        dy = torch.randn(13, hidden, generator=gen)
        results = []
        for impl in ("triton", "reference"):
            leaves = [t.clone().requires_grad_(True) for t in (v, w, g)]
            srcs = list(leaves[0].unbind(0))
            out = (depth_attention(srcs, leaves[1], leaves[2], impl="triton") if impl == "triton"
                   else depth_attention_reference(leaves[0], leaves[1], leaves[2]))
            results.append((out, *torch.autograd.grad(out, leaves, dy)))
        _compare(results[0], results[1])


def _two_source_layer_grads(dtype, impl, paired=False, tokens=64, hidden=512):
    """Grads of one block, a one-source mix, a two-source mix over the block and the (bf16-rounded) first
    mix's tanh, with the fused output norm, and a final one-source mix: the case where the softmax backward's
    c = sum_i a_i (dout . v_i) is a difference of close numbers. ``paired``: the two mixes share their
    backward over the block (``DepthPair``), the second one's c then comes from its saved output."""
    gen = torch.Generator().manual_seed(5)
    block = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype).requires_grad_(True)
    params = [[(torch.randn(hidden, generator=gen) * 0.3).requires_grad_(True),
               (1 + 0.2 * torch.randn(hidden, generator=gen)).requires_grad_(True),
               (1 + 0.2 * torch.randn(hidden, generator=gen)).requires_grad_(True)] for _ in range(3)]
    weights = [torch.randn(tokens, hidden, generator=gen) for _ in range(2)]
    source, source_grad = track_source_grad(block)
    link = DepthPair(*params[1][:2]) if paired else None
    x = depth_attention([source], *params[0][:2], impl=impl, source_grads=[source_grad],
                        out_norm_weight=params[0][2], pair=link.first if paired else None)
    p = torch.tanh(x.float()).to(dtype)
    y = depth_attention([source, p], *params[1][:2], impl=impl, source_grads=[source_grad, None],
                        out_norm_weight=params[1][2], pair=link.second if paired else None)
    z = depth_attention([source], *params[2][:2], impl=impl, source_grads=[source_grad],
                        out_norm_weight=params[2][2])
    loss = (y.float() * weights[0]).sum() + (z.float() * weights[1]).sum()
    return torch.autograd.grad(loss, [block] + params[1])  # the block, the two-source mix's parameters


@interpreter_case
@pytest.mark.parametrize("paired", [False, True], ids=["unpaired", "pair"])  # paired: c from the fp32 output
def test_bf16_two_source_mix_grads_as_precise_as_torch_bf16(paired):
    """bf16 in the interpreter (these kernels have no tl.dot, so its bf16 is the GPU's): every grad within 2x
    the error of PyTorch's bf16 autograd (+ 5e-3) against fp32."""
    want = _two_source_layer_grads(torch.float32, "torch")
    torch_bf16 = _two_source_layer_grads(torch.bfloat16, "torch")
    got = _two_source_layer_grads(torch.bfloat16, "triton", paired=paired)

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    for i, (g, w, t) in enumerate(zip(got, want, torch_bf16)):
        assert rel(g, w) <= 2 * rel(t, w) + 5e-3, f"grad {i}: {rel(g, w):.3e} vs bf16 torch {rel(t, w):.3e}"
