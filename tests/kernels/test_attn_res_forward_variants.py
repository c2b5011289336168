"""The forward kernel's opt-in variants (``fused.FORWARD_PACK_ROWS``, ``fused.FORWARD_NEXT_TILE``) on the CPU
interpreter: in fp32 every variant's ``out``, ``lse`` (and with the fused output norm ``normed`` and its rstd)
equal the default kernel's bit for bit and are close to the plain PyTorch reference's (``naive.py``); in bf16 and
fp16 the packed variants' are the default's bit for bit (the int32-pair loads unpack to the same values; the
persistent grid only deals the tiles out differently over programs). n in {1, 4, 9}, with and without the norm, one or two tokens per tile (h = 24 pads to 32:
masked columns), token counts that are not a multiple of the tile and fewer tiles than the interpreter's two
persistent programs.

The cases run in a ``TRITON_INTERPRET=1`` subprocess started by ``test_cases_under_interpreter``.
"""

import pytest
import torch

from tests.kernels.interpreter import interpreter_case, launcher_test

test_cases_under_interpreter = launcher_test(__file__)

HIDDEN, EPS, OUT_NORM_EPS = 24, 1e-6, 1e-5
VARIANTS = {  # the code paths of tools/sweep_attnres_kernels.py's "fwd-pack*" / "fwd-next*" configs
    "pack": {"FORWARD_PACK_ROWS": True},
    "next1": {"FORWARD_NEXT_TILE": 1},
    "next1-pack": {"FORWARD_NEXT_TILE": 1, "FORWARD_PACK_ROWS": True},
    "next2": {"FORWARD_NEXT_TILE": 2},
    "next2-pack": {"FORWARD_NEXT_TILE": 2, "FORWARD_PACK_ROWS": True},
    # the row sums of 1 / 2 / 4 sources in one reduction for every call (the default picks by the call's width)
    "batch1": {"FORWARD_SOURCES_PER_REDUCTION": 1},
    "batch2": {"FORWARD_SOURCES_PER_REDUCTION": 2},
    "batch4": {"FORWARD_SOURCES_PER_REDUCTION": 4},
    "next1-batch2": {"FORWARD_NEXT_TILE": 1, "FORWARD_SOURCES_PER_REDUCTION": 2},
}
# (n, tokens, tokens per tile): 1 row per tile as at h = 2048 (two persistent programs: 3 and 2 tiles), fewer
# tiles than programs, 2 rows per tile with a partial last tile (the "2rows" layouts)
CASES = ((1, 5, 1), (4, 1, 1), (4, 7, 2), (9, 5, 1), (9, 7, 2))
CASES_16_BIT = ((1, 5, 1), (4, 7, 2), (9, 5, 1))  # fewer (time): the tile walk is checked in fp32
# fp32 rows are never packed (4-byte elements): there the "-pack" variants run the unpacked ones' code, and in 16
# bits the unpacked ones the default's maths (checked in fp32), so each code path is checked once per dtype
FP32_VARIANTS = [name for name in VARIANTS if "pack" not in name]
PACKED_VARIANTS = [name for name in VARIANTS if "pack" in name]


def _inputs(n, tokens, norm, dtype):
    gen = torch.Generator().manual_seed(100 * n + 10 * tokens + norm)
    sources = [(torch.randn(tokens, HIDDEN, generator=gen) * (0.3 + i)).to(dtype) for i in range(n)]
    query, gamma = torch.randn(HIDDEN, generator=gen) * 0.5, 1 + 0.3 * torch.randn(HIDDEN, generator=gen)
    gamma_o = 1 + 0.3 * torch.randn(HIDDEN, generator=gen) if norm else None
    return sources, query, gamma, gamma_o


def _forward(changes, rows_per_tile, sources, query, gamma, gamma_o):
    """(out, lse, normed, out_rstd) of one forward launch with the fused.py ``changes``."""
    import kernels.attn_res.fused as fused

    changes = {**changes, "FORWARD_TILE_ELEMENTS": 32 * rows_per_tile}  # BLOCK_H = 32
    saved = {name: getattr(fused, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(fused, name, value)
        return fused.fused_depth_attention_forward(sources, query, gamma, EPS, gamma_o, OUT_NORM_EPS)
    finally:
        for name, value in saved.items():
            setattr(fused, name, value)


def _reference(sources, query, gamma, gamma_o):
    """(out, lse, normed, out_rstd) in fp32 by plain PyTorch."""
    from kernels.attn_res import depth_attention_norm_reference, depth_attention_reference

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
        _DEFAULTS[key] = _forward({}, rows_per_tile, *_inputs(n, tokens, norm, dtype))
    return _DEFAULTS[key]


@interpreter_case
@pytest.mark.parametrize("variant", FP32_VARIANTS)
@pytest.mark.parametrize("norm", [False, True], ids=["mix", "mix+rmsnorm"])
def test_forward_variant_equals_default_and_reference_fp32(variant, norm):
    names = ("out", "lse", "normed", "out_rstd")
    for n, tokens, rows_per_tile in CASES:
        inputs = _inputs(n, tokens, norm, torch.float32)
        got = _forward(VARIANTS[variant], rows_per_tile, *inputs)
        want, ref = _default(n, tokens, rows_per_tile, norm, torch.float32), _reference(*inputs)
        for name, a, b, r in zip(names, got, want, ref):
            assert (a is None) == (b is None) == (r is None) == (not norm and name in ("normed", "out_rstd"))
            if a is not None:
                what = f"n={n} T={tokens} rows/tile={rows_per_tile} {name}"
                if "batch" in variant:  # the same sums, added in another order (several sources' at once)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(),
                                               msg=f"{what} vs default")
                else:
                    assert torch.equal(a, b), f"{what} vs default"  # the same maths per tile, wherever it runs
                torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=f"{what} vs reference")


@interpreter_case
@pytest.mark.parametrize("variant", PACKED_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_forward_variant_equals_default_bit_for_bit_in_16_bit(variant, dtype):
    # 2-byte rows loaded as int32 pairs and unpacked (bf16 by shifts, fp16 by bitcasts) are the default's values
    # exactly, and each tile's maths is the same wherever it runs: every output equal, not just close.
    for n, tokens, rows_per_tile in CASES_16_BIT:
        for norm in (False, True):
            got = _forward(VARIANTS[variant], rows_per_tile, *_inputs(n, tokens, norm, dtype))
            want = _default(n, tokens, rows_per_tile, norm, dtype)
            assert got[0].dtype == dtype and (got[2] is None or got[2].dtype == dtype)
            for a, b in zip(got, want):
                assert (a is None and b is None) or torch.equal(a, b), (n, tokens, rows_per_tile, norm)
