"""Per-chunk backward: everything except the reverse state walk (state.py), in two kernels.

`intra_bwd_dv_kernel` (one program per (chunk, head)) contracts over V for the [64, 64] chunk-mixing
gradients and dv. With u = Ainv (beta v - kb S) (kb = beta k exp(G)), dAinv = du (beta v - kb S)^T, so
    dL = -(Ainv^T dAinv Ainv^T) = -(Ainv^T du) u^T   (strictly lower, L = diag(beta) Akk),
    dMqk = dO u^T,  dv = beta Ainv^T du:
one [64, 64] product Ainv^T du per V tile serves dv and dL, and neither S nor k is read.
`intra_bwd_dqkg_kernel` (one program per (K tile, chunk, head)) is column-local in K: the state
contractions dw = -du S^T, dkgl = u dS^T, dqg = dO S^T for its K columns, then dMqk / dL through the decayed
products (same reference-row factorisation as the forward, as full 64-row dots whose rows or columns are
masked to one 16-row block), the reverse cumsum dg = sum_{s >= t} dG_s, and the gate derivatives.
Splitting K keeps each program's accumulators at a few [64, 64] tiles, so nothing spills on sm_90
(tests/kernels/test_kda_compile.py). Both kernels write per-program partial sums (dbeta over K tiles,
dA_log and ddt_bias over chunks) that the host adds up: deterministic, no atomics.

Precision (bf16 inputs): dG is a sum of terms that cancel (exp(G_t - G_s) is shift-invariant: the pair (t, s)
adds X_ts to dG_t on the row side and -X_ts to dG_s on the column side). Both sides used to round their
decayed operands (q e^{G-r} on one side, k e^{r-G} on the other) to bf16 differently, so the pairs did not
cancel and dg, dA_log, ddt_bias carried errors of the size of the cancelled terms. Now every fp32 operand
that feeds dG (the decayed q / k tiles, dw, Ainv^T du) goes through dot_split (bf16 hi + lo, ~16 bits), and
dMqk / dL are rounded once (bf16 scratch) so both sides of a pair see the same value.
"""

import triton
import triton.language as tl

from kernels.kda.gate import gate_grads
from kernels.kda.intra import dot_split, load_tile, store_tile, to_dot


