"""The dispatcher's token gather: same gradient as index_select, without index_add_ in the backward."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.moe.dispatcher import _GatherTokens


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _pairs(num_tokens, top_k, dropped, seed):
    """A random pair order over all (token, slot) ids with ``dropped`` of them cut off, and its inverse
    (``source``: the row of each pair, ``n_kept`` for a dropped one)."""
    g = torch.Generator().manual_seed(seed)
    pair_order = torch.randperm(num_tokens * top_k, generator=g)[: num_tokens * top_k - dropped]
    source = torch.full((num_tokens * top_k,), len(pair_order), dtype=torch.long)
    source[pair_order] = torch.arange(len(pair_order))
    return pair_order, source


def test_gather_gradient_equals_index_select_with_and_without_drops():
    g = torch.Generator().manual_seed(0)
    for dropped in (0, 7):
        hidden = torch.randn(13, 6, generator=g, dtype=torch.float64)
        pair_order, source = _pairs(13, 4, dropped, seed=dropped)
        cotangent = torch.randn(len(pair_order), 6, generator=g, dtype=torch.float64)
        a = hidden.clone().requires_grad_()
        out = _GatherTokens.apply(a, pair_order, source, 4)
        b = hidden.clone().requires_grad_()
        ref = b.index_select(0, pair_order // 4)
        assert torch.equal(out, ref)
        with _Ops() as ops:
            (out * cotangent).sum().backward()
        (ref * cotangent).sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
        assert "index_add" not in ops.names
        if dropped:  # tokens whose every slot was dropped get exactly zero
            kept_tokens = set((pair_order // 4).tolist())
            for t in set(range(13)) - kept_tokens:
                assert torch.count_nonzero(a.grad[t]) == 0


def test_bf16_gather_gradient_accumulates_in_fp32():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    pair_order, source = _pairs(64, 8, 0, seed=2)
    cotangent = torch.randn(len(pair_order), 32, generator=g).bfloat16()
    (_GatherTokens.apply(hidden, pair_order, source, 8).float() * cotangent.float()).sum().backward()
    exact = torch.zeros(64, 32, dtype=torch.float64).index_add_(0, pair_order // 8, cotangent.double())
    # one rounding of the fp32 sum: within half a bf16 ulp of the exact sum (plus fp32 noise)
    assert ((hidden.grad.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
