"""use_fused_adam: Megatron's torch AdamW switched to the fused kernel gives the same update."""

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.parallel import use_fused_adam


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((7, 5), (11,), (3, 4, 2))]


def _run(fused: bool, steps=3):
    params = _params(0)
    groups = [dict(params=params[:2], weight_decay=0.1), dict(params=params[2:], weight_decay=0.0)]
    inner = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    # the shape Megatron returns: a ChainedOptimizer of wrappers that hold the torch optimizer
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])
    if fused:
        assert use_fused_adam(chained) == 2
        assert all(g["fused"] and not g["foreach"] for g in inner.param_groups)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        inner.step()
    return params, inner


def test_fused_adam_update_equals_default_adamw():
    fused, _ = _run(True)
    default, _ = _run(False)
    for a, b, start in zip(fused, default, _params(0)):
        assert (a - start).abs().max() > 1e-3  # the steps moved it
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_adam_must_switch_before_the_first_step():
    _, inner = _run(False, steps=1)
    with pytest.raises(ValueError, match="before the optimizer's first step"):
        use_fused_adam(SimpleNamespace(optimizer=inner))
