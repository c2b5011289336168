"""Launcher of the two-pass depth-attention backward (``fused.BACKWARD_KERNEL = "split"``; kernels and maths in
``split_bwd.py``). Same contract as ``fused.fused_depth_attention_backward_sums``, which calls it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from kernels.attn_res import fused
from kernels.attn_res.fused import BackwardSums, PairedCall, finish_sums
from kernels.attn_res.split_bwd import (
    _depth_attention_bwd_grads_kernel,
    _depth_attention_bwd_scalars_kernel,
)

_waves: dict = {}  # (device, specialisation) -> programs per wave of the grads kernel


def scalar_rows(n: int, paired: int, norm_out: bool) -> int:
    """Rows of the scalars buffer: a, coef, scale per source, a2, coef2 per shared source, s, k (, s2, k2)."""
    return 3 * n + 2 * paired + (2 + 2 * (paired > 0) if norm_out else 0)


def split_backward_sums(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_sources: Sequence[torch.Tensor],
    accumulate: Sequence[bool],
    out_norm_weight: torch.Tensor | None,
    out_norm_eps: float,
    out_rstd: torch.Tensor | None,
    need_out_norm_weight: bool,
    subset: bool,
    paired: PairedCall | None,
    parameter_grads: bool,
) -> BackwardSums:
    """``fused.fused_depth_attention_backward_sums`` with the two kernels of ``split_bwd.py`` (T > 0)."""
    T, H = fused._tokens(sources[0])
    n = len(sources)
    norm_out = out_norm_weight is not None
    count = 0 if paired is None else paired.count
    out_norm_grad = norm_out and need_out_norm_weight
    rows = 1 + out_norm_grad + (paired is not None)
    device = grad_out.device
    block_h = triton.next_power_of_2(H)
    scalars = torch.empty((scalar_rows(n, count, norm_out), T), dtype=torch.float32, device=device)
    p2 = paired
    second = (
        query if p2 is None else p2.query, norm_weight if p2 is None else p2.norm_weight,
        out if p2 is None else p2.out, grad_out if p2 is None else p2.grad_out, lse if p2 is None else p2.lse,
        (out_norm_weight if norm_out else norm_weight) if p2 is None or not norm_out else p2.out_norm_weight,
        (out_rstd if norm_out else lse) if p2 is None or not norm_out else p2.out_rstd,
    )
    block_t = fused.SPLIT_SCALARS_WARPS
    _depth_attention_bwd_scalars_kernel[(triton.cdiv(T, block_t),)](
        tuple(sources), query, norm_weight, out, grad_out, lse,
        out_norm_weight if norm_out else norm_weight, out_rstd if norm_out else lse, *second, scalars,
        T, H, eps, out_norm_eps, out_norm_eps if p2 is None else p2.out_norm_eps,
        N=n, BLOCK_T=block_t, BLOCK_C=min(fused.SPLIT_SCALARS_CHUNK, block_h), NORM_OUT=norm_out,
        SUBSET=subset, PAIRED=count, num_warps=fused.SPLIT_SCALARS_WARPS,
    )
    chunk = min(fused.SPLIT_GRADS_CHUNK, block_h)
    chunks = triton.cdiv(H, chunk)
    mask = sum(1 << i for i, flag in enumerate(accumulate) if flag)
    kwargs = dict(N=n, ACCUMULATE=mask, BLOCK_T=fused.SPLIT_GRADS_TILE_T, BLOCK_C=chunk, NORM_OUT=norm_out,
                  PAIRED=count, OUT_NORM_GRAD=out_norm_grad)
    groups = fused.SPLIT_GRADS_TOKEN_GROUPS
    if groups is None:
        key = (device, *kwargs.values(), fused.SPLIT_GRADS_WARPS, sources[0].dtype, out.dtype, second[2].dtype)
        if key not in _waves:
            probe = torch.empty((rows, 1, H), dtype=torch.float32, device=device)
            _waves[key] = fused._one_wave(device, _depth_attention_bwd_grads_kernel,
                                          _grads_args(sources, grad_sources, query, norm_weight, out, grad_out,
                                                      out_norm_weight, second, scalars, probe, T, H),
                                          kwargs, fused.SPLIT_GRADS_WARPS)
        groups = _waves[key] // chunks
    groups = max(1, min(triton.cdiv(T, fused.SPLIT_GRADS_TILE_T), groups))
    partial = torch.empty((rows, groups, H), dtype=torch.float32, device=device)
    _depth_attention_bwd_grads_kernel[(groups, chunks)](
        *_grads_args(sources, grad_sources, query, norm_weight, out, grad_out, out_norm_weight, second, scalars,
                     partial, T, H), num_warps=fused.SPLIT_GRADS_WARPS, **kwargs)
    return finish_sums(partial, paired is not None, parameter_grads, query, norm_weight, out_norm_weight)


def _grads_args(sources, grad_sources, query, norm_weight, out, grad_out, out_norm_weight, second, scalars, partial,
                T, H):
    return (tuple(sources), tuple(grad_sources), query, norm_weight, out, grad_out,
            norm_weight if out_norm_weight is None else out_norm_weight, second[0], second[1], second[2], second[3],
            second[5], scalars, partial, T, H)
