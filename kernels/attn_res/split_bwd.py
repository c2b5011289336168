"""The two-pass depth-attention backward (``fused.BACKWARD_KERNEL = "split"``): per-token scalars first, then
a streaming pass that writes the source gradients (docs/attn_res.md, "Backward, two passes").

The one-pass kernels (``preload_bwd.py``) hold a token's n source rows from their loads through the row
reductions to the grad stores: whole rows over one program, two programs per SM, a latency chain per token
(loads, cross-warp reductions, stores) that kept the backward near 2.2 TB/s on an H200. Here the two halves
run as separate kernels that hold nothing across sources:

* ``_depth_attention_bwd_scalars_kernel`` (one warp per token row, h in chunks) reduces, per source, the dot
  products the softmax backward needs (``v . v``, ``v . u``, ``v . dout``; with a paired call also its
  ``v . u2``, ``v . dout2``) and writes per (token, source) the three coefficients of the gradient,

      dv_i = a_i dout + coef_i u - scale_i v_i,   coef_i = a_i (dout . v_i - c) r_i,   scale_i = coef_i logit_i r_i / h

  (``fused.py``'s module docstring has the maths; a paired call adds ``a2_i dout2 + coef2_i u2`` and its part of
  ``scale_i``), fp32, as ``scalars[k, t]`` (row k per coefficient, tokens contiguous);
* ``_depth_attention_bwd_grads_kernel`` (tiles of tokens x columns, a grid over both) streams the sources again
  with ``dy`` and ``out`` (``dout`` is rebuilt from them and two per-token scalars, not stored), writes (or adds
  into) each source's grad, and sums ``g = sum_t coef_i v_i`` (and ``g2``, ``dgamma_o``) per program into
  partial rows for the finish kernel.

It reads each source twice from HBM (the one-pass kernels' second read hits L2) and ``dy``/``out`` twice: ~40%
more bytes, in exchange for kernels that keep many rows in flight per SM.
"""

import triton
import triton.language as tl

# Values per thread along h in the scalars kernel's chunk: one 16-byte load of a 2-byte row.
_VALUES_PER_THREAD = tl.constexpr(8)


