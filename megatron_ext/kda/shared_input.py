"""Several linear projections of one input as one autograd node: ``y_i = x W_i^T``.

A KDA layer projects the same ``x`` six times (q, k, v, beta and the two low-rank gate downs).
Run as six linears, autograd sums six input gradients with five extra elementwise passes over
``[s, b, h]``. Here the backward accumulates them inside the GEMMs instead
(``dx = dy_0 W_0``, then ``dx += dy_i W_i`` through ``addmm_``'s epilogue): the same bf16
roundings as the separate adds, without their reads and writes. Weight gradients are
``dy_i^T x``, as Megatron's linear computes them (no gradient-accumulation fusion).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])
        want_dx, *want_dw = ctx.needs_input_grad
        dx, dws = None, []
        for dy, w, want in zip(grads, weights, want_dw):
            dy2d = dy.reshape(-1, dy.shape[-1])
            if want_dx:
                dx = torch.mm(dy2d, w) if dx is None else dx.addmm_(dy2d, w)
            dws.append(dy2d.t().mm(x2d) if want else None)
        return (dx.view_as(x) if dx is not None else None), *dws


def project_shared_input(x: torch.Tensor, weights) -> tuple[torch.Tensor, ...]:
    """``tuple(x @ w.T for w in weights)``, the input gradient summed inside the backward's GEMMs."""
    return _SharedInputLinears.apply(x, *weights)
