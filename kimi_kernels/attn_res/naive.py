"""Plain-PyTorch reference for Block AttnRes depth attention (DESIGN.md section 4).

For every token, with n sources v_0..v_{n-1} of width h, a pseudo-query w and an RMSNorm
weight gamma:

    logit_i = w . (gamma * v_i * rsqrt(mean(v_i^2) + eps))     (fp32, one head, no scale)
    a       = softmax_i(logit)
    out     = sum_i a_i v_i                                     (fp32 accumulation, V's dtype)

Optionally the consumer's RMSNorm is applied to ``out`` (``out_norm_weight`` gamma_o, eps_o):
``RMSNorm(out) = out * rsqrt(mean(out^2) + eps_o) * gamma_o`` computed in fp32 from ``out`` as
rounded to V's dtype, returned in V's dtype (what the sublayer's separate norm computes).

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


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim in fp32, returned in ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def depth_attention_norm_reference(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    out_norm_weight: torch.Tensor,
    eps: float = 1e-6,
    out_norm_eps: float = 1e-6,
) -> torch.Tensor:
    """``RMSNorm_{out_norm_weight}(depth_attention_reference(...))``, plain autograd."""
    out = depth_attention_reference(sources, query, norm_weight, eps)
    return rms_norm_reference(out, out_norm_weight, out_norm_eps)


def _reference(stack, query, norm_weight, out_norm_weight, eps, out_norm_eps):
    out = depth_attention_reference(stack, query, norm_weight, eps)
    return out if out_norm_weight is None else rms_norm_reference(out, out_norm_weight, out_norm_eps)


class _RecomputeDepthAttention(torch.autograd.Function):
    """Saves only the inputs; backward re-runs the reference under autograd.

    ``stacked`` says whether ``sources`` holds one ``[n, ..., h]`` tensor or n tensors
    ``[..., h]``; list inputs are stacked only inside forward/backward (transiently), so
    nothing but the caller's own tensors stays alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, query, norm_weight, out_norm_weight, eps, out_norm_eps, stacked, source_grads, *sources):
        ctx.eps, ctx.out_norm_eps = eps, out_norm_eps
        ctx.stacked = stacked
        ctx.source_grads = source_grads
        ctx.save_for_backward(query, norm_weight, out_norm_weight, *sources)
        stack = sources[0] if stacked else torch.stack(sources)
        with torch.no_grad():
            return _reference(stack, query, norm_weight, out_norm_weight, eps, out_norm_eps)

    @staticmethod
    def backward(ctx, grad_out):
        query, norm_weight, out_norm_weight, *sources = ctx.saved_tensors
        with torch.enable_grad():
            params = [t.detach().requires_grad_(True) for t in (query, norm_weight)]
            if out_norm_weight is not None:
                params.append(out_norm_weight.detach().requires_grad_(True))
            leaves = [*params, *(t.detach().requires_grad_(True) for t in sources)]
            stack = leaves[len(params)] if ctx.stacked else torch.stack(leaves[len(params):])
            out = _reference(stack, *params[:2], params[2] if out_norm_weight is not None else None,
                             ctx.eps, ctx.out_norm_eps)
            grads = list(torch.autograd.grad(out, leaves, grad_out, allow_unused=True))
        if out_norm_weight is None:
            grads.insert(2, None)
        # ctx.needs_input_grad follows forward's signature: query, norm_weight, out_norm_weight,
        # eps, out_norm_eps, stacked, source_grads, *sources.
        flags = ctx.needs_input_grad
        grads = [g if need else None for g, need in zip(grads, (*flags[:3], *flags[7:]))]
        if ctx.source_grads is not None:  # add into the shared sums, return nothing to autograd
            for i, source_grad in enumerate(ctx.source_grads):
                if source_grad is not None and grads[3 + i] is not None:
                    source_grad.add_(grads[3 + i])
                    grads[3 + i] = None
        return grads[0], grads[1], grads[2], None, None, None, None, *grads[3:]


def depth_attention_recompute(
    sources: torch.Tensor | Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-6,
    source_grads=None,
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Reference maths with recompute-in-backward; accepts a stacked tensor or a list.

    ``source_grads`` (list only): one ``grads.SourceGrad`` or ``None`` per source; those
    sources' grads are added into their ``SourceGrad`` instead of returned to autograd.
    ``out_norm_weight``: return ``RMSNorm(out)`` instead of ``out`` (its grad flows to it).
    """
    args = (query, norm_weight, out_norm_weight, eps, out_norm_eps)
    if isinstance(sources, torch.Tensor):
        return _RecomputeDepthAttention.apply(*args, True, None, sources)
    return _RecomputeDepthAttention.apply(*args, False, source_grads, *sources)