@triton.jit
def _thread_sums(x, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``[BLOCK_T, BLOCK_C]`` -> ``[BLOCK_T, BLOCK_C / 8]``: each thread's 8 consecutive values summed in place
    (no shuffles); the row sums are taken once, after the last chunk."""
    return tl.sum(tl.reshape(x, [BLOCK_T, BLOCK_C // _VALUES_PER_THREAD, _VALUES_PER_THREAD]), axis=2)


@triton.jit
def _chunk(ptr, rows, row_mask, cols, col_mask, H):
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _vector(ptr, cols, col_mask, BLOCK_T: tl.constexpr):
    """An ``[h]`` vector's chunk broadcast to ``[BLOCK_T, BLOCK_C]``, loaded in that shape (L1 hits) so that it
    gets the tiles' register layout: loaded as ``[BLOCK_C]`` (or ``[1, BLOCK_C]``) it got another one, and every
    chunk converted it through shared memory (three barriers per chunk in the scalars kernel)."""
    at = cols[None, :] + tl.zeros([BLOCK_T, 1], tl.int32)
    return tl.load(ptr + at, mask=col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _depth_attention_bwd_scalars_kernel(
    src_ptrs, query_ptr, norm_weight_ptr, out_ptr, grad_out_ptr, lse_ptr, out_norm_weight_ptr, out_rstd_ptr,
    query2_ptr, norm_weight2_ptr, out2_ptr, grad_out2_ptr, lse2_ptr, out_norm_weight2_ptr, out_rstd2_ptr,
    scalars_ptr, T, H, eps, out_norm_eps, out_norm_eps2,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    NORM_OUT: tl.constexpr, SUBSET: tl.constexpr, PAIRED: tl.constexpr,
):
    """Per-token coefficients of BLOCK_T tokens (module docstring). ``SUBSET`` / ``PAIRED`` as in the preload
    kernel: ``c`` from the sources unless ``SUBSET`` (then from the stored output: ``dout . out``); the paired
    call's ``c2`` always from its stored (fp32) output. Writes rows ``3 i .. 3 i + 2`` (a, coef, scale of source
    i), ``3 N + 2 i``, ``+1`` (a2, coef2, i < PAIRED), and with ``NORM_OUT`` ``3 N + 2 PAIRED`` .. ``+3``
    (``s``, ``k``, ``s2``, ``k2``: ``dout = s gamma_o dy - k out``)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    parts: tl.constexpr = BLOCK_C // _VALUES_PER_THREAD
    # -- sweep 1: p = (dy * gamma_o) . out per token (the norm's backward; without it, c = dy . out) -----------
    p = tl.zeros([BLOCK_T, parts], tl.float32)
    p2 = tl.zeros([BLOCK_T, parts], tl.float32)
    for c0 in tl.range(0, H, BLOCK_C):  # a loop, not unrolled: unrolled, the chunks' loads were all hoisted
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < H
        gy = _chunk(grad_out_ptr, rows, row_mask, cols, col_mask, H)
        if NORM_OUT:
            gy = gy * _vector(out_norm_weight_ptr, cols, col_mask, BLOCK_T)
        p += _thread_sums(gy * _chunk(out_ptr, rows, row_mask, cols, col_mask, H), BLOCK_T, BLOCK_C)
        if PAIRED > 0:
            gy2 = _chunk(grad_out2_ptr, rows, row_mask, cols, col_mask, H)
            if NORM_OUT:
                gy2 = gy2 * _vector(out_norm_weight2_ptr, cols, col_mask, BLOCK_T)
            p2 += _thread_sums(gy2 * _chunk(out2_ptr, rows, row_mask, cols, col_mask, H), BLOCK_T, BLOCK_C)
    dot, dot2 = tl.sum(p, axis=1), tl.sum(p2, axis=1)
    s = tl.full([BLOCK_T], 1.0, tl.float32)
    k = tl.zeros([BLOCK_T], tl.float32)
    c_stored, c2 = dot, dot2
    s2, k2 = s, k
    if NORM_OUT:
        s = tl.load(out_rstd_ptr + rows, mask=row_mask, other=0.0)
        k = s * s * s * dot / H
        c_stored = out_norm_eps * s * s * s * dot  # = dout . out exactly (fused.py's module docstring)
        if PAIRED > 0:
            s2 = tl.load(out_rstd2_ptr + rows, mask=row_mask, other=0.0)
            k2 = s2 * s2 * s2 * dot2 / H
            c2 = out_norm_eps2 * s2 * s2 * s2 * dot2
    # -- sweep 2: per source v . v, v . u, v . dout (and the paired call's v . u2, v . dout2) ---------------
    vv, vu, vd, vu2, vd2 = (), (), (), (), ()
    for i in tl.static_range(N):
        vv = vv + (tl.zeros([BLOCK_T, parts], tl.float32),)
        vu = vu + (tl.zeros([BLOCK_T, parts], tl.float32),)
        vd = vd + (tl.zeros([BLOCK_T, parts], tl.float32),)
        if i < PAIRED:
            vu2 = vu2 + (tl.zeros([BLOCK_T, parts], tl.float32),)
            vd2 = vd2 + (tl.zeros([BLOCK_T, parts], tl.float32),)
    for c0 in tl.range(0, H, BLOCK_C):  # a loop, not unrolled: unrolled, the chunks' loads were all hoisted
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < H
        dout = _chunk(grad_out_ptr, rows, row_mask, cols, col_mask, H)  # an L2 hit: sweep 1 read it
        if NORM_OUT:
            out = _chunk(out_ptr, rows, row_mask, cols, col_mask, H)
            dout = s[:, None] * dout * _vector(out_norm_weight_ptr, cols, col_mask, BLOCK_T) - k[:, None] * out
        u = _vector(query_ptr, cols, col_mask, BLOCK_T) * _vector(norm_weight_ptr, cols, col_mask, BLOCK_T)
        if PAIRED > 0:
            dout2 = _chunk(grad_out2_ptr, rows, row_mask, cols, col_mask, H)
            if NORM_OUT:
                out2 = _chunk(out2_ptr, rows, row_mask, cols, col_mask, H)
                dout2 = (s2[:, None] * dout2 * _vector(out_norm_weight2_ptr, cols, col_mask, BLOCK_T)
                         - k2[:, None] * out2)
            u2 = _vector(query2_ptr, cols, col_mask, BLOCK_T) * _vector(norm_weight2_ptr, cols, col_mask, BLOCK_T)
        next_vv, next_vu, next_vd, next_vu2, next_vd2 = (), (), (), (), ()
        for i in tl.static_range(N):
            v = _chunk(src_ptrs[i], rows, row_mask, cols, col_mask, H)
            next_vv = next_vv + (vv[i] + _thread_sums(v * v, BLOCK_T, BLOCK_C),)
            next_vu = next_vu + (vu[i] + _thread_sums(v * u, BLOCK_T, BLOCK_C),)
            next_vd = next_vd + (vd[i] + _thread_sums(v * dout, BLOCK_T, BLOCK_C),)
            if i < PAIRED:
                next_vu2 = next_vu2 + (vu2[i] + _thread_sums(v * u2, BLOCK_T, BLOCK_C),)
                next_vd2 = next_vd2 + (vd2[i] + _thread_sums(v * dout2, BLOCK_T, BLOCK_C),)
        vv, vu, vd, vu2, vd2 = next_vv, next_vu, next_vd, next_vu2, next_vd2
    # -- the coefficients -----------------------------------------------------------------------------------
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    rstds, logits, weights, das = (), (), (), ()
    c = tl.zeros([BLOCK_T], tl.float32)
    for i in tl.static_range(N):
        rstd = tl.rsqrt(tl.sum(vv[i], axis=1) / H + eps)
        logit = tl.sum(vu[i], axis=1) * rstd
        a = tl.exp(logit - lse)
        da = tl.sum(vd[i], axis=1)
        c += a * da  # c = sum_i a_i (dout . v_i): from the sources, not the rounded output (docs/attn_res.md)
        rstds, logits, weights, das = rstds + (rstd,), logits + (logit,), weights + (a,), das + (da,)
    if SUBSET:
        c = c_stored
    if PAIRED > 0:
        lse2 = tl.load(lse2_ptr + rows, mask=row_mask, other=0.0)
    out_at = scalars_ptr + rows
    for i in tl.static_range(N):
        rstd, logit, a = rstds[i], logits[i], weights[i]
        coef = a * (das[i] - c) * rstd
        if N == 1 and not SUBSET:  # the call's only source: a = 1, dlogit = 0 exactly
            a = tl.full([BLOCK_T], 1.0, tl.float32)
            coef = tl.zeros([BLOCK_T], tl.float32)
        scale = coef * logit * rstd / H
        if i < PAIRED:
            logit2 = tl.sum(vu2[i], axis=1) * rstd
            a2 = tl.exp(logit2 - lse2)
            coef2 = a2 * (tl.sum(vd2[i], axis=1) - c2) * rstd
            scale += coef2 * logit2 * rstd / H
            tl.store(out_at + (3 * N + 2 * i) * T, a2, mask=row_mask)
            tl.store(out_at + (3 * N + 2 * i + 1) * T, coef2, mask=row_mask)
        tl.store(out_at + (3 * i) * T, a, mask=row_mask)
        tl.store(out_at + (3 * i + 1) * T, coef, mask=row_mask)
        tl.store(out_at + (3 * i + 2) * T, scale, mask=row_mask)
    if NORM_OUT:
        tl.store(out_at + (3 * N + 2 * PAIRED) * T, s, mask=row_mask)
        tl.store(out_at + (3 * N + 2 * PAIRED + 1) * T, k, mask=row_mask)
        if PAIRED > 0:
            tl.store(out_at + (3 * N + 2 * PAIRED + 2) * T, s2, mask=row_mask)
            tl.store(out_at + (3 * N + 2 * PAIRED + 3) * T, k2, mask=row_mask)


