"""The forward's launch choices on the CPU interpreter: the row sums of 1, 2 or 4 sources in one reduction
(``sources_per_reduction`` of ``fused.FORWARD_LAUNCH``, here for every width) give the shipped table's ``out``,
``lse`` (and with the fused output norm ``normed`` and its rstd) up to the order of the sums and are close to the
plain PyTorch reference's (``naive.py``); in bf16 and fp16 the rows loaded as int32 pairs (aligned sources) give
the unpacked loads' results (sources 2-byte aligned only) bit for bit. n in {1, 4, 9}, with and without the norm,
one or two tokens per tile (h = 24 pads to 32: masked columns), token counts that are not a multiple of the tile.

The cases run in a ``TRITON_INTERPRET=1`` subprocess started by ``test_cases_under_interpreter``.
"""

import dataclasses

import pytest
import torch

from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

HIDDEN, EPS, OUT_NORM_EPS = 24, 1e-6, 1e-5
VARIANTS = {"shipped": None, "batch1": 1, "batch2": 2, "batch4": 4}  # sources per reduction for every width
# (n, tokens, tokens per tile): 1 row per tile as at h = 2048, 2 rows per tile with a partial last tile
CASES = ((1, 5, 1), (4, 1, 1), (4, 7, 2), (9, 5, 1), (9, 7, 2))
CASES_16_BIT = ((1, 5, 1), (4, 7, 2), (9, 5, 1))


def _unaligned(t):
    """``t``'s values in a tensor 2-byte but not 4-byte aligned: its rows are not loaded as int32 pairs."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    return view


def _inputs(n, tokens, norm, dtype):
    gen = torch.Generator().manual_seed(100 * n + 10 * tokens + norm)
    sources = [(torch.randn(tokens, HIDDEN, generator=gen) * (0.3 + i)).to(dtype) for i in range(n)]
    query, gamma = torch.randn(HIDDEN, generator=gen) * 0.5, 1 + 0.3 * torch.randn(HIDDEN, generator=gen)
    gamma_o = 1 + 0.3 * torch.randn(HIDDEN, generator=gen) if norm else None
    return sources, query, gamma, gamma_o


def _forward(variant, rows_per_tile, sources, query, gamma, gamma_o):
    """(out, lse, normed, out_rstd) of one forward launch of ``variant``."""
    import kimi_kernels.attn_res.fused as fused

    launch = dataclasses.replace(fused.FORWARD_LAUNCH, tile_elements=32 * rows_per_tile)  # BLOCK_H = 32
    if VARIANTS[variant] is not None:
        launch = dataclasses.replace(launch, sources_per_reduction=fused.ByWidth(((1, VARIANTS[variant]),)))
    return fused.fused_depth_attention_forward(sources, query, gamma, EPS, gamma_o, OUT_NORM_EPS, launch=launch)


def _reference(sources, query, gamma, gamma_o):
    """(out, lse, normed, out_rstd) in fp32 by plain PyTorch."""
    from kimi_kernels.attn_res import depth_attention_norm_reference, depth_attention_reference

    stack = torch.stack(sources)
    v = stack.float()
    logits = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * gamma * query).sum(-1)  # [n, T]
    out = depth_attention_reference(stack, query, gamma, EPS)
    if gamma_o is None:
        return out, torch.logsumexp(logits, 0), None, None
    return (out, torch.logsumexp(logits, 0), depth_attention_norm_reference(stack, query, gamma, gamma_o, EPS,
            OUT_NORM_EPS), torch.rsqrt(out.float().pow(2).mean(-1) + OUT_NORM_EPS))


_DEFAULTS = {}  # the default kernel's results per case, computed once for all variants


def _default(n, tokens, rows_per_tile, norm, dtype):
    key = (n, tokens, rows_per_tile, norm, dtype)
    if key not in _DEFAULTS:
        _DEFAULTS[key] = _forward("shipped", rows_per_tile, *_inputs(n, tokens, norm, dtype))
    return _DEFAULTS[key]


@interpreter_case
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("norm", [False, True], ids=["mix", "mix+rmsnorm"])
def test_forward_variant_equals_default_and_reference_fp32(variant, norm):
    names = ("out", "lse", "normed", "out_rstd")
    for n, tokens, rows_per_tile in CASES:
        inputs = _inputs(n, tokens, norm, torch.float32)
        got = _forward(variant, rows_per_tile, *inputs)
        want, ref = _default(n, tokens, rows_per_tile, norm, torch.float32), _reference(*inputs)
        for name, a, b, r in zip(names, got, want, ref):
            assert (a is None) == (b is None) == (r is None) == (not norm and name in ("normed", "out_rstd"))
            if a is not None:
                what = f"n={n} T={tokens} rows/tile={rows_per_tile} {name}"
                # the same sums, added in another order (several sources' at once)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(),
                                           msg=f"{what} vs default")
                torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=f"{what} vs reference")


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_rows_equal_unpacked_bit_for_bit_in_16_bit(dtype):
    # 2-byte rows loaded as int32 pairs and unpacked (bf16 by shifts, fp16 by bitcasts) are the unpacked loads'
    # values exactly: every output equal, not just close.
    for n, tokens, rows_per_tile in CASES_16_BIT:
        for norm in (False, True):
            sources, *params = _inputs(n, tokens, norm, dtype)
            got = _forward("shipped", rows_per_tile, [_unaligned(v) for v in sources], *params)
            want = _default(n, tokens, rows_per_tile, norm, dtype)
            assert got[0].dtype == dtype and (got[2] is None or got[2].dtype == dtype)
            for a, b in zip(got, want):
                assert (a is None and b is None) or torch.equal(a, b), (n, tokens, rows_per_tile, norm)
