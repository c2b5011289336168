"""The backward's launch choices on the CPU interpreter (fp32): the row sums of 1, 2 or 4 sources in one reduction
(``sources_per_reduction`` of ``fused.BACKWARD_LAUNCH``, here for every width) give the shipped table's source
grads and sums and the plain autograd reference's, for n in {1, 4, 9}, with and without the fused output norm,
accumulated into or not, unpaired and paired (with the second call's own-source ``subset`` pass), one token per
tile as at h = 2048 on the GPU (a launch table with 32-element tiles), so each program walks several tiles;
token counts that are not a multiple of the tile, and fewer tiles than the interpreter's two programs. In 16 bits
the rows loaded as int32 pairs (aligned inputs) give the unpacked loads' results (inputs 2-byte aligned only)
bit for bit.

The cases run in a ``TRITON_INTERPRET=1`` subprocess started by ``test_cases_under_interpreter``.
"""

import dataclasses

import pytest
import torch

from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

HIDDEN, EPS, OUT_NORM_EPS = 24, 1e-6, 1e-5  # h pads to 32: masked columns
# sources per row reduction for every call width ("shipped": the table by width)
VARIANTS = {"shipped": None, "batch1": 1, "batch2": 2, "batch4": 4}


def _launch(fused, variant):
    """The shipped backward launch table with one token per tile (BLOCK_H = 32) and ``variant``'s sources per
    reduction."""
    launch = dataclasses.replace(fused.BACKWARD_LAUNCH, tile_elements=32)
    if VARIANTS[variant] is not None:
        launch = dataclasses.replace(launch, sources_per_reduction=fused.ByWidth(((1, VARIANTS[variant]),)))
    return launch


