"""The autograd Function around the fused Triton kernels (launchers in ``fused.py`` and ``backward.py``)."""

from __future__ import annotations

import torch

from kimi_kernels.attn_res.backward import PairedCall, fused_depth_attention_backward_sums, parameter_grads
from kimi_kernels.attn_res.fused import fused_depth_attention_forward

# Position of the first source in FusedDepthAttention.apply's arguments.
_FIRST_SOURCE = 10


class FusedDepthAttention(torch.autograd.Function):
    """Saves the sources, query, norm weight, the output and ``lse`` (fp32 [T]); one-pass backward.

    ``apply(query, norm_weight, out_norm_weight, partner_query, partner_norm_weight, eps,
    out_norm_eps, stacked, source_grads, pair_role, *sources)``:
    with ``stacked`` one contiguous ``[n, ..., h]`` tensor is given (its grad comes back as one
    tensor); otherwise n contiguous ``[..., h]`` tensors (no views are made: the kernels index
    them as ``[T, h]``). ``source_grads`` is ``None`` or one
    :class:`~kimi_kernels.attn_res.grads.SourceGrad` (or ``None``) per source: a source with one gets
    its grad added into that buffer by the kernel and returns ``None`` to autograd; the others get
    a fresh tensor each.

    ``pair_role``: ``None`` or ``DepthPair.first`` / ``.second`` (``pair.py``); with ``.first``,
    ``partner_query`` / ``partner_norm_weight`` are the second call's parameters (this call's
    backward may return their grads), otherwise ``None``.

    ``out_norm_weight`` ``None``: returns the mix ``out``, which is saved for ``c = dout . out``;
    it is the tensor its consumer (the sublayer's input norm) keeps for its own backward, so no
    memory is added. Otherwise returns ``RMSNorm_{out_norm_weight, out_norm_eps}(out)`` (the
    sublayer's norm fused in) and also saves ``out_norm_weight`` and the norm's ``rstd`` (fp32
    [T]); ``out`` is then saved by this op alone (the returned tensor is kept by its consumer).
    """

    @staticmethod
    def forward(ctx, query, norm_weight, out_norm_weight, partner_query, partner_norm_weight, eps, out_norm_eps,
                stacked, source_grads, pair_role, *sources):
        ctx.stacked = stacked
        ctx.source_grads = source_grads
        views = tuple(sources[0].unbind(0)) if stacked else sources
        ctx.eps, ctx.out_norm_eps = eps, out_norm_eps
        ctx.pair_role, ctx.shared = (None, 0) if stacked else (pair_role, 0)
        if ctx.pair_role is not None:
            norm_out = out_norm_weight is not None
            if pair_role.index == 0:
                pair_role.pair.record_first(sources, source_grads, eps, norm_out)
            else:
                shared = pair_role.pair.shared_count(sources, source_grads, eps, norm_out)
                # Paired only with the norm fused: then the output below is saved in fp32 for a precise c;
                # unfused it is the tensor the sublayer reads, in the sources' dtype (docs/attn_res.md).
                ctx.shared = shared if norm_out else 0
        # The second call of a pair gets c = dout . out from its saved output (its sources are split over two
        # backward kernels): saved in fp32, c is as precise as the sum over the sources. With the norm fused
        # that output is saved by this op alone (docs/attn_res.md, Precision of c).
        out_dtype = torch.float32 if ctx.shared else None
        out, lse, normed, out_rstd = fused_depth_attention_forward(
            views, query, norm_weight, eps, out_norm_weight, out_norm_eps, out_dtype
        )
        ctx.save_for_backward(query, norm_weight, out, lse, out_norm_weight, out_rstd, *sources)
        return out if normed is None else normed

    @staticmethod
    def backward(ctx, grad_out):
        query, norm_weight, out, lse, out_norm_weight, out_rstd, *sources = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_out = grad_out.contiguous()
        role = ctx.pair_role
        # Second call of a pair: leave the shared sources to the first call's backward.
        shared = ctx.shared if role is not None else 0
        if ctx.stacked:
            grad_stacked = torch.empty_like(sources[0])
            views, dests, accumulate = tuple(sources[0].unbind(0)), tuple(grad_stacked.unbind(0)), ()
            returned = [grad_stacked if needs[_FIRST_SOURCE] else None]
        else:
            views, dests, accumulate, returned = tuple(sources), [], [], [None] * shared
            source_grads = ctx.source_grads or (None,) * len(views)
            for v, source_grad, need in zip(views[shared:], source_grads[shared:], needs[_FIRST_SOURCE + shared:]):
                if source_grad is None:
                    dests.append(torch.empty_like(v))
                    accumulate.append(False)
                    returned.append(dests[-1] if need else None)
                    continue
                current = source_grad.current()
                accumulate.append(current is not None)
                if current is None:
                    current = torch.empty_like(v)
                    source_grad.set(current)
                dests.append(current)
                returned.append(None)
        grad_partner_query = grad_partner_norm_weight = None
        if shared:  # the second call of a pair: its own sources only, the rest deferred
            # with its mix gradient (rounded to the sources' dtype) and that gradient's c, for the first call
            grad_mix, c = torch.empty_like(grad_out), torch.empty_like(lse)
            sums = fused_depth_attention_backward_sums(
                views[shared:], query, norm_weight, ctx.eps, out, lse, grad_out, dests, accumulate,
                out_norm_weight, ctx.out_norm_eps, out_rstd, needs[2], subset=True, handoff=(grad_mix, c),
            )
            call = PairedCall(shared, query, norm_weight, lse, grad_mix, c)
            role.pair.defer(call, sums.g, needs[:2], ctx.source_grads[:shared])
            grad_query = grad_norm_weight = None  # returned by the first call's backward
        else:
            deferred = role.pair.take() if role is not None and role.index == 0 else None
            in_kernel = deferred is None  # grads from the finish kernel
            sums = fused_depth_attention_backward_sums(
                views, query, norm_weight, ctx.eps, out, lse, grad_out, dests, accumulate,
                out_norm_weight, ctx.out_norm_eps, out_rstd, needs[2],
                paired=None if deferred is None else deferred.call, parameter_grads=in_kernel,
            )
            if in_kernel:
                grad_query, grad_norm_weight = sums.grad_query, sums.grad_norm_weight
            else:
                grad_query, grad_norm_weight = parameter_grads(sums.g, query, norm_weight, needs[0], needs[1])
            if deferred is not None:
                g2 = sums.g2 + deferred.g
                grad_partner_query, grad_partner_norm_weight = parameter_grads(
                    g2, deferred.call.query, deferred.call.norm_weight, needs[3], needs[4]
                )
        if sums.grad_out_norm_weight is not None or not needs[2]:
            grad_out_norm_weight = sums.grad_out_norm_weight if needs[2] else None
        else:
            grad_out_norm_weight = sums.g_out_norm.to(out_norm_weight.dtype)
        grad_query = grad_query if needs[0] else None
        grad_norm_weight = grad_norm_weight if needs[1] else None
        return (grad_query, grad_norm_weight, grad_out_norm_weight, grad_partner_query, grad_partner_norm_weight,
                None, None, None, None, None, *returned)
