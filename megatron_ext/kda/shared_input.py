"""Several linear projections of one input as one autograd node: ``y_i = x W_i^T``.

A KDA layer projects the same ``x`` six times (q, k, v, beta and the two low-rank gate downs).
Run as six linears, autograd sums six input gradients with five extra elementwise passes over
``[s, b, h]``, and each small projection (16 or ``rank`` outputs) reads all of ``x`` for a GEMM
that moves more bytes than it computes. Here the weights come in groups: each group is one GEMM
(its weights concatenated: small ones, cheap to copy) whose outputs are column views, and the
backward accumulates the input gradient inside the GEMMs (``dx = dy_0 W_0``, then
``dx += dy_i W_i`` through ``addmm_``'s epilogue): the same bf16 roundings as the separate adds,
without their reads and writes. Weight gradients are ``dy^T x`` per group, as Megatron's linear
computes them (no gradient-accumulation fusion).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _joined(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_sizes, *weights):
        ctx.group_sizes = group_sizes
        ctx.save_for_backward(x, *weights)
        outputs, start = [], 0
        for n in group_sizes:
            group = weights[start : start + n]
            start += n
            y = F.linear(x, _joined(list(group), 0))
            outputs += y.split([w.shape[0] for w in group], -1)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])
        want_dx, _, *want_dw = ctx.needs_input_grad
        dx, dws, start = None, [], 0
        for n in ctx.group_sizes:
            group, wants = weights[start : start + n], want_dw[start : start + n]
            dy2d = _joined([g.reshape(-1, g.shape[-1]) for g in grads[start : start + n]], 1)
            start += n
            if want_dx:
                w = _joined(list(group), 0)
                dx = torch.mm(dy2d, w) if dx is None else dx.addmm_(dy2d, w)
            if any(wants):
                dws += [dw if want else None for dw, want in
                        zip(dy2d.t().mm(x2d).split([w.shape[0] for w in group]), wants)]
            else:
                dws += [None] * n
        return (dx.view_as(x) if dx is not None else None), None, *dws


def project_shared_input(x: torch.Tensor, groups) -> tuple[torch.Tensor, ...]:
    """``x @ w.T`` for each weight ``w`` of each group of ``groups`` (a list of lists), in order; a group
    is one GEMM. The input gradient is summed inside the backward's GEMMs."""
    groups = [list(group) for group in groups]
    return _SharedInputLinears.apply(x, tuple(len(g) for g in groups), *(w for g in groups for w in g))