def _unaligned(t):
    """``t``'s values in a tensor 2-byte but not 4-byte aligned: its rows are not loaded as int32 pairs."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    return view


def _call(gen, n, tokens, norm, dtype=torch.float32, unaligned=False):
    """Inputs of one call: sources, query, gamma, gamma_o (or None), dy (``unaligned``: sources not 4-byte
    aligned)."""
    sources = [(torch.randn(tokens, HIDDEN, generator=gen) * (0.3 + i)).to(dtype) for i in range(n)]
    if unaligned:
        sources = [_unaligned(v) for v in sources]
    query, gamma = torch.randn(HIDDEN, generator=gen) * 0.5, 1 + 0.3 * torch.randn(HIDDEN, generator=gen)
    gamma_o = 1 + 0.3 * torch.randn(HIDDEN, generator=gen) if norm else None
    return sources, query, gamma, gamma_o, torch.randn(tokens, HIDDEN, generator=gen).to(dtype)


def _forward(fused, sources, query, gamma, gamma_o):
    out, lse, _, rstd = fused.fused_depth_attention_forward(sources, query, gamma, EPS, gamma_o, OUT_NORM_EPS)
    return out, lse, rstd


def _reference(sources, query, gamma, gamma_o, dy):
    """(source grads, query grad, gamma grad, gamma_o grad) by plain autograd (naive.py)."""
    from kimi_kernels.attn_res import depth_attention_norm_reference, depth_attention_reference

    params = (query, gamma) + ((gamma_o,) if gamma_o is not None else ())
    leaves = [torch.stack(sources).requires_grad_(True)] + [p.clone().requires_grad_(True) for p in params]
    y = (depth_attention_norm_reference(*leaves, EPS, OUT_NORM_EPS) if gamma_o is not None
         else depth_attention_reference(*leaves, EPS))
    grads = torch.autograd.grad(y, leaves, dy)
    return list(grads[0].unbind(0)), *grads[1:]


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()), msg=what)


def _backward(fused, variant, *args, olds, accumulate, **kwargs):
    """Source grads (accumulated into copies of ``olds``) and sums of one backward launch of ``variant``."""
    from kimi_kernels.attn_res.backward import fused_depth_attention_backward_sums as backward_sums

    grads = [o.clone() for o in olds]
    sums = backward_sums(*args, grads, accumulate, launch=_launch(fused, variant), **kwargs)
    return grads, sums


_DEFAULTS = {}  # the default kernel's results per case, computed once for all variants


def _unpaired(fused, variant, n, tokens, norm, dtype=torch.float32, unaligned=False):
    gen = torch.Generator().manual_seed(100 * n + 10 * tokens + norm)
    sources, query, gamma, gamma_o, dy = _call(gen, n, tokens, norm, dtype, unaligned)
    out, lse, rstd = _forward(fused, sources, query, gamma, gamma_o)
    olds = [torch.randn(tokens, HIDDEN, generator=gen).to(dtype) for _ in range(n)]
    accumulate = [i % 2 == 1 for i in range(n)]
    result = _backward(fused, variant, sources, query, gamma, EPS, out, lse, dy, olds=olds, accumulate=accumulate,
                       out_norm_weight=gamma_o, out_norm_eps=OUT_NORM_EPS, out_rstd=rstd, need_out_norm_weight=norm,
                       parameter_grads=True)
    return result, (sources, query, gamma, gamma_o, dy), olds, accumulate


@interpreter_case
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("norm", [False, True], ids=["mix", "mix+rmsnorm"])
def test_variant_equals_default_and_reference(variant, norm):
    import kimi_kernels.attn_res.fused as fused

    # one token per tile (BLOCK_H = 32); the interpreter runs two programs: 2 and 3 tiles each, and one tile
    for n, tokens in ((1, 3), (4, 1), (9, 5)):
        (grads, sums), inputs, olds, accumulate = _unpaired(fused, variant, n, tokens, norm)
        if (n, norm) not in _DEFAULTS:
            _DEFAULTS[n, norm] = _unpaired(fused, "shipped", n, tokens, norm)[0]
        default_grads, default_sums = _DEFAULTS[n, norm]
        ref_grads, ref_query, ref_gamma, *ref_gamma_o = _reference(*inputs)
        for i in range(n):
            _close(grads[i], default_grads[i], f"n={n} grad {i} vs default")
            _close(grads[i], ref_grads[i] + (olds[i] if accumulate[i] else 0), f"n={n} grad {i} vs reference")
        refs = [("query", ref_query), ("norm_weight", ref_gamma)] + [("out_norm_weight", g) for g in ref_gamma_o]
        for name, ref in refs:
            _close(getattr(sums, f"grad_{name}"), getattr(default_sums, f"grad_{name}"), f"n={n} {name} vs default")
            _close(getattr(sums, f"grad_{name}"), ref, f"n={n} {name} vs reference")


def _paired(fused, variant, shared, tokens, norm, dtype=torch.float32, extra=0, unaligned=False):
    """A pair as pair.py runs it: the second call's own source (a subset pass over its lse), then the first
    call with the second's grads over the shared sources (accumulated into; the own source's grad written).
    ``extra``: the first call has that many sources of its own after the shared ones (the model's pairs have
    none; the kernel takes them). Returns (grads, g, g_out_norm, g2, g_out_norm2) and the two calls' inputs, and
    the old grads."""
    from kimi_kernels.attn_res import backward

    gen = torch.Generator().manual_seed(100 * shared + 10 * tokens + norm + 1000 * extra)
    sources, query, gamma, gamma_o, dy = _call(gen, shared + extra, tokens, norm, dtype, unaligned)
    own = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    if unaligned:
        own = _unaligned(own)
    sources2, query2, gamma2, gamma_o2, dy2 = sources[:shared] + [own], *_call(gen, 0, tokens, norm, dtype)[1:]
    out, lse, rstd = _forward(fused, sources, query, gamma, gamma_o)
    out2, lse2, rstd2 = _forward(fused, sources2, query2, gamma2, gamma_o2)
    out2 = out2.float()  # the second call of a pair saves its output in fp32 (function.py, out_dtype)
    olds = [torch.randn(tokens, HIDDEN, generator=gen).to(dtype) for _ in range(shared + extra)]
    norm_kwargs = dict(out_norm_eps=OUT_NORM_EPS, need_out_norm_weight=norm)
    handoff = torch.empty_like(dy2), torch.empty_like(lse2)
    own_grad, own_sums = _backward(fused, variant, [own], query2, gamma2, EPS, out2, lse2, dy2, olds=[own],
                                   accumulate=[False], out_norm_weight=gamma_o2, out_rstd=rstd2, subset=True,
                                   handoff=handoff, **norm_kwargs)
    pair = backward.PairedCall(shared, query2, gamma2, lse2, *handoff)
    grads, sums = _backward(fused, variant, sources, query, gamma, EPS, out, lse, dy, olds=olds,
                            accumulate=[True] * (shared + extra), out_norm_weight=gamma_o, out_rstd=rstd, paired=pair,
                            **norm_kwargs)
    result = (grads + own_grad, sums.g, sums.g_out_norm, sums.g2 + own_sums.g, own_sums.g_out_norm)
    return result, (sources, query, gamma, gamma_o, dy), (sources2, query2, gamma2, gamma_o2, dy2), olds


@interpreter_case
@pytest.mark.parametrize("variant", ["batch1", "batch2", "batch4"])
def test_paired_variant_equals_default_and_reference(variant, norm=True):
    # pair.py pairs calls with the fused norm only (the second call's c then comes from its fp32 output)
    import kimi_kernels.attn_res.fused as fused

    # (shared, the first call's own sources, tokens): batches of 2 / 4 sources padded, exact, and across
    # the shared sources' end
    for shared, extra, tokens in ((1, 0, 6), (4, 0, 7), (3, 2, 5)):
        got, inputs, inputs2, olds = _paired(fused, variant, shared, tokens, norm, extra=extra)
        key = ("pair", shared, extra, norm)
        if key not in _DEFAULTS:
            _DEFAULTS[key] = _paired(fused, "shipped", shared, tokens, norm, extra=extra)[0]
        for k, (a, b) in enumerate(zip(got, _DEFAULTS[key])):
            for j, (x, y) in enumerate(zip(a, b) if isinstance(a, list) else [(a, b)]):
                assert (x is None) == (y is None)
                if y is not None:
                    _close(x, y, f"shared={shared} result {k}.{j} vs default")
        ref, ref2 = _reference(*inputs), _reference(*inputs2)
        for i in range(shared + extra):
            want = olds[i] + ref[0][i] + (ref2[0][i] if i < shared else 0)
            _close(got[0][i], want, f"shared={shared} extra={extra} grad {i} vs reference")
        _close(got[0][shared + extra], ref2[0][shared], f"shared={shared} own grad vs reference")
        _close(got[1] * inputs[2], ref[1], "query vs reference")  # dw = g gamma
        _close(got[3] * inputs2[2], ref2[1], "second query vs reference")
        if norm:
            _close(got[2], ref[3], "out norm weight vs reference")
            _close(got[4], ref2[3], "second out norm weight vs reference")


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_rows_equal_unpacked_in_16_bit(dtype):
    # Rows loaded as int32 pairs and unpacked (bf16 by shifts, fp16 by bitcasts) give the unpacked loads' values
    # exactly, so the same grads bit for bit; with the fused norm, paired (the second output in fp32) or not.
    import kimi_kernels.attn_res.fused as fused

    for n, tokens in ((2, 5), (9, 3)):
        (got, got_sums), *_ = _unpaired(fused, "shipped", n, tokens, True, dtype)
        (want, want_sums), *_ = _unpaired(fused, "shipped", n, tokens, True, dtype, unaligned=True)
        for a, b in zip(got + [got_sums.grad_query, got_sums.grad_out_norm_weight],
                        want + [want_sums.grad_query, want_sums.grad_out_norm_weight]):
            assert a.dtype == b.dtype and torch.equal(a, b), f"n={n}"
    got = _paired(fused, "shipped", 3, 5, True, dtype)[0]
    want = _paired(fused, "shipped", 3, 5, True, dtype, unaligned=True)[0]
    for a, b in zip(got[0] + list(got[1:]), want[0] + list(want[1:])):
        assert torch.equal(a, b)


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_handoff_is_the_rounded_mix_grad_and_its_own_softmax_sum(dtype):
    # A pair's second call hands the paired kernel its mix gradient (after its output norm's backward) rounded to
    # the sources' dtype, and c = that rounded gradient . out. c must be the softmax backward's own sum over every
    # source of the call for that gradient, sum_i a_i (dout . v_i), or the shared sources' dlogits carry the
    # rounding (docs/attn_res.md, "Precision of c").
    import kimi_kernels.attn_res.fused as fused
    from kimi_kernels.attn_res.backward import fused_depth_attention_backward_sums as backward_sums

    gen = torch.Generator().manual_seed(5)
    sources, query, gamma, gamma_o, dy = _call(gen, 3, 7, True, dtype)
    # the output of a pair's second call is written and saved in fp32 (function.py, out_dtype)
    out, lse, _, rstd = fused.fused_depth_attention_forward(sources, query, gamma, EPS, gamma_o, OUT_NORM_EPS,
                                                            torch.float32)
    handoff = torch.empty_like(dy), torch.empty_like(lse)
    grads = [torch.empty_like(sources[-1])]
    backward_sums(sources[-1:], query, gamma, EPS, out, lse, dy, grads, [False], gamma_o, OUT_NORM_EPS, rstd,
                  True, subset=True, handoff=handoff)
    grad_mix, c = handoff
    out64 = out.double().requires_grad_(True)
    normed = out64 * torch.rsqrt(out64.pow(2).mean(-1, keepdim=True) + OUT_NORM_EPS) * gamma_o.double()
    (want,) = torch.autograd.grad(normed, out64, dy.double())
    assert grad_mix.dtype == dtype
    torch.testing.assert_close(grad_mix.double(), want.to(dtype).double(), rtol=2 ** -7, atol=1e-6)
    keys = [v.double() * torch.rsqrt(v.double().pow(2).mean(-1, keepdim=True) + EPS) * gamma.double() for v in sources]
    a = torch.softmax(torch.stack([k @ query.double() for k in keys]), dim=0)
    own_sum = sum(a[i] * (grad_mix.double() * sources[i].double()).sum(-1) for i in range(3))
    scale = grad_mix.double().norm(dim=-1) * out.double().norm(dim=-1)
    assert ((c.double() - own_sum).abs() <= 1e-5 * scale).all(), (c, own_sum)
    assert ((c.double() - (grad_mix.double() * out.double()).sum(-1)).abs() <= 1e-6 * scale).all()


def test_rows_packed_only_where_even_and_aligned():
    import kimi_kernels.attn_res.fused as fused

    rows = torch.zeros(3, 16, dtype=torch.bfloat16)
    assert fused._packable(16, [rows], rows.float(), None)
    assert not fused._packable(15, [rows])  # odd h
    assert not fused._packable(16, [rows], torch.zeros(49, dtype=torch.bfloat16)[1:].view(3, 16))  # 2-byte aligned
    assert fused._packable(16, torch.zeros(49)[1:].view(3, 16))  # fp32: not packed, any alignment
    assert not fused._packable(16, [rows], (rows, torch.zeros(33, dtype=torch.float16)[1:].view(2, 16)))