@triton.jit
def _depth_attention_bwd_grads_kernel(
    src_ptrs, grad_ptrs, query_ptr, norm_weight_ptr, out_ptr, grad_out_ptr, out_norm_weight_ptr,
    query2_ptr, norm_weight2_ptr, out2_ptr, grad_out2_ptr, out_norm_weight2_ptr,
    scalars_ptr, partial_ptr, T, H,
    N: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    NORM_OUT: tl.constexpr, PAIRED: tl.constexpr, OUT_NORM_GRAD: tl.constexpr,
):
    """Source grads from the scalars kernel's coefficients, a BLOCK_T x BLOCK_C tile at a time: program
    (group, column chunk) walks the token tiles group, group + groups, ... and writes its sums of ``g``
    (``coef_i v_i``), then ``dgamma_o`` (``dy out s``, with ``OUT_NORM_GRAD``), then ``g2`` (``PAIRED``) into
    ``partial[row, group, columns]`` (``[rows, groups, h]``, ``fused._finish_sums`` adds them up).
    ``ACCUMULATE`` bit i: source i's grad is added to what its destination holds."""
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < H
    u = _vector(query_ptr, cols, col_mask, BLOCK_T) * _vector(norm_weight_ptr, cols, col_mask, BLOCK_T)
    g_acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if NORM_OUT:
        gamma_out = _vector(out_norm_weight_ptr, cols, col_mask, BLOCK_T)
        if OUT_NORM_GRAD:
            g_out_norm_acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if PAIRED > 0:
        u2 = _vector(query2_ptr, cols, col_mask, BLOCK_T) * _vector(norm_weight2_ptr, cols, col_mask, BLOCK_T)
        g2_acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        if NORM_OUT:
            gamma_out2 = _vector(out_norm_weight2_ptr, cols, col_mask, BLOCK_T)
    norm_row: tl.constexpr = 3 * N + 2 * PAIRED
    for tile in tl.range(group, tl.cdiv(T, BLOCK_T), groups):
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        row_mask = rows < T
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        at = scalars_ptr + rows
        dout = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM_OUT:
            out = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(at + norm_row * T, mask=row_mask, other=0.0)
            k = tl.load(at + (norm_row + 1) * T, mask=row_mask, other=0.0)
            if OUT_NORM_GRAD:
                g_out_norm_acc += dout * out * s[:, None]
            dout = s[:, None] * dout * gamma_out - k[:, None] * out
        if PAIRED > 0:
            dout2 = tl.load(grad_out2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if NORM_OUT:
                out2 = tl.load(out2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                s2 = tl.load(at + (norm_row + 2) * T, mask=row_mask, other=0.0)
                k2 = tl.load(at + (norm_row + 3) * T, mask=row_mask, other=0.0)
                dout2 = s2[:, None] * dout2 * gamma_out2 - k2[:, None] * out2
        # Every row of the tile loaded before the first store (a later load never passes a store: the compiler
        # cannot know the grads do not alias the sources), so a program keeps them all in flight at once.
        vs, olds = (), ()
        for i in tl.static_range(N):
            vs = vs + (tl.load(src_ptrs[i] + offs, mask=mask, other=0.0),)
            if (ACCUMULATE >> i) & 1:
                olds = olds + (tl.load(grad_ptrs[i] + offs, mask=mask, other=0.0),)
            else:
                olds = olds + (vs[i],)  # a placeholder, never read
        for i in tl.static_range(N):
            v = vs[i].to(tl.float32)
            a = tl.load(at + (3 * i) * T, mask=row_mask, other=0.0)
            coef = tl.load(at + (3 * i + 1) * T, mask=row_mask, other=0.0)
            scale = tl.load(at + (3 * i + 2) * T, mask=row_mask, other=0.0)
            dv = a[:, None] * dout + coef[:, None] * u - scale[:, None] * v
            g_acc += coef[:, None] * v
            if i < PAIRED:
                a2 = tl.load(at + (3 * N + 2 * i) * T, mask=row_mask, other=0.0)
                coef2 = tl.load(at + (3 * N + 2 * i + 1) * T, mask=row_mask, other=0.0)
                dv += a2[:, None] * dout2 + coef2[:, None] * u2
                g2_acc += coef2[:, None] * v
            if (ACCUMULATE >> i) & 1:
                dv += olds[i].to(tl.float32)
            tl.store(grad_ptrs[i] + offs, dv.to(grad_ptrs[i].dtype.element_ty), mask=mask)
    row = 0
    tl.store(partial_ptr + (row * groups + group).to(tl.int64) * H + cols, tl.sum(g_acc, axis=0), mask=col_mask)
    if NORM_OUT and OUT_NORM_GRAD:
        row += 1
        tl.store(partial_ptr + (row * groups + group).to(tl.int64) * H + cols, tl.sum(g_out_norm_acc, axis=0),
                 mask=col_mask)
    if PAIRED > 0:
        row += 1
        tl.store(partial_ptr + (row * groups + group).to(tl.int64) * H + cols, tl.sum(g2_acc, axis=0),
                 mask=col_mask)
