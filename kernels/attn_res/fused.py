"""Fused Triton kernels for Block AttnRes depth attention (maths in ``naive.py``).

Per token, with ``u = w * gamma`` and ``r_i = rsqrt(mean(v_i^2) + eps)``, the logit is
``logit_i = r_i * (v_i . u)``: the normalised keys are never formed, only three dot
products per (token, source) over h.

Forward (one program per tile of BLOCK_T tokens, full h in registers, h padded to a power
of two): stream the n sources once with an online softmax, rescaling an fp32 accumulator,
so V is read exactly once and only ``out`` is written.

Backward (persistent grid, each program loops over token tiles):
  pass 1 reads the tile's n sources and dout, and gets the softmax normaliser ``lse`` and
         ``c = sum_i a_i (dout . v_i)`` (an online softmax again);
  pass 2 re-reads the same tile's sources (just touched, so mostly from L2), recomputes
         r_i, v_i . u, dout . v_i, a_i and writes
           dv_i = a_i dout + dlogit_i r_i (u - (v_i . u) r_i^2 v_i / h),
           dlogit_i = a_i (dout . v_i - c),
         while accumulating g = sum_tokens sum_i dlogit_i r_i v_i in fp32 registers.
Each program writes one row of g; the rows are summed afterwards (two-stage, deterministic
for a given device), and dw = g * gamma, dgamma = g * w.

Sources are passed to the kernels as a tuple of tensors (one pointer each, unrolled over the
constexpr n), so the caller never has to stack them; the source grads are written into one
``[n, T, h]`` buffer whose slices are handed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _depth_attention_fwd_kernel(
    src_ptrs, query_ptr, norm_weight_ptr, out_ptr, T, H, eps,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = (rows < T)[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    u = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    u = u * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)

    running_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    normaliser = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for i in tl.static_range(N):
        v = tl.load(src_ptrs[i] + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)
        logit = tl.sum(v * u[None, :], axis=1) * rstd
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        weight = tl.exp(logit - new_max)
        normaliser = normaliser * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v
        running_max = new_max
    out = acc / normaliser[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _depth_attention_bwd_kernel(
    src_ptrs, query_ptr, norm_weight_ptr, grad_out_ptr, grad_src_ptr, partial_g_ptr,
    T, H, source_stride, eps,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    u = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    u = u * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    g_acc = tl.zeros([BLOCK_H], tl.float32)

    for tile in range(pid, tl.cdiv(T, BLOCK_T), num_programs):
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (rows < T)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        dout = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)

        # Pass 1: softmax normaliser and c = sum_i a_i (dout . v_i), online over sources.
        running_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
        normaliser = tl.zeros([BLOCK_T], tl.float32)
        weighted_da = tl.zeros([BLOCK_T], tl.float32)
        for i in tl.static_range(N):
            v = tl.load(src_ptrs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)
            logit = tl.sum(v * u[None, :], axis=1) * rstd
            da = tl.sum(v * dout, axis=1)
            new_max = tl.maximum(running_max, logit)
            rescale = tl.exp(running_max - new_max)
            weight = tl.exp(logit - new_max)
            normaliser = normaliser * rescale + weight
            weighted_da = weighted_da * rescale + weight * da
            running_max = new_max
        lse = running_max + tl.log(normaliser)
        c = weighted_da / normaliser

        # Pass 2: recompute per-source statistics and write the source grads.
        grad_ptrs = grad_src_ptr + offs  # advanced by one source per step: no i * stride overflow
        for i in tl.static_range(N):
            v = tl.load(src_ptrs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(v * v, axis=1) / H + eps)
            vu = tl.sum(v * u[None, :], axis=1)
            da = tl.sum(v * dout, axis=1)
            a = tl.exp(vu * rstd - lse)
            coef = a * (da - c) * rstd  # dlogit_i * r_i
            dv = a[:, None] * dout + coef[:, None] * (
                u[None, :] - (vu * rstd * rstd / H)[:, None] * v
            )
            tl.store(grad_ptrs, dv.to(grad_src_ptr.dtype.element_ty), mask=mask)
            grad_ptrs += source_stride
            g_acc += tl.sum(coef[:, None] * v, axis=0)

    tl.store(partial_g_ptr + pid.to(tl.int64) * H + cols, g_acc, mask=col_mask)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one program: BLOCK_T tokens by BLOCK_H (h padded to a power of two)."""

    block_t: int
    block_h: int
    num_warps: int


