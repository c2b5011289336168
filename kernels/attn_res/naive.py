"""Plain-PyTorch reference for Block AttnRes depth attention (DESIGN.md section 4).

For every token, with n sources v_0..v_{n-1} of width h, a pseudo-query w and an RMSNorm
weight gamma:

    logit_i = w . (gamma * v_i * rsqrt(mean(v_i^2) + eps))     (fp32, one head, no scale)
    a       = softmax_i(logit)
    out     = sum_i a_i v_i                                     (fp32 accumulation, V's dtype)

Two forms live here:

* ``depth_attention_reference``: plain autograd; it keeps whatever autograd keeps (the
  fp32 copies of the sources, the normalised keys, the weights). Used as the ground truth.
* ``depth_attention_recompute``: the same maths behind a custom ``autograd.Function`` that
  saves only the sources, ``w`` and ``gamma`` and recomputes everything in backward, so
  its activation memory matches the fused Triton kernel. This is the CPU path of the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def depth_attention_reference(
    sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Depth attention over stacked sources ``[n, ..., h]``; returns ``[..., h]`` in V's dtype.

    The softmax is written as unnormalised weights ``exp(logit - max)`` summed and divided
    once at the end, so a zero query gives exactly ``sum_i v_i / n`` (each weight is 1.0).
    """
    v = sources.float()
    rstd = torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    keys = v * rstd * norm_weight.float()
    logits = (keys * query.float()).sum(dim=-1, keepdim=True)  # [n, ..., 1]
    weights = torch.exp(logits - logits.amax(dim=0, keepdim=True))
    out = (weights * v).sum(dim=0) / weights.sum(dim=0)
    return out.to(sources.dtype)


class _RecomputeDepthAttention(torch.autograd.Function):
    """Saves only the inputs; backward re-runs the reference under autograd.

    ``stacked`` says whether ``sources`` holds one ``[n, ..., h]`` tensor or n tensors
    ``[..., h]``; list inputs are stacked only inside forward/backward (transiently), so
    nothing but the caller's own tensors stays alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, query, norm_weight, eps, stacked, source_grads, *sources):
        ctx.eps = eps
        ctx.stacked = stacked
        ctx.source_grads = source_grads
        ctx.save_for_backward(query, norm_weight, *sources)
        stack = sources[0] if stacked else torch.stack(sources)
        with torch.no_grad():
            return depth_attention_reference(stack, query, norm_weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        query, norm_weight, *sources = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (query, norm_weight, *sources)]
            stack = leaves[2] if ctx.stacked else torch.stack(leaves[2:])
            out = depth_attention_reference(stack, leaves[0], leaves[1], ctx.eps)
            grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        grads = [g if need else None for g, need in zip(grads, _needs_grad(ctx))]
        if ctx.source_grads is not None:  # add into the shared sums, return nothing to autograd
            for i, source_grad in enumerate(ctx.source_grads):
                if source_grad is not None and grads[2 + i] is not None:
                    source_grad.add_(grads[2 + i])
                    grads[2 + i] = None
        return grads[0], grads[1], None, None, None, *grads[2:]


def _needs_grad(ctx) -> list[bool]:
    # ctx.needs_input_grad follows forward's signature: query, norm_weight, eps, stacked,
    # source_grads, *sources.
    flags = ctx.needs_input_grad
    return [flags[0], flags[1], *flags[5:]]


def depth_attention_recompute(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-6,
    source_grads=None,
) -> torch.Tensor:
    """Reference maths with recompute-in-backward; accepts a stacked tensor or a list.

    ``source_grads`` (list only): one ``grads.SourceGrad`` or ``None`` per source; those
    sources' grads are added into their ``SourceGrad`` instead of returned to autograd.
    """
    if isinstance(sources, torch.Tensor):
        return _RecomputeDepthAttention.apply(query, norm_weight, eps, True, None, sources)
    return _RecomputeDepthAttention.apply(query, norm_weight, eps, False, source_grads, *sources)
