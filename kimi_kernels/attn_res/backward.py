"""Launchers of the depth-attention backward (kernels in ``preload_bwd.py``; the maths in ``fused.py``'s module
docstring, the launch table ``fused.BACKWARD_LAUNCH`` there too): one call's source grads and its parameter sums,
optionally paired with a second call (``PairedCall``, ``pair.py``), and the finish kernel that adds up the
per-program partial sums."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kimi_kernels.attn_res import fused

_PROMOTE_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PairedCall:
    """A second depth-attention call whose first ``count`` sources are the first ``count``
    sources of the call being differentiated (same tensors, same key-norm ``eps``): its backward
    inputs, as its own pass (``subset`` with ``handoff``) left them: ``grad_mix`` (the gradient of
    its mix output, after its output norm's backward, in the sources' dtype) and ``c`` (fp32 ``[T]``,
    the softmax backward's sum for that ``grad_mix``). The paired backward adds its gradient for
    those sources in the same pass (``_depth_attention_bwd_preload_kernel``, ``PAIRED``)."""

    count: int
    query: torch.Tensor
    norm_weight: torch.Tensor
    lse: torch.Tensor
    grad_mix: torch.Tensor
    c: torch.Tensor


@dataclass
class BackwardSums:
    """fp32 ``[h]`` sums of one backward launch: ``g`` (this call's ``sum dlogit r v``; ``dw = g
    gamma``, ``dgamma = g w``), ``g_out_norm`` (``dgamma_o``, with the fused norm) and ``g2`` (the
    paired call's ``g`` over the shared sources). With ``parameter_grads`` the finish kernel wrote
    the grads themselves instead (``grad_query``, ``grad_norm_weight``, ``grad_out_norm_weight``, each
    in its parameter's dtype) and ``g`` / ``g_out_norm`` are ``None``."""

    g: torch.Tensor | None
    g_out_norm: torch.Tensor | None = None
    g2: torch.Tensor | None = None
    grad_query: torch.Tensor | None = None
    grad_norm_weight: torch.Tensor | None = None
    grad_out_norm_weight: torch.Tensor | None = None


def fused_depth_attention_backward_sums(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_sources: Sequence[torch.Tensor],
    accumulate: Sequence[bool],
    out_norm_weight: torch.Tensor | None = None,
    out_norm_eps: float = 0.0,
    out_rstd: torch.Tensor | None = None,
    need_out_norm_weight: bool = False,
    subset: bool = False,
    handoff: tuple[torch.Tensor, torch.Tensor] | None = None,
    paired: PairedCall | None = None,
    parameter_grads: bool = False,
    launch: fused.BackwardLaunch = fused.BACKWARD_LAUNCH,
) -> BackwardSums:
    """Writes (or, where ``accumulate[i]``, adds) each source's grad into ``grad_sources[i]``
    (contiguous, the sources' shape) and returns the fp32 sums (:class:`BackwardSums`). With
    ``out_norm_weight`` (and the forward's ``out_rstd``), ``grad_out`` is the grad of ``normed =
    RMSNorm(out)``. ``subset``: ``sources`` are only some of the call's sources (its ``lse``
    covers all). ``handoff`` (with ``subset``): ``(grad_mix, c)`` buffers (the sources' shape and dtype;
    fp32 ``[T]``) that receive this call's mix gradient, rounded to that dtype, and the ``c`` of that rounded
    gradient, which this pass uses too (a :class:`PairedCall` for the first call's backward). ``paired``:
    also the gradient of a second call for the first ``paired.count`` sources (added into the same
    grads; its ``g`` over them in ``g2``). ``parameter_grads`` (neither ``subset`` nor ``paired``): return the
    parameters' grads in their dtypes, computed by the finish kernel, instead of the fp32 sums. ``launch``: the
    launch table (the shipped one; tests pass others to reach several tiles per program)."""
    T, H = fused._tokens(sources[0])
    norm_out = out_norm_weight is not None
    device = grad_out.device
    if handoff is not None and not subset:
        raise ValueError("handoff is the own pass of a pair's second call: it needs subset")
    if parameter_grads and (subset or paired is not None):
        raise ValueError("parameter_grads needs neither subset nor paired")
    rows = 1 + (norm_out and need_out_norm_weight) + (paired is not None)
    if T == 0:  # (an empty handoff has nothing to write)
        zero = torch.zeros(H, dtype=torch.float32, device=device)
        sums = BackwardSums(zero, zero if norm_out else None, zero if paired is not None else None)
        return _as_parameter_grads(sums, query, norm_weight, out_norm_weight) if parameter_grads else sums
    mask = 0
    for i, flag in enumerate(accumulate):
        if flag:
            mask |= 1 << i
    n = len(sources)
    kernel = fused._depth_attention_bwd_preload_kernel
    cfg = launch.for_call(H, n, subset, handoff is not None)
    kwargs = dict(N=n, ACCUMULATE=mask, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, NORM_OUT=norm_out,
                  SUBSET=subset, PAIRED=0 if paired is None else paired.count, HANDOFF=handoff is not None,
                  OUT_NORM_GRAD=norm_out and need_out_norm_weight, BATCH=cfg.batch,
                  PACK=fused._packable(H, sources, grad_sources, out, grad_out,
                                       None if paired is None else paired.grad_mix))
    if cfg.maxnreg and device.type == "cuda":
        kwargs["maxnreg"] = cfg.maxnreg  # a compile option (in the capacity key with the rest)
    key = (device, kernel, *kwargs.values(), cfg, sources[0].dtype, out.dtype,
           None if paired is None else paired.grad_mix.dtype)
    capacity = fused._backward_capacities.get(key)
    programs = max(1, min(-(-T // cfg.block_t), capacity or 1))
    # One fp32 buffer for every per-program partial-sum array, [rows, programs, h]: g, then
    # g_out_norm (if computed), then g2 (if paired).
    while True:
        partial = torch.empty((rows, programs, H), dtype=torch.float32, device=device)
        row_g_out_norm = partial[1] if (norm_out and need_out_norm_weight) else partial[0]
        # Where unused (no pair, no handoff), the pointers repeat this call's own (never read or written).
        p2 = paired or PairedCall(0, query, norm_weight, lse, grad_out, lse)
        handoff_grad, handoff_c = handoff or (grad_out, lse)
        args = [tuple(sources), tuple(grad_sources), query, norm_weight, out, grad_out, lse, partial[0],
                out_norm_weight if norm_out else norm_weight, out_rstd if norm_out else lse, row_g_out_norm,
                p2.query, p2.norm_weight, p2.grad_mix, p2.c, p2.lse,
                partial[rows - 1] if paired is not None else partial[0], handoff_grad, handoff_c,
                T, H, eps, out_norm_eps]
        if capacity is not None:
            break
        # First call with this key: compile, read the register count, size the grid from it.
        capacity = fused._backward_capacities[key] = fused._one_wave(device, kernel, args, kwargs, cfg.num_warps)
        programs = max(1, min(-(-T // cfg.block_t), capacity))
    kernel[(programs,)](*args, num_warps=cfg.num_warps, **kwargs)
    return _finish_sums(partial, paired is not None, parameter_grads, query, norm_weight, out_norm_weight, launch)


def _finish_sums(partial: torch.Tensor, paired: bool, parameter_grads: bool, query: torch.Tensor,
                norm_weight: torch.Tensor, out_norm_weight: torch.Tensor | None,
                launch: fused.BackwardLaunch = fused.BACKWARD_LAUNCH) -> BackwardSums:
    """Adds up a backward's per-program partial rows, ``partial [rows, programs, h]`` fp32 (``g``, then
    ``g_out_norm`` if there are more rows than ``1 + paired``, then ``g2`` if ``paired``), in one launch of the
    finish kernel; with ``parameter_grads`` it writes the parameters' grads instead (:class:`BackwardSums`)."""
    rows, programs, H = partial.shape
    device = partial.device
    grid = (-(-H // launch.finish_block),)
    if parameter_grads:
        grad_query, grad_norm_weight = torch.empty_like(query), torch.empty_like(norm_weight)
        grad_out_norm = torch.empty_like(out_norm_weight) if rows > 1 else grad_query
        fused._depth_attention_finish_kernel[grid](
            partial, partial, query, norm_weight, grad_query, grad_norm_weight, grad_out_norm, H, P=programs,
            ROWS=rows, BLOCK_P=launch.finish_block_p, BLOCK=launch.finish_block, PARAMETER_GRADS=True, num_warps=4)
        return BackwardSums(None, grad_query=grad_query, grad_norm_weight=grad_norm_weight,
                            grad_out_norm_weight=grad_out_norm if rows > 1 else None)
    sums = torch.empty((rows, H), dtype=torch.float32, device=device)
    fused._depth_attention_finish_kernel[grid](
        partial, sums, query, norm_weight, partial, partial, partial, H, P=programs,
        ROWS=rows, BLOCK_P=launch.finish_block_p, BLOCK=launch.finish_block, PARAMETER_GRADS=False, num_warps=4)
    return BackwardSums(sums[0], sums[1] if rows - paired > 1 else None, sums[rows - 1] if paired else None)


def _as_parameter_grads(sums: BackwardSums, query, norm_weight, out_norm_weight) -> BackwardSums:
    """The parameter grads from fp32 sums (the ``parameter_grads`` result where no kernel ran)."""
    grad_query, grad_norm_weight = parameter_grads(sums.g, query, norm_weight)
    grad_out_norm = (sums.g_out_norm.to(out_norm_weight.dtype)
                     if sums.g_out_norm is not None and out_norm_weight is not None else None)
    return BackwardSums(None, grad_query=grad_query, grad_norm_weight=grad_norm_weight,
                        grad_out_norm_weight=grad_out_norm)


def parameter_grads(g, query, norm_weight, need_query=True, need_norm_weight=True):
    """(grad query, grad norm_weight) = (g gamma, g w) from the fp32 sum ``g``, each in its
    parameter's dtype (``None`` where not needed)."""
    # g is fp32; an fp32 x (fp32, bf16 or fp16) product is computed in fp32 (type promotion),
    # as with an explicit .float(); cast only where the parameter is not fp32.
    return (
        _product(g, norm_weight, query.dtype) if need_query else None,
        _product(g, query, norm_weight.dtype) if need_norm_weight else None,
    )


def _product(g: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    product = g * (other if other.dtype in _PROMOTE_TO_FP32 else other.float())
    return product if product.dtype == dtype else product.to(dtype)