@triton.jit
def intra_bwd_dv_kernel(v, beta, U, dU, dO, Ainv, dM_buf, dL_buf, dv, dbeta_parts, chunk_start, chunk_len, scale,
                        H, V: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    t = tl.arange(0, 64)
    row_ok = t < n
    b_all = tl.load(beta + (t0 + t) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    a_dot_t = tl.trans(to_dot(load_tile(Ainv, t0, n, h, H, 64, 0, 64), DOT_BF16))
    d_m = tl.zeros([64, 64], dtype=tl.float32)
    d_l = tl.zeros([64, 64], dtype=tl.float32)
    d_b = tl.zeros([64], dtype=tl.float32)
    for v0 in range(0, V, BV):
        u = load_tile(U, t0, n, h, H, V, v0, BV)
        du = to_dot(load_tile(dU, t0, n, h, H, V, v0, BV), DOT_BF16)
        do = to_dot(load_tile(dO, t0, n, h, H, V, v0, BV), DOT_BF16)
        vv = load_tile(v, t0, n, h, H, V, v0, BV)
        d_m += tl.dot(do, tl.trans(to_dot(u, DOT_BF16)))
        d_vb = tl.dot(a_dot_t, du)  # Ainv^T du
        d_l -= dot_split(d_vb, tl.trans(u), True, DOT_BF16)
        store_tile(dv, d_vb * b_all[:, None], t0, n, h, H, V, v0, BV)
        d_b += tl.sum(d_vb * vv, 1)
    valid = row_ok[:, None] & row_ok[None, :]
    store_tile(dL_buf, tl.where(valid & (t[None, :] < t[:, None]), d_l, 0.0), t0, n, h, H, 64, 0, 64)
    store_tile(dM_buf, tl.where(valid & (t[None, :] <= t[:, None]), d_m * scale, 0.0), t0, n, h, H, 64, 0, 64)
    tl.store(dbeta_parts + (t0 + t) * H + h, d_b, mask=row_ok)


@triton.jit
def load_col(ptr, t0, col, h, H, D: tl.constexpr, kc, BKT: tl.constexpr):
    """Row `col` of a chunk, columns kc..kc+BKT-1, fp32 [BKT]."""
    d = kc + tl.arange(0, BKT)
    return tl.load(ptr + (t0 + col) * H * D + h * D + d, mask=d < D, other=0.0).to(tl.float32)


@triton.jit
def intra_bwd_dqkg_kernel(q, k, beta, G, hbuf, dhbuf, U, dU, dO, Ainv, dM_buf, dL_buf, f, A_log, dt_bias,
                          dq, dk, dg, dbeta_parts, dA_parts, ddt_parts, chunk_start, chunk_len, scale,
                          lower_bound, H, part_stride, K: tl.constexpr, V: tl.constexpr, BKT: tl.constexpr,
                          BV: tl.constexpr, SAFE_GATE: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                          HAS_BIAS: tl.constexpr, DOT_BF16: tl.constexpr):
    kt, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    kc = kt * BKT
    t, d = tl.arange(0, 64), kc + tl.arange(0, BKT)
    kmask, row_ok = d < K, t < n
    m2 = row_ok[:, None] & kmask[None, :]

    # 1) state contractions over V for this K tile
    d_w = tl.zeros([64, BKT], dtype=tl.float32)
    d_kgl = tl.zeros([64, BKT], dtype=tl.float32)
    d_qg = tl.zeros([64, BKT], dtype=tl.float32)
    d_glast = tl.zeros([BKT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        S = tl.load(tl.make_block_ptr(hbuf + (c * H + h) * K * V, (K, V), (V, 1), (kc, v0), (BKT, BV), (1, 0)),
                    boundary_check=(0, 1), padding_option="zero")
        dS = tl.load(tl.make_block_ptr(dhbuf + (c * H + h) * K * V, (K, V), (V, 1), (kc, v0), (BKT, BV), (1, 0)),
                     boundary_check=(0, 1), padding_option="zero")
        S_t = tl.trans(to_dot(S, DOT_BF16))
        d_w -= tl.dot(to_dot(load_tile(dU, t0, n, h, H, V, v0, BV), DOT_BF16), S_t)
        d_qg += tl.dot(to_dot(load_tile(dO, t0, n, h, H, V, v0, BV), DOT_BF16), S_t)
        d_kgl += tl.dot(to_dot(load_tile(U, t0, n, h, H, V, v0, BV), DOT_BF16), tl.trans(to_dot(dS, DOT_BF16)))
        d_glast += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)

    # 2) through w = Ainv kb (kb = beta k e^G), kgl = k e^{Gl - G}, qg = scale q e^G
    q_c = load_tile(q, t0, n, h, H, K, kc, BKT)
    k_c = load_tile(k, t0, n, h, H, K, kc, BKT)
    g_c = load_tile(G, t0, n, h, H, K, kc, BKT)
    b_all = tl.load(beta + (t0 + t) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    e_g = tl.exp(g_c)
    d_kb = dot_split(tl.trans(load_tile(Ainv, t0, n, h, H, 64, 0, 64)), d_w, False, DOT_BF16)
    d_k = d_kb * b_all[:, None] * e_g
    d_b = tl.sum(d_kb * k_c * e_g, 1)
    d_g = d_k * k_c
    g_last = load_col(G, t0, n - 1, h, H, K, kc, BKT)
    e_l = tl.exp(tl.where(m2, g_last[None, :] - g_c, float("-inf")))
    d_k += d_kgl * e_l
    d_g -= d_kgl * k_c * e_l
    last_terms = tl.sum(d_kgl * k_c * e_l, 0) + tl.exp(g_last) * d_glast
    d_g += tl.where(t[:, None] == n - 1, last_terms[None, :], 0.0)
    d_q = d_qg * e_g * scale
    d_g += d_q * q_c

    # 3) dMqk, dL through the decayed products, one 16-row block (reference row r) at a time
    d_m = to_dot(load_tile(dM_buf, t0, n, h, H, 64, 0, 64), DOT_BF16)  # rounded once: both sides of a pair
    d_l = to_dot(load_tile(dL_buf, t0, n, h, H, 64, 0, 64), DOT_BF16)  # see the same value and cancel exactly
    kb_c = k_c * b_all[:, None]
    for r0 in range(0, n, 16):  # a loop, not unrolled: one block's temporaries live at a time
        g_r = load_col(G, t0, tl.minimum(r0, n - 1), h, H, K, kc, BKT)
        in_block = (t >= r0) & (t < r0 + 16) & row_ok
        e_row = tl.exp(tl.where(in_block[:, None] & kmask[None, :], g_c - g_r[None, :], float("-inf")))
        if SAFE_GATE:
            ncol = r0 + 16
        else:
            ncol = r0
        e_col = tl.exp(tl.where(((t < ncol) & row_ok)[:, None] & kmask[None, :], g_r[None, :] - g_c, float("-inf")))
        # column side: what rows t of the block send to key s
        col = dot_split(tl.trans(d_m), q_c * e_row, False, DOT_BF16)
        col = (col + dot_split(tl.trans(d_l), kb_c * e_row, False, DOT_BF16)) * e_col
        # row side: what keys s send to the rows t of the block
        kl = k_c * e_col
        r_q = dot_split(d_m, kl, False, DOT_BF16) * e_row
        r_k = dot_split(d_l, kl, False, DOT_BF16) * e_row
        d_q += r_q
        d_k += col + b_all[:, None] * r_k
        d_g += q_c * r_q + kb_c * r_k - col * k_c
        d_b += tl.sum(k_c * r_k, 1)
    if not SAFE_GATE:  # diagonal tiles position by position (unbounded gate): exp(G_t - G_s), t >= s, same tile
        for s in range(0, n):
            k_s = load_col(k, t0, s, h, H, K, kc, BKT)
            g_s = load_col(G, t0, s, h, H, K, kc, BKT)
            ok = (t >= s) & (t < (s // 16) * 16 + 16) & row_ok
            e = tl.exp(tl.where(ok[:, None] & kmask[None, :], g_c - g_s[None, :], float("-inf")))
            dm_s = tl.load(dM_buf + (t0 + t) * H * 64 + h * 64 + s, mask=row_ok, other=0.0).to(tl.float32)
            dl_s = tl.load(dL_buf + (t0 + t) * H * 64 + h * 64 + s, mask=row_ok, other=0.0).to(tl.float32)
            p_m = dm_s[:, None] * e
            p_l = (dl_s * b_all)[:, None] * e
            d_q += p_m * k_s[None, :]
            d_k += p_l * k_s[None, :]
            d_b += tl.sum(dl_s[:, None] * e * k_c * k_s[None, :], 1)
            pair = p_m * q_c + p_l * k_c  # gradient reaching k_s from every row t
            d_g += pair * k_s[None, :]
            d_k += tl.where(t[:, None] == s, tl.sum(pair, 0)[None, :], 0.0)
            d_g -= tl.where(t[:, None] == s, tl.sum(pair * k_s[None, :], 0)[None, :], 0.0)

    # 4) dg = reverse cumsum of dG over the chunk, then through the gate activation
    d_gate = tl.where(m2, tl.sum(d_g, 0)[None, :] - tl.cumsum(d_g, 0) + d_g, 0.0)
    if GATE != 0:
        x = load_tile(f, t0, n, h, H, K, kc, BKT)
        a = 1.0
        if HAS_A:
            a = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.zeros([1, BKT], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(dt_bias + h * K + d, mask=kmask, other=0.0).to(tl.float32)[None, :]
        dg_dx, dg_da = gate_grads(x, a, bias, lower_bound, GATE)
        if HAS_A:
            tl.store(dA_parts + (c * H + h) * tl.num_programs(0) + kt, tl.sum(tl.sum(d_gate * dg_da, 1), 0))
        d_gate = tl.where(m2, d_gate * dg_dx, 0.0)
        if HAS_BIAS:
            tl.store(ddt_parts + (c * H + h) * K + d, tl.sum(d_gate, 0), mask=kmask)
    store_tile(dq, d_q, t0, n, h, H, K, kc, BKT)
    store_tile(dk, d_k, t0, n, h, H, K, kc, BKT)
    store_tile(dg, d_gate, t0, n, h, H, K, kc, BKT)
    tl.store(dbeta_parts + (1 + kt) * part_stride + (t0 + t) * H + h, d_b, mask=row_ok)
