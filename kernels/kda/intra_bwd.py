"""Per-chunk backward: everything except the reverse state walk (state.py), one program per (chunk, head).

Given S (state at the chunk start), dS_next, u, du, dO it forms dw, dkgl, d(q exp G), dMqk, dAinv; then
    dL = -(Ainv^T dAinv Ainv^T) (strictly lower), with L = diag(beta) Akk,
and pushes dMqk and dL through the decayed products with the same reference-row factorisation as the
forward (column side as [64, K] dots, row side per 16-row block). Finally dG is turned into dg by a
reverse cumsum over the chunk, and, for a gate computed in-kernel, into d(raw gate) and dA_log terms.
[16, 64] slices of register tiles are not expressible in Triton, so dMqk / dL and the partial
gradients go through global memory (scratch, L2-resident) between phases, with a CTA barrier.
"""

import triton
import triton.language as tl

from kernels.kda.gate import gate_grads
from kernels.kda.intra import decay_factors, row_block, to_dot
from kernels.kda.state import load_chunk, state_offsets, store_chunk


@triton.jit
def diag_tile_bwd(q_i, k_i, g_i, b_i, dm_i, dl_i, dq_i, dk_i, dg_i, db_i, k, G, t0, r0, n, h,
                  H, K: tl.constexpr, BK: tl.constexpr):
    """Diagonal 16x16 tile position by position (unbounded gate only)."""
    d, s16, t = tl.arange(0, BK), tl.arange(0, 16), tl.arange(0, 64)
    rows, kmask = r0 + s16, d < K
    for s in range(16):
        col = r0 + s
        sok = col < n
        k_s = tl.load(k + (t0 + col) * H * K + h * K + d, mask=kmask & sok, other=0.0).to(tl.float32)
        g_s = tl.load(G + (t0 + col) * H * K + h * K + d, mask=kmask & sok, other=0.0)
        ok = ((rows < n) & (rows >= col))[:, None] & kmask[None, :]
        e = tl.exp(tl.where(ok, g_i - g_s[None, :], float("-inf")))
        dm_col = tl.sum(tl.where(t[None, :] == col, dm_i, 0.0), 1)
        dl_col = tl.sum(tl.where(t[None, :] == col, dl_i, 0.0), 1)
        p_m = dm_col[:, None] * e                     # d(q_t . k_s e_ts) weights
        p_l = (dl_col * b_i)[:, None] * e             # d(k_t . k_s e_ts) weights, beta folded in
        dq_i += p_m * k_s[None, :]
        dk_i += p_l * k_s[None, :]
        db_i += tl.sum(dl_col[:, None] * e * k_i * k_s[None, :], 1)
        t_pair = p_m * q_i + p_l * k_i                # gradient reaching k_s from every row t
        dg_i += t_pair * k_s[None, :]
        dk_i += tl.where(s16[:, None] == s, tl.sum(t_pair, 0)[None, :], 0.0)
        dg_i -= tl.where(s16[:, None] == s, tl.sum(t_pair * k_s[None, :], 0)[None, :], 0.0)
    return dq_i, dk_i, dg_i, db_i


