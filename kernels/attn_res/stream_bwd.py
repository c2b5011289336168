"""The streaming depth-attention backward (``fused.BACKWARD_KERNEL = "stream"``; the default is the preload
kernel in ``preload_bwd.py``). Maths in ``fused.py``'s module docstring."""

import triton
import triton.language as tl

from kernels.attn_res.reductions import row_sums3


@triton.jit
def _depth_attention_bwd_kernel(
    src_ptrs, grad_ptrs, query_ptr, norm_weight_ptr, out_ptr, grad_out_ptr, lse_ptr, partial_g_ptr,
    out_norm_weight_ptr, out_rstd_ptr, partial_g_out_norm_ptr,
    T, H, eps, out_norm_eps,
    N: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    FUSE_REDUCTIONS: tl.constexpr, PREFETCH: tl.constexpr, NORM_OUT: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    u = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    u = u * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    g_acc = tl.zeros([BLOCK_H], tl.float32)
    if NORM_OUT:
        g_out_norm_acc = tl.zeros([BLOCK_H], tl.float32)

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
        if NORM_OUT:  # dout is the grad of RMSNorm(out): the norm's backward first, in registers
            out_rstd = tl.load(out_rstd_ptr + rows, mask=row_mask, other=0.0)
            # Loaded per tile (a cache hit): held across the loop, it made ptxas spill at small h.
            gamma_out = tl.load(out_norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            g_out_norm_acc += tl.sum(dout * out * out_rstd[:, None], axis=0)
            dout = dout * gamma_out[None, :]
            dot = tl.sum(dout * out, axis=1)
            r3 = out_rstd * out_rstd * out_rstd
            dout = out_rstd[:, None] * dout - (r3 * dot / H)[:, None] * out
            c = out_norm_eps * r3 * dot  # = dout . out, exactly (see the module docstring)
        else:
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
                square_sum, vu, da = row_sums3(v * v, v * u[None, :], v * dout)
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
    if NORM_OUT:
        tl.store(partial_g_out_norm_ptr + pid.to(tl.int64) * H + cols, g_out_norm_acc, mask=col_mask)
