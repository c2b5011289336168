"""The depth-attention backward kernel and the kernel that adds up its per-program partial sums (launched by
``backward.py`` with the launch table ``fused.BACKWARD_LAUNCH``; docs/attn_res.md, "Kernels and files").

The backward issues the loads of a token tile (all n sources, the output and its gradient) before any store,
with the sources held as loaded in tuples, so a program keeps many bytes in flight (a streaming kernel that
loaded one source ahead was slower and is gone: docs/bench/history/attn_res-notes.md). The grad loop reads each
source again (an L2 hit) and loads its old grad right after that source's row reductions, which leaves registers
for one row over 4 warps, two programs per SM. It can also serve a paired second call (``backward.PairedCall``:
the MLP sublayer's mix over the same blocks as the attention sublayer's), writing both calls' source gradients
in one read-modify-write of each shared block; that call's own pass (``SUBSET``) hands it the gradient of its
mix and the softmax backward's ``c`` (``HANDOFF``). The maths per source is in ``fused.py``'s module docstring.
"""

import triton
import triton.language as tl

from kimi_kernels.attn_res.reductions import batch_row_sums, row_sums4
from kimi_kernels.attn_res.rows import _load_rows, _rows_f32, _tile_offsets


@triton.jit
def _mix_output_grad(dy, out, out_rstd, gamma_out, H, out_norm_eps, NORM_OUT: tl.constexpr):
    """(dout, c = dout . out) of one call from its loaded ``dy`` and ``out`` rows (fp32): with
    ``NORM_OUT`` ``dy`` is the grad of ``RMSNorm(out)`` and the norm's backward runs first."""
    if NORM_OUT:
        gy = dy * gamma_out[None, :]
        dot = tl.sum(gy * out, axis=1)
        r3 = out_rstd * out_rstd * out_rstd
        dout = out_rstd[:, None] * gy - (r3 * dot / H)[:, None] * out
        c = out_norm_eps * r3 * dot  # = dout . out, exactly (module docstring)
    else:
        dout = dy
        c = tl.sum(dy * out, axis=1)
    return dout, c


