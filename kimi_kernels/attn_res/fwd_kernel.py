"""The depth-attention forward kernel (``fused.fused_depth_attention_forward`` launches it by the launch table
``fused.FORWARD_LAUNCH``; the maths and the byte count are in ``fused.py``'s module docstring)."""

import triton
import triton.language as tl

from kimi_kernels.attn_res.reductions import batch_row_sums
from kimi_kernels.attn_res.rows import _load_rows, _rows_f32


@triton.jit
def _logit_products(context, i: tl.constexpr, BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """``v . v`` and ``v . u`` of source i before their row sums (``context``: the rows as loaded, the source
    pointers, ``u``)."""
    vs, src_ptrs, u = context
    v = _rows_f32(vs[i], src_ptrs[i], BLOCK_H, PACK)
    return v * v, v * u[None, :]


@triton.jit
def _mix_tile(
    src_ptrs, vs, tile_at, u, cols, col_mask, out_ptr, lse_ptr, out_norm_weight_ptr, normed_ptr,
    out_rstd_ptr, H, eps, out_norm_eps,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, NORM_OUT: tl.constexpr, PACK: tl.constexpr,
    BATCH: tl.constexpr,
):
    """One token tile of the forward: the mix of its rows (``vs``: as loaded), stored with its lse (and the fused
    norm)."""
    rows, row_mask, mask, offs = tile_at
    running_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    normaliser = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for i in tl.static_range(N):
        v = _rows_f32(vs[i], src_ptrs[i], BLOCK_H, PACK)
        # one reduction for sources i .. i + BATCH - 1
        if i % BATCH == 0:
            batch = batch_row_sums(_logit_products, (vs, src_ptrs, u), i, N, BATCH, BLOCK_H, PACK)
        square_sum, vu = batch[0][i % BATCH], batch[1][i % BATCH]
        logit = vu * tl.rsqrt(square_sum / H + eps)
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        weight = tl.exp(logit - new_max)
        normaliser = normaliser * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v
        running_max = new_max
    out = (acc / normaliser[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out, mask=mask)
    tl.store(lse_ptr + rows, running_max + tl.log(normaliser), mask=row_mask)
    if NORM_OUT:  # RMSNorm of the output as stored (rounded to its dtype), as the sublayer's norm would compute it
        x = out.to(tl.float32)
        out_rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + out_norm_eps)
        gamma_out = tl.load(out_norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        normed = x * out_rstd[:, None] * gamma_out[None, :]
        tl.store(normed_ptr + offs, normed.to(normed_ptr.dtype.element_ty), mask=mask)
        tl.store(out_rstd_ptr + rows, out_rstd, mask=row_mask)


@triton.jit
def _depth_attention_fwd_kernel(
    src_ptrs, query_ptr, norm_weight_ptr, out_ptr, lse_ptr, out_norm_weight_ptr, normed_ptr, out_rstd_ptr,
    T, H, eps, out_norm_eps,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, NORM_OUT: tl.constexpr, PACK: tl.constexpr,
    BATCH: tl.constexpr,
):
    """One program per token tile; the n source loads are issued before the first row reduction. ``PACK``: the
    sources' 2-byte rows loaded and held as int32 pairs, unpacked at use (``rows._load_rows``): the same values,
    so the same results bit for bit (the launcher packs where h is even and the sources 4-byte aligned). ``BATCH``
    (1, 2 or 4; ``fused.FORWARD_LAUNCH`` by the call's width): the row sums of that many sources in one reduction
    (``reductions.batch_row_sums``), one cross-warp exchange instead of BATCH. A persistent grid with the next
    tile's rows in flight was measured and dropped (docs/bench/history/attn_res-notes.md)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    # rows._tile_offsets's result, written out: computing the rows before cols, in this order, keeps ptxas at
    # 80 registers at n = 4 where the helper's order (cols first) took 96
    tile_at = (rows, row_mask, mask, offs)
    u = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    u = u * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # No stores before the mix: a store may alias the next source, which would keep the compiler from
    # issuing the n loads early. All n loads are issued first in program order (each source's row reduction
    # is a barrier, which later loads do not move above).
    vs = ()
    for i in tl.static_range(N):
        vs = vs + (_load_rows(src_ptrs[i], tile_at, H, BLOCK_H, PACK),)
    _mix_tile(src_ptrs, vs, tile_at, u, cols, col_mask, out_ptr, lse_ptr, out_norm_weight_ptr,
              normed_ptr, out_rstd_ptr, H, eps, out_norm_eps, N, BLOCK_T, BLOCK_H, NORM_OUT, PACK, BATCH)