def launch_config(hidden: int, tile_elements: int) -> LaunchConfig:
    """About ``tile_elements`` values per tile (whole rows), about 8 per thread.

    The unrolled source loop issues all n loads of a tile up front (good for bandwidth), so
    registers grow like n x elements per thread: at 8 per thread ptxas (sm_90) reports no
    spills up to n = 20 for h = 2048 (128 registers at n = 9, 254 at n = 20).
    """
    block_h = triton.next_power_of_2(hidden)
    block_t = max(1, min(16, tile_elements // block_h))
    num_warps = max(1, min(16, block_t * block_h // 256))
    return LaunchConfig(block_t, block_h, num_warps)


# Tile sizes (elements per token tile), read at call time so the benchmark can sweep them.
# Small tiles keep registers low (see launch_config) and keep the backward's working set
# (programs in flight x n x tile) well inside L2 for its second pass.
FORWARD_TILE_ELEMENTS = 2048
BACKWARD_TILE_ELEMENTS = 2048


def _backward_grid(device: torch.device, num_tiles: int) -> int:
    if device.type == "cuda":
        return max(1, min(num_tiles, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(num_tiles, 2))  # interpreter: still exercises the per-program loop


def fused_depth_attention_forward(
    sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``sources``: n contiguous ``[T, h]`` tensors; returns ``[T, h]`` in their dtype."""
    T, H = sources[0].shape
    out = torch.empty_like(sources[0])
    if T == 0:
        return out
    cfg = launch_config(H, FORWARD_TILE_ELEMENTS)
    grid = (triton.cdiv(T, cfg.block_t),)
    _depth_attention_fwd_kernel[grid](
        tuple(sources), query, norm_weight, out, T, H, eps,
        N=len(sources), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
    )
    return out


def fused_depth_attention_backward(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (grad of the stacked sources ``[n, T, h]``, grad query, grad norm_weight)."""
    T, H = sources[0].shape
    grad_sources = torch.empty((len(sources), T, H), dtype=sources[0].dtype, device=grad_out.device)
    cfg = launch_config(H, BACKWARD_TILE_ELEMENTS)
    programs = _backward_grid(grad_out.device, triton.cdiv(T, cfg.block_t))
    partial_g = torch.empty((programs, H), dtype=torch.float32, device=grad_out.device)
    if T == 0:
        partial_g.zero_()
    else:
        _depth_attention_bwd_kernel[(programs,)](
            tuple(sources), query, norm_weight, grad_out, grad_sources, partial_g, T, H, T * H, eps,
            N=len(sources), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
        )
    g = partial_g.sum(dim=0)
    grad_query = (g * norm_weight.float()).to(query.dtype)
    grad_norm_weight = (g * query.float()).to(norm_weight.dtype)
    return grad_sources, grad_query, grad_norm_weight


class FusedDepthAttention(torch.autograd.Function):
    """Saves only the sources, query and norm weight; backward recomputes in the kernel.

    ``apply(query, norm_weight, eps, stacked, *sources)``: with ``stacked`` one ``[n, T, h]``
    tensor is given (its grad comes back as one tensor); otherwise n ``[T, h]`` tensors
    (their grads come back as slices of one ``[n, T, h]`` buffer, no copy).
    """

    @staticmethod
    def forward(ctx, query, norm_weight, eps, stacked, *sources):
        ctx.eps = eps
        ctx.stacked = stacked
        ctx.save_for_backward(query, norm_weight, *sources)
        views = tuple(sources[0].unbind(0)) if stacked else sources
        return fused_depth_attention_forward(views, query, norm_weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        query, norm_weight, *sources = ctx.saved_tensors
        views = tuple(sources[0].unbind(0)) if ctx.stacked else tuple(sources)
        grad_sources, grad_query, grad_norm_weight = fused_depth_attention_backward(
            views, query, norm_weight, ctx.eps, grad_out.contiguous()
        )
        needs = ctx.needs_input_grad
        source_grads = (grad_sources,) if ctx.stacked else tuple(grad_sources.unbind(0))
        source_grads = tuple(g if need else None for g, need in zip(source_grads, needs[4:]))
        return (
            grad_query if needs[0] else None,
            grad_norm_weight if needs[1] else None,
            None,
            None,
            *source_grads,
        )