@triton.jit
def intra_bwd_kernel(q, k, v, beta, G, hbuf, dhbuf, U, dU, dO, Ainv, f, A_log, dt_bias, dM_buf, dL_buf,
                     dq, dk, dv, dbeta, dg, dA_terms, chunk_start, chunk_len, scale, lower_bound,
                     H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SAFE_GATE: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                     DOT_BF16: tl.constexpr):
    c, h = tl.program_id(0), tl.program_id(1)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    t, d, s16 = tl.arange(0, 64), tl.arange(0, BK), tl.arange(0, 16)
    kmask, row_ok = d < K, t < n
    m2 = row_ok[:, None] & kmask[None, :]
    k_all = load_chunk(k, t0, n, h, H, K, 0, BK)
    g_all = load_chunk(G, t0, n, h, H, K, 0, BK)
    b_all = tl.load(beta + (t0 + t) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    a_inv = load_chunk(Ainv, t0, n, h, H, 64, 0, 64)
    a_dot = to_dot(a_inv, DOT_BF16)

    # 1) contractions over V
    d_w = tl.zeros([64, BK], dtype=tl.float32)
    d_kgl = tl.zeros([64, BK], dtype=tl.float32)
    d_qg = tl.zeros([64, BK], dtype=tl.float32)
    d_glast = tl.zeros([BK], dtype=tl.float32)
    d_m = tl.zeros([64, 64], dtype=tl.float32)
    d_ainv = tl.zeros([64, 64], dtype=tl.float32)
    d_b = tl.zeros([64], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_s, mask_s = state_offsets(c, h, v0, H, K, V, BK, BV)
        S = tl.load(hbuf + offs_s, mask=mask_s, other=0.0).to(tl.float32)
        dS = tl.load(dhbuf + offs_s, mask=mask_s, other=0.0).to(tl.float32)
        u = load_chunk(U, t0, n, h, H, V, v0, BV)
        du = load_chunk(dU, t0, n, h, H, V, v0, BV)
        do = to_dot(load_chunk(dO, t0, n, h, H, V, v0, BV), DOT_BF16)
        vv = load_chunk(v, t0, n, h, H, V, v0, BV)
        S_t, du_d = tl.trans(to_dot(S, DOT_BF16)), to_dot(du, DOT_BF16)
        d_w -= tl.dot(du_d, S_t)
        d_kgl += tl.dot(to_dot(u, DOT_BF16), tl.trans(to_dot(dS, DOT_BF16)))
        d_glast += tl.sum(S * dS, 1)
        d_qg += tl.dot(do, S_t)
        d_m += tl.dot(do, tl.trans(to_dot(u, DOT_BF16)))
        d_vb = tl.dot(tl.trans(a_dot), du_d)
        store_chunk(dv, d_vb * b_all[:, None], t0, n, h, H, V, v0, BV)
        d_b += tl.sum(d_vb * vv, 1)
        d_ainv += tl.dot(du_d, tl.trans(to_dot(vv * b_all[:, None], DOT_BF16)))

    # 2) w = Ainv kb, kgl = k exp(Gl - G), qg = scale q exp(G)
    e_g = tl.exp(g_all)
    kb = k_all * b_all[:, None] * e_g
    d_ainv += tl.dot(to_dot(d_w, DOT_BF16), tl.trans(to_dot(kb, DOT_BF16)))
    d_kb = tl.dot(tl.trans(a_dot), to_dot(d_w, DOT_BF16))
    d_k = d_kb * b_all[:, None] * e_g
    d_b += tl.sum(d_kb * k_all * e_g, 1)
    d_g = d_kb * kb
    g_last = tl.load(G + (t0 + n - 1) * H * K + h * K + d, mask=kmask, other=0.0)
    e_l = tl.exp(tl.where(m2, g_last[None, :] - g_all, float("-inf")))
    d_k += d_kgl * e_l
    d_g -= d_kgl * k_all * e_l
    last_terms = tl.sum(d_kgl * k_all * e_l, 0) + tl.exp(g_last) * d_glast
    d_g += tl.where(t[:, None] == n - 1, last_terms[None, :], 0.0)
    q_all = load_chunk(q, t0, n, h, H, K, 0, BK)
    d_q = d_qg * e_g * scale
    d_g += d_qg * q_all * e_g * scale
    d_l = -tl.dot(tl.trans(a_inv), tl.dot(d_ainv, tl.trans(a_inv)))
    valid = row_ok[:, None] & row_ok[None, :]
    d_l = tl.where(valid & (t[None, :] < t[:, None]), d_l, 0.0)
    d_m = tl.where(valid & (t[None, :] <= t[:, None]), d_m * scale, 0.0)
    store_chunk(dM_buf, d_m, t0, n, h, H, 64, 0, 64)
    store_chunk(dL_buf, d_l, t0, n, h, H, 64, 0, 64)
    tl.debug_barrier()

    # 3) column side of the decayed products: gradient reaching k_s
    for i in tl.static_range(4):
        r0 = i * 16
        q_i = row_block(q, t0, r0, n, H * K, h * K, d, K)
        k_i = row_block(k, t0, r0, n, H * K, h * K, d, K)
        g_i = row_block(G, t0, r0, n, H * K, h * K, d, K)
        b_i = tl.load(beta + (t0 + r0 + s16) * H + h, mask=(r0 + s16) < n, other=0.0).to(tl.float32)
        e_row, e_col = decay_factors(g_all, g_i, G, t0, r0, n, h, H, K, BK, SAFE_GATE)
        dm_i = to_dot(row_block(dM_buf, t0, r0, n, H * 64, h * 64, t, 64), DOT_BF16)
        dl_i = to_dot(row_block(dL_buf, t0, r0, n, H * 64, h * 64, t, 64), DOT_BF16)
        col = tl.dot(tl.trans(dm_i), to_dot(q_i * e_row, DOT_BF16))
        col += tl.dot(tl.trans(dl_i), to_dot(k_i * b_i[:, None] * e_row, DOT_BF16))
        col *= e_col
        d_k += col
        d_g -= col * k_all
    store_chunk(dq, d_q, t0, n, h, H, K, 0, BK)
    store_chunk(dk, d_k, t0, n, h, H, K, 0, BK)
    store_chunk(dg, d_g, t0, n, h, H, K, 0, BK)
    tl.store(dbeta + (t0 + t) * H + h, d_b, mask=row_ok)
    tl.debug_barrier()

    # 4) row side, per 16-row block (read-modify-write of the rows just stored)
    for i in tl.static_range(4):
        r0 = i * 16
        rows = r0 + s16
        rok = rows < n
        q_i = row_block(q, t0, r0, n, H * K, h * K, d, K)
        k_i = row_block(k, t0, r0, n, H * K, h * K, d, K)
        g_i = row_block(G, t0, r0, n, H * K, h * K, d, K)
        b_i = tl.load(beta + (t0 + rows) * H + h, mask=rok, other=0.0).to(tl.float32)
        e_row, e_col = decay_factors(g_all, g_i, G, t0, r0, n, h, H, K, BK, SAFE_GATE)
        dm_i = row_block(dM_buf, t0, r0, n, H * 64, h * 64, t, 64)
        dl_i = row_block(dL_buf, t0, r0, n, H * 64, h * 64, t, 64)
        kl = to_dot(k_all * e_col, DOT_BF16)
        r_q = tl.dot(to_dot(dm_i, DOT_BF16), kl) * e_row
        r_k = tl.dot(to_dot(dl_i, DOT_BF16), kl) * e_row
        dq_i = row_block(dq, t0, r0, n, H * K, h * K, d, K) + r_q
        dk_i = row_block(dk, t0, r0, n, H * K, h * K, d, K) + b_i[:, None] * r_k
        dg_i = row_block(dg, t0, r0, n, H * K, h * K, d, K) + q_i * r_q + b_i[:, None] * k_i * r_k
        db_i = tl.load(dbeta + (t0 + rows) * H + h, mask=rok, other=0.0) + tl.sum(k_i * r_k, 1)
        if not SAFE_GATE:
            dq_i, dk_i, dg_i, db_i = diag_tile_bwd(q_i, k_i, g_i, b_i, dm_i, dl_i, dq_i, dk_i, dg_i, db_i,
                                                   k, G, t0, r0, n, h, H, K, BK)
        offs = (t0 + rows)[:, None] * (H * K) + h * K + d[None, :]
        mask = rok[:, None] & kmask[None, :]
        tl.store(dq + offs, dq_i, mask=mask)
        tl.store(dk + offs, dk_i, mask=mask)
        tl.store(dg + offs, dg_i, mask=mask)
        tl.store(dbeta + (t0 + rows) * H + h, db_i, mask=rok)
    tl.debug_barrier()

    # 5) dg = reverse cumsum of dG over the chunk; then through the gate activation
    d_G = load_chunk(dg, t0, n, h, H, K, 0, BK)
    d_gate = tl.sum(d_G, 0)[None, :] - tl.cumsum(d_G, 0) + d_G
    if GATE != 0:
        x = load_chunk(f, t0, n, h, H, K, 0, BK)
        a = 1.0
        if HAS_A:
            a = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.zeros([1, BK], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(dt_bias + h * K + d, mask=kmask, other=0.0).to(tl.float32)[None, :]
        dg_dx, dg_da = gate_grads(x, a, bias, lower_bound, GATE)
        if HAS_A:
            store_chunk(dA_terms, d_gate * dg_da, t0, n, h, H, K, 0, BK)
        d_gate = d_gate * dg_dx
    store_chunk(dg, d_gate, t0, n, h, H, K, 0, BK)