@triton.jit
def _softmax_products(context, i: tl.constexpr, BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """Source i's products before their row sums: ``v . v``, ``v . u``, ``dout . v`` (``context``: the rows as
    loaded, the source pointers, ``u``, ``dout``)."""
    vs, src_ptrs, u, dout = context
    v = _rows_f32(vs[i], src_ptrs[i], BLOCK_H, PACK)
    return v * v, v * u[None, :], v * dout


@triton.jit
def _paired_softmax_products(context, i: tl.constexpr, BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """``_softmax_products`` and the paired call's ``v . u2``, ``dout2 . v`` (``context`` also ``u2``, ``dout2``)."""
    vs, src_ptrs, u, dout, u2, dout2 = context
    v = _rows_f32(vs[i], src_ptrs[i], BLOCK_H, PACK)
    return v * v, v * u[None, :], v * dout, v * u2[None, :], v * dout2


@triton.jit
def _tile_rows(src_ptrs, grad_out_ptr, out_ptr, grad_mix2_ptr, tile_at, H, N: tl.constexpr,
               BLOCK_H: tl.constexpr, PAIRED: tl.constexpr, PACK: tl.constexpr):
    """A tile's ``dy``, ``out``, the paired call's mix gradient (else ``dy`` again, never read) and the n
    sources, as loaded (``rows._load_rows``), in that order."""
    dy_raw = _load_rows(grad_out_ptr, tile_at, H, BLOCK_H, PACK)
    out_raw = _load_rows(out_ptr, tile_at, H, BLOCK_H, PACK)
    dmix2_raw = dy_raw
    if PAIRED > 0:
        dmix2_raw = _load_rows(grad_mix2_ptr, tile_at, H, BLOCK_H, PACK)
    vs = ()
    for i in tl.static_range(N):
        vs = vs + (_load_rows(src_ptrs[i], tile_at, H, BLOCK_H, PACK),)
    return dy_raw, out_raw, dmix2_raw, vs


@triton.jit
def _depth_attention_bwd_preload_kernel(
    src_ptrs, grad_ptrs, query_ptr, norm_weight_ptr, out_ptr, grad_out_ptr, lse_ptr, partial_g_ptr,
    out_norm_weight_ptr, out_rstd_ptr, partial_g_out_norm_ptr,
    query2_ptr, norm_weight2_ptr, grad_mix2_ptr, c2_ptr, lse2_ptr, partial_g2_ptr, handoff_grad_ptr, handoff_c_ptr,
    T, H, eps, out_norm_eps,
    N: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    NORM_OUT: tl.constexpr, SUBSET: tl.constexpr, PAIRED: tl.constexpr, HANDOFF: tl.constexpr,
    OUT_NORM_GRAD: tl.constexpr, PACK: tl.constexpr, BATCH: tl.constexpr,
):
    """The backward with the loads of a token tile issued before any store (``dy``, ``out``, the
    n sources), kept in registers as loaded (tuples over the unrolled sources); then the reductions and the
    grads, stored source by source (a store might alias a later load, so loads after it wait for it).

    ``SUBSET``: the sources are some of the call's (``lse`` covers all of them), so one source
    does not mean a constant softmax. ``PAIRED`` > 0: the first PAIRED sources also get the
    gradient of a second call that read them (same key-norm eps; its query, norm weight and ``lse``, and
    as its own pass handed them over, the gradient of its mix ``dout`` and its ``c``, under the ``*2``
    names): each shared source is read, and its grad written, once for both calls; the second call's
    ``g`` over those sources goes to ``partial_g2``. ``HANDOFF`` (with ``SUBSET``: the second call's own
    pass): ``dout`` rounded to ``handoff_grad``'s dtype is stored there, ``c = dout . out`` of that rounded
    ``dout`` to ``handoff_c``, and this pass uses the same two, so every source of the call sees one ``dout``
    and a ``c`` that is its exact softmax sum (the paired kernel then reads one 2-byte row, not ``dy`` and
    the fp32 ``out``, and runs no norm backward). ``OUT_NORM_GRAD``: accumulate ``dgamma_o`` of this call.
    Without ``SUBSET`` the kernel sees all of the call's sources and takes the softmax backward's
    ``c`` from them; with it (and for the second call of a pair, whose sources are split over two
    kernels) ``c`` comes from the stored output (saved in fp32 for a pair's second call). The grad
    loop reloads each source (just read by this program: an L2 hit) instead of holding it from the top (fewer
    registers, so more programs per SM), and each old grad is loaded right after its source's row reductions
    (into the registers that source's row freed), so its HBM latency overlaps the remaining reductions instead
    of being waited for once per source between stores (docs/bench/attnres-sweep-h200.json).
    ``PACK``: rows held across code (``dy``, ``out``, sources, old grads) as int32 pairs (``_load_rows``; where h
    is even and every 2-byte tensor 4-byte aligned).
    ``BATCH`` (1, 2 or 4; 1 with ``HANDOFF``): the row sums of that many sources in one reduction
    (``reductions.batch_row_sums``), one cross-warp exchange instead of BATCH."""
    tl.static_assert(BATCH == 1 or not HANDOFF, "the handoff's c is reduced with source 0's sums alone")
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    g_acc = tl.zeros([BLOCK_H], tl.float32)
    if NORM_OUT and OUT_NORM_GRAD:
        g_out_norm_acc = tl.zeros([BLOCK_H], tl.float32)
    if PAIRED > 0:
        g2_acc = tl.zeros([BLOCK_H], tl.float32)

    for tile in tl.range(pid, tl.cdiv(T, BLOCK_T), num_programs):
        tile_at = _tile_offsets(tile, T, H, cols, col_mask, BLOCK_T)
        rows, row_mask, mask, offs = tile_at
        # -- every load of the tile first ---------------------------------------------------------------
        dy_raw, out_raw, dmix2_raw, vs = _tile_rows(
            src_ptrs, grad_out_ptr, out_ptr, grad_mix2_ptr, tile_at, H, N, BLOCK_H, PAIRED, PACK)
        olds = ()  # the old grads being added to (placeholders where not accumulated; never read)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        # [h] vectors: loaded per tile (cache hits); held across the loop they cost registers.
        u = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        u = u * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dy = _rows_f32(dy_raw, grad_out_ptr, BLOCK_H, PACK)
        out = _rows_f32(out_raw, out_ptr, BLOCK_H, PACK)
        if NORM_OUT:
            out_rstd = tl.load(out_rstd_ptr + rows, mask=row_mask, other=0.0)
            gamma_out = tl.load(out_norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            if OUT_NORM_GRAD:
                g_out_norm_acc += tl.sum(dy * out * out_rstd[:, None], axis=0)
        else:
            out_rstd = lse
            gamma_out = u
        dout, c = _mix_output_grad(dy, out, out_rstd, gamma_out, H, out_norm_eps, NORM_OUT)
        if HANDOFF:  # the rounded dout, for this pass and the paired one (its c: with the first source's sums)
            dout_handed = dout.to(handoff_grad_ptr.dtype.element_ty)
            tl.store(handoff_grad_ptr + offs, dout_handed, mask=mask)
            dout = dout_handed.to(tl.float32)
        if PAIRED > 0:
            lse2 = tl.load(lse2_ptr + rows, mask=row_mask, other=0.0)
            c2 = tl.load(c2_ptr + rows, mask=row_mask, other=0.0)
            u2 = tl.load(query2_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            u2 = u2 * tl.load(norm_weight2_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            dout2 = _rows_f32(dmix2_raw, grad_mix2_ptr, BLOCK_H, PACK)
        # -- per source: the row reductions first (all sources are in registers) -------------------
        # per-row scalars kept per source: rstd, logit, dout . v (and the paired call's logit, dout . v)
        rstds, logits, das, logits2, das2 = (), (), (), (), ()
        c_exact = tl.zeros([BLOCK_T], tl.float32)
        for i in tl.static_range(N):
            # the row sums of BATCH sources at a time (batch_row_sums; one with BATCH 1), counted within the
            # paired sources and within the others (positions written out: a constexpr assigned to a name
            # becomes a runtime value)
            if HANDOFF and i == 0:  # c of the rounded dout, in the same reduction (one barrier less)
                v = _rows_f32(vs[i], src_ptrs[i], BLOCK_H, PACK)
                square_sum, vu, da, c = row_sums4(v * v, v * u[None, :], v * dout, dout * out)
                tl.store(handoff_c_ptr + rows, c, mask=row_mask)
            elif i < PAIRED:
                if i % BATCH == 0:
                    batch = batch_row_sums(_paired_softmax_products, (vs, src_ptrs, u, dout, u2, dout2), i, PAIRED,
                                           BATCH, BLOCK_H, PACK)
                square_sum, vu, da = batch[0][i % BATCH], batch[1][i % BATCH], batch[2][i % BATCH]
                vu2, da2 = batch[3][i % BATCH], batch[4][i % BATCH]
            else:
                if (i - PAIRED) % BATCH == 0:
                    batch = batch_row_sums(_softmax_products, (vs, src_ptrs, u, dout), i, N, BATCH, BLOCK_H, PACK)
                square_sum, vu, da = (batch[0][(i - PAIRED) % BATCH], batch[1][(i - PAIRED) % BATCH],
                                      batch[2][(i - PAIRED) % BATCH])
            rstd = tl.rsqrt(square_sum / H + eps)
            rstds, logits, das = rstds + (rstd,), logits + (vu * rstd,), das + (da,)
            if i < PAIRED:
                logits2, das2 = logits2 + (vu2 * rstd,), das2 + (da2,)
            if not SUBSET:
                c_exact += tl.exp(vu * rstd - lse) * da
            # the old grad, into the registers this source's row freed (reloaded in the grad pass)
            if (ACCUMULATE >> i) & 1:
                olds = olds + (_load_rows(grad_ptrs[i], tile_at, H, BLOCK_H, PACK),)
            else:
                olds = olds + (vs[i],)  # placeholder: not accumulated
        if not SUBSET:
            # c = sum_i a_i (dout . v_i), the softmax backward's own sum, from the sources. dout . out
            # (above) takes out as stored, rounded to bf16: dlogit_i = a_i (dout . v_i - c) is a difference
            # of close numbers, and that rounding made the query / norm-weight grads of a two-source mix
            # 5-10x less precise than PyTorch's bf16 autograd (docs/attn_res.md, "Precision of c").
            c = c_exact
        # -- per source: grad, store --------------------------------------------------------------
        for i in tl.static_range(N):
            v = tl.load(src_ptrs[i] + offs, mask=mask, other=0.0).to(tl.float32)  # reloaded: an L2 hit
            rstd, logit = rstds[i], logits[i]
            a = tl.exp(logit - lse)
            coef = a * (das[i] - c) * rstd  # dlogit_i * r_i
            if N == 1 and not SUBSET:  # the call's only source: a = 1, dlogit = 0 exactly
                a = tl.full([BLOCK_T], 1.0, tl.float32)
                coef = tl.zeros([BLOCK_T], tl.float32)
            g_acc += tl.sum(coef[:, None] * v, axis=0)
            if i < PAIRED:
                logit2 = logits2[i]
                a2 = tl.exp(logit2 - lse2)
                coef2 = a2 * (das2[i] - c2) * rstd
                g2_acc += tl.sum(coef2[:, None] * v, axis=0)
                scale_v = (coef * logit + coef2 * logit2) * rstd / H
                dv = (a[:, None] * dout + a2[:, None] * dout2 + coef[:, None] * u[None, :]
                      + coef2[:, None] * u2[None, :] - scale_v[:, None] * v)
            else:
                dv = a[:, None] * dout + coef[:, None] * (u[None, :] - (logit * rstd / H)[:, None] * v)
            if (ACCUMULATE >> i) & 1:
                dv += _rows_f32(olds[i], grad_ptrs[i], BLOCK_H, PACK)
            tl.store(grad_ptrs[i] + offs, dv.to(grad_ptrs[i].dtype.element_ty), mask=mask)

    tl.store(partial_g_ptr + pid.to(tl.int64) * H + cols, g_acc, mask=col_mask)
    if NORM_OUT and OUT_NORM_GRAD:
        tl.store(partial_g_out_norm_ptr + pid.to(tl.int64) * H + cols, g_out_norm_acc, mask=col_mask)
    if PAIRED > 0:
        tl.store(partial_g2_ptr + pid.to(tl.int64) * H + cols, g2_acc, mask=col_mask)


@triton.jit
def _depth_attention_finish_kernel(
    partial_ptr, out_ptr, query_ptr, norm_weight_ptr, grad_query_ptr, grad_norm_weight_ptr, grad_out_norm_ptr,
    H, P: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr,
    PARAMETER_GRADS: tl.constexpr,
):
    """``out[k] = sum_p partial[k, p]`` for the ROWS ``[P, h]`` partial-sum arrays stacked in
    ``partial`` (``[ROWS, P, h]``): one launch for all of them, in a fixed order (deterministic).

    ``PARAMETER_GRADS``: the parameters' grads are written instead, each in its own dtype: from row 0
    (``g``) ``grad_query = g * norm_weight`` and ``grad_norm_weight = g * query`` (fp32 products, as
    ``backward.parameter_grads`` computes them), and row 1, if ROWS = 2, as ``grad_out_norm`` (the fused
    output norm's ``dgamma_o``); three small torch ops fewer per call (host time)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < H
    for k in tl.static_range(ROWS):
        # P is a compile-time constant (the backward's one-wave grid: one value per device and specialisation), so
        # the loop unrolls; the rows are added elementwise into a [BLOCK_P, BLOCK] accumulator and reduced across
        # threads once at the end, so the loads do not wait on a cross-warp reduction each (a runtime loop with a
        # reduction per BLOCK_P rows was ~4x slower: docs/bench/attnres-sweep-finish-h200.json).
        acc2 = tl.zeros([BLOCK_P, BLOCK], tl.float32)
        for p0 in tl.static_range(0, P, BLOCK_P):
            prow = p0 + tl.arange(0, BLOCK_P)
            offs = (k * P + prow).to(tl.int64)[:, None] * H + cols[None, :]
            acc2 += tl.load(partial_ptr + offs, mask=(prow < P)[:, None] & col_mask[None, :], other=0.0)
        acc = tl.sum(acc2, axis=0)
        if PARAMETER_GRADS and k == 0:
            gamma = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w = tl.load(query_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(grad_query_ptr + cols, (acc * gamma).to(grad_query_ptr.dtype.element_ty), mask=col_mask)
            tl.store(grad_norm_weight_ptr + cols, (acc * w).to(grad_norm_weight_ptr.dtype.element_ty), mask=col_mask)
        elif PARAMETER_GRADS:
            tl.store(grad_out_norm_ptr + cols, acc.to(grad_out_norm_ptr.dtype.element_ty), mask=col_mask)
        else:
            tl.store(out_ptr + k * H + cols, acc, mask=col_mask)
