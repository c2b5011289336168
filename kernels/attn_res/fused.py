"""Fused Triton kernels for Block AttnRes depth attention (maths in ``naive.py``).

Per token, with ``u = w * gamma`` and ``r_i = rsqrt(mean(v_i^2) + eps)``, the logit is
``logit_i = r_i * (v_i . u)``: the normalised keys are never formed, only dot products per
(token, source) over h, reduced together (one multi-operand reduction per source).

Forward (one program per tile of BLOCK_T tokens, full h in registers, h padded to a power of
two): stream the n sources once with an online softmax, rescaling an fp32 accumulator, so V
is read exactly once; writes ``out`` and ``lse [T]`` (fp32 log-sum-exp of the logits).

Backward (persistent grid of one wave, each program loops over token tiles), one pass over
the sources: ``c = sum_i a_i (dout . v_i) = dout . out`` comes from the saved output (the
sublayer's norm keeps that tensor alive anyway) and ``a_i = exp(logit_i - lse)``, so per
source ``v . v``, ``v . u`` and ``dout . v`` are reduced together and

    dv_i = a_i dout + dlogit_i r_i (u - logit_i r_i v_i / h),   dlogit_i = a_i (dout . v_i - c)

is written, or added to the gradient already in the destination (``ACCUMULATE`` bit i): a
source read by several depth-attention calls gets its gradient summed in place in one buffer
(``grads.SourceGrad``) instead of one tensor per call added up by autograd. ``g = sum_tokens
sum_i dlogit_i r_i v_i`` is accumulated in fp32 registers; each program writes one row of it,
the rows are summed afterwards (two-stage, deterministic for a given device), and
``dw = g * gamma``, ``dgamma = g * w``.

HBM traffic per token, n sources of h elements: forward n reads + 1 write; backward n + 2
reads (sources, dout, out), n writes, plus one read per accumulated source.

Sources and source gradients are passed as tuples of tensors (one pointer each, unrolled over
the constexpr n), so nothing is ever stacked.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add_triple(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _depth_attention_fwd_kernel(
    src_ptrs, query_ptr, norm_weight_ptr, out_ptr, lse_ptr, T, H, eps,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, FUSE_REDUCTIONS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    u = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    u = u * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)

    running_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    normaliser = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    # No stores inside this loop: a store may alias the next source, which would keep the
    # compiler from issuing the n loads early.
    for i in tl.static_range(N):
        v = tl.load(src_ptrs[i] + offs, mask=mask, other=0.0).to(tl.float32)
        if FUSE_REDUCTIONS:
            square_sum, vu = tl.reduce((v * v, v * u[None, :]), 1, _add_pair)
        else:
            square_sum = tl.sum(v * v, axis=1)
            vu = tl.sum(v * u[None, :], axis=1)
        logit = vu * tl.rsqrt(square_sum / H + eps)
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        weight = tl.exp(logit - new_max)
        normaliser = normaliser * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v
        running_max = new_max
    out = acc / normaliser[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, running_max + tl.log(normaliser), mask=row_mask)


@triton.jit
def _depth_attention_bwd_kernel(
    src_ptrs, grad_ptrs, query_ptr, norm_weight_ptr, out_ptr, grad_out_ptr, lse_ptr, partial_g_ptr,
    T, H, eps,
    N: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    FUSE_REDUCTIONS: tl.constexpr, PREFETCH: tl.constexpr,
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
        row_mask = rows < T
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        # The store of source i's grad may alias source i + 1 for all the compiler knows, so
        # source i + 1 (and its old grad) is loaded by hand before source i's grad is stored.
        if PREFETCH:
            v_next = tl.load(src_ptrs[0] + offs, mask=mask, other=0.0)
            old_next = v_next
            if ACCUMULATE & 1:
                old_next = tl.load(grad_ptrs[0] + offs, mask=mask, other=0.0)
        dout = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        c = tl.sum(dout * out, axis=1)  # = sum_i a_i (dout . v_i)
        for i in tl.static_range(N):
            if PREFETCH:
                v = v_next.to(tl.float32)
                old = old_next
                if i + 1 < N:
                    v_next = tl.load(src_ptrs[i + 1] + offs, mask=mask, other=0.0)
                    if (ACCUMULATE >> (i + 1)) & 1:
                        old_next = tl.load(grad_ptrs[i + 1] + offs, mask=mask, other=0.0)
            else:
                v = tl.load(src_ptrs[i] + offs, mask=mask, other=0.0).to(tl.float32)
                old = v
                if (ACCUMULATE >> i) & 1:
                    old = tl.load(grad_ptrs[i] + offs, mask=mask, other=0.0)
            if FUSE_REDUCTIONS:
                square_sum, vu, da = tl.reduce((v * v, v * u[None, :], v * dout), 1, _add_triple)
            else:
                square_sum = tl.sum(v * v, axis=1)
                vu = tl.sum(v * u[None, :], axis=1)
                da = tl.sum(v * dout, axis=1)
            rstd = tl.rsqrt(square_sum / H + eps)
            logit = vu * rstd
            a = tl.exp(logit - lse)
            coef = a * (da - c) * rstd  # dlogit_i * r_i
            if N == 1:  # one source: the softmax is constant (a = 1, dlogit = 0) exactly
                a = tl.full([BLOCK_T], 1.0, tl.float32)
                coef = tl.zeros([BLOCK_T], tl.float32)
            dv = a[:, None] * dout + coef[:, None] * (u[None, :] - (logit * rstd / H)[:, None] * v)
            if (ACCUMULATE >> i) & 1:
                dv += old.to(tl.float32)
            tl.store(grad_ptrs[i] + offs, dv.to(grad_ptrs[i].dtype.element_ty), mask=mask)
            g_acc += tl.sum(coef[:, None] * v, axis=0)

    tl.store(partial_g_ptr + pid.to(tl.int64) * H + cols, g_acc, mask=col_mask)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one program: BLOCK_T tokens by BLOCK_H (h padded to a power of two)."""

    block_t: int
    block_h: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def launch_config(hidden: int, tile_elements: int) -> LaunchConfig:
    """About ``tile_elements`` values per tile (whole rows), about 8 per thread.

    The unrolled source loop issues the n loads of a tile early (good for bandwidth), so
    registers grow with n x elements per thread; tests/kernels/test_attn_res_compile.py checks
    that ptxas (sm_90) reports no spills at n = 9 and h = 2048.
    """
    block_h = triton.next_power_of_2(hidden)
    block_t = max(1, min(16, tile_elements // block_h))
    num_warps = max(1, min(16, block_t * block_h // 256))
    return LaunchConfig(block_t, block_h, num_warps)


# Tile sizes (elements per token tile), read at call time so the benchmark can sweep them.
FORWARD_TILE_ELEMENTS = 2048
BACKWARD_TILE_ELEMENTS = 2048
# Backward programs per SM; None: as many as fit at once (from the compiled kernel's registers),
# so the persistent grid is exactly one wave (more programs than fit left a second, partial wave).
BACKWARD_PROGRAMS_PER_SM: int | None = None
FORWARD_FUSE_REDUCTIONS = True  # v.v and v.u as one two-operand reduction (one barrier, not two)
BACKWARD_FUSE_REDUCTIONS = True  # v.v, v.u, dout.v as one three-operand reduction
BACKWARD_PREFETCH = True  # load source i + 1 before computing (and storing) source i
_resident_programs: dict = {}
_PROMOTE_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)
_backward_capacities: dict = {}  # (device, kernel specialisation, settings) -> programs per wave


def _programs_per_sm(kernel, args, kwargs, num_warps: int, device: torch.device) -> int:
    """Programs of ``kernel`` resident per SM, from its register count (sm_90: 64K registers,
    64 warps, 32 blocks per SM; registers are allocated per warp in units of 256)."""
    key = (kernel, *kwargs.items(), num_warps, args[0][0].dtype, device)
    if key not in _resident_programs:
        try:
            compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **kwargs)
            compiled._init_handles()
            per_warp = -(-compiled.n_regs * 32 // 256) * 256
            warps = min(65536 // max(per_warp, 1), 64)
            _resident_programs[key] = max(1, min(warps // num_warps, 32))
        except Exception:  # no register count (e.g. another backend): a conservative guess
            _resident_programs[key] = 2
    return _resident_programs[key]


def _backward_capacity(device: torch.device, kernel=None, args=None, kwargs=None, num_warps=1) -> int:
    """Backward programs that run at once (one wave); the grid is ``min(tiles, capacity)``."""
    if device.type != "cuda":
        return 2  # interpreter: still exercises the per-program loop
    per_sm = BACKWARD_PROGRAMS_PER_SM or _programs_per_sm(kernel, args, kwargs, num_warps, device)
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def _tokens(source: torch.Tensor) -> tuple[int, int]:
    """(T, h) of a contiguous ``[..., h]`` source: the kernels index it as ``[T, h]``."""
    hidden = source.shape[-1]
    return (source.numel() // hidden if hidden else 0), hidden


def fused_depth_attention_forward(
    sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sources``: n contiguous ``[..., h]`` tensors (T tokens); returns (``out`` of their shape
    and dtype, ``lse [T]`` fp32, the log of the softmax normaliser)."""
    T, H = _tokens(sources[0])
    out = torch.empty_like(sources[0])
    lse = torch.empty(T, dtype=torch.float32, device=out.device)
    if T == 0:
        return out, lse
    cfg = launch_config(H, FORWARD_TILE_ELEMENTS)
    grid = (-(-T // cfg.block_t),)
    _depth_attention_fwd_kernel[grid](
        tuple(sources), query, norm_weight, out, lse, T, H, eps,
        N=len(sources), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, FUSE_REDUCTIONS=FORWARD_FUSE_REDUCTIONS,
        num_warps=cfg.num_warps,
    )
    return out, lse


def fused_depth_attention_backward(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_sources: Sequence[torch.Tensor],
    accumulate: Sequence[bool],
    need_query: bool = True,
    need_norm_weight: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Writes (or, where ``accumulate[i]``, adds) each source's grad into ``grad_sources[i]``
    (contiguous, the sources' shape); returns (grad query, grad norm_weight), ``None`` where
    not needed."""
    T, H = _tokens(sources[0])
    cfg = launch_config(H, BACKWARD_TILE_ELEMENTS)
    if T == 0:
        g = torch.zeros(H, dtype=torch.float32, device=grad_out.device)
    else:
        mask = 0
        for i, flag in enumerate(accumulate):
            if flag:
                mask |= 1 << i
        n = len(sources)
        device = grad_out.device
        key = (device, n, mask, cfg, sources[0].dtype, BACKWARD_FUSE_REDUCTIONS, BACKWARD_PREFETCH,
               BACKWARD_PROGRAMS_PER_SM)
        kwargs = dict(N=n, ACCUMULATE=mask, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
                      FUSE_REDUCTIONS=BACKWARD_FUSE_REDUCTIONS, PREFETCH=BACKWARD_PREFETCH)
        args = [tuple(sources), tuple(grad_sources), query, norm_weight, out, grad_out, lse, None, T, H, eps]
        capacity = _backward_capacities.get(key)
        if capacity is None:  # first call with this key: compile, read the register count
            args[7] = torch.empty((1, H), dtype=torch.float32, device=device)  # a stand-in
            capacity = _backward_capacities[key] = _backward_capacity(
                device, _depth_attention_bwd_kernel, args, kwargs, cfg.num_warps
            )
        programs = max(1, min(-(-T // cfg.block_t), capacity))
        args[7] = partial_g = torch.empty((programs, H), dtype=torch.float32, device=device)
        _depth_attention_bwd_kernel[(programs,)](*args, num_warps=cfg.num_warps, **kwargs)
        g = partial_g.sum(dim=0)
    # g is fp32; an fp32 x (fp32, bf16 or fp16) product is computed in fp32 (type promotion),
    # as with an explicit .float(); cast only where the parameter is not fp32.
    return (
        _product(g, norm_weight, query.dtype) if need_query else None,
        _product(g, query, norm_weight.dtype) if need_norm_weight else None,
    )


def _product(g: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    product = g * (other if other.dtype in _PROMOTE_TO_FP32 else other.float())
    return product if product.dtype == dtype else product.to(dtype)


class FusedDepthAttention(torch.autograd.Function):
    """Saves the sources, query, norm weight, the output and ``lse`` (fp32 [T]); one-pass backward.

    ``apply(query, norm_weight, eps, stacked, source_grads, *sources)``: with ``stacked`` one
    contiguous ``[n, ..., h]`` tensor is given (its grad comes back as one tensor); otherwise n
    contiguous ``[..., h]`` tensors (no views are made: the kernels index them as ``[T, h]``).
    ``source_grads`` is ``None`` or one :class:`~kernels.attn_res.grads.SourceGrad` (or ``None``)
    per source: a source with one gets its grad added into that buffer by the
    kernel and returns ``None`` to autograd; the others get a fresh tensor each.

    The output is saved for ``c = dout . out``: it is the tensor this op returns, which its
    consumer (the sublayer's input norm) keeps for its own backward, so no memory is added.
    """

    @staticmethod
    def forward(ctx, query, norm_weight, eps, stacked, source_grads, *sources):
        ctx.stacked = stacked
        ctx.source_grads = source_grads
        views = tuple(sources[0].unbind(0)) if stacked else sources
        ctx.eps = eps
        out, lse = fused_depth_attention_forward(views, query, norm_weight, eps)
        ctx.save_for_backward(query, norm_weight, out, lse, *sources)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, norm_weight, out, lse, *sources = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if ctx.stacked:
            grad_stacked = torch.empty_like(sources[0])
            views, dests, accumulate = tuple(sources[0].unbind(0)), tuple(grad_stacked.unbind(0)), ()
            returned = [grad_stacked if needs[5] else None]
        else:
            views, dests, accumulate, returned = tuple(sources), [], [], []
            source_grads = ctx.source_grads or (None,) * len(views)
            for v, source_grad, need in zip(views, source_grads, needs[5:]):
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
        grad_query, grad_norm_weight = fused_depth_attention_backward(
            views, query, norm_weight, ctx.eps, out, lse, grad_out.contiguous(), dests, accumulate,
            needs[0], needs[1],
        )
        return grad_query, grad_norm_weight, None, None, None, *returned
