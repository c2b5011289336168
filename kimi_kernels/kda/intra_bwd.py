"""Per-chunk backward: everything except the reverse state walk (state.py) and the state terms (inter_bwd.py).

`intra_bwd_dv_kernel` (one program per (chunk, head)) contracts over V for the [64, 64] chunk-mixing
gradients and dv. With u = Ainv (beta v - kb S) (kb = beta k exp(G)), dAinv = du (beta v - kb S)^T, so
    dL = -(Ainv^T dAinv Ainv^T) = -(Ainv^T du) u^T   (strictly lower, L = diag(beta) Akk),
    dMqk = dO u^T,  dv = beta Ainv^T du:
one [64, 64] product Ainv^T du per V tile serves dv and dL, and neither S nor k is read.
`intra_bwd_dqk_kernel` (one program per (16-row block x K tile, chunk, head)) is row-local in the chunk and
column-local in K: it starts from the state terms of its rows (fp32 partials of dq, dk, dG written by
inter_bwd_kernel), then adds dMqk / dL through the decayed products: the row side of its rows (keys up to the
block's diagonal) as [16, 64] x [64, BK] products around the block's first row (the forward's factorisation),
the column side of its keys (rows from the block on) as [16, 64] x [64, BK] products around the block's last
row. It writes dq, dk and the per-token dG (fp32). It is bound by load latency at 4 CTAs per SM: its loads come
first in program order, the row tiles that the dot results need in their register layout fused into two loads
(see the kernel), so a program waits on 3 dependent load round trips (sm_90 SASS) where the loop over later row
blocks with a conversion after each tile load took ~17 (Triton 3.6; ~16 with 3.8).
`gate_bwd_kernel` (per (chunk, group of heads), one warp) reverse-sums dG over the chunk into dg and
takes it through the gate. The kernels write per-program partial sums (dbeta over K tiles, dA_log and
ddt_bias over chunks) that the host adds up: deterministic, no atomics.

Precision (bf16 inputs): dG is a sum of terms that cancel (exp(G_t - G_s) is shift-invariant: the pair (t, s)
adds X_ts to dG_t on the row side and -X_ts to dG_s on the column side). Both sides used to round their
decayed operands (q e^{G-r} on one side, k e^{r-G} on the other) to bf16 differently, so the pairs did not
cancel and dg, dA_log, ddt_bias carried errors of the size of the cancelled terms. Now every fp32 operand
that feeds dG (the decayed q / k tiles, Ainv^T du) goes through dot_split (bf16 hi + lo, ~16 bits), and
dMqk / dL are rounded once (bf16 scratch) so both sides of a pair see the same value. Which reference row a
side factors exp(G_t - G_s) around does not matter for that: the split keeps each side's terms to ~2^-16 of
their size whatever the factors are, as long as none overflows or (for a product that matters) underflows.
"""

import triton
import triton.language as tl

from kimi_kernels.kda.gate import gate_grads, gate_parameters, gate_token_offset, head_group_columns
from kimi_kernels.kda.intra import dot_split, load_tile, row_block, store_tile, to_dot


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
def exp_ftz(x):
    """exp(x) through ex2.approx.ftz: results below fp32's normal range (x < -87.3) come out 0. tl.exp keeps them
    as denormals at three more instructions per element (a range test and two scalings around ex2). Every factor
    of the dq/dk kernel that can get that small multiplies another factor <= 1, so those products are < 2^-126."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def intra_bwd_dqk_kernel(q, k, beta, G, inv_q, inv_k, dM_buf, dL_buf, pq, pk, pG, dq, dk, dG_buf, dbeta_parts,
                         chunk_start, chunk_len, scale, H, part_stride, K: tl.constexpr, BKT: tl.constexpr,
                         SAFE_GATE: tl.constexpr, DOT_BF16: tl.constexpr, NORM: tl.constexpr):
    """dq, dk and the per-token dG of one 16-row block of a chunk, for K columns kc..kc+BKT-1: the state terms
    (fp32 partials pq, pk, pG from inter_bwd_kernel) plus the intra-chunk ones. q and k come raw; with NORM their
    inverse L2 norms scale their rows as loaded (dq, dk w.r.t. the normalised q, k)."""
    pid, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kt, blk = pid // 4, pid % 4
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    r0 = blk * 16
    if (r0 >= n) | (t0 < 0):  # the chunk is shorter than this block (t0 >= 0: both loads go out before the branch)
        return
    kc = kt * BKT
    s16, t, d = tl.arange(0, 16), tl.arange(0, 64), kc + tl.arange(0, BKT)
    rows = r0 + s16
    kmask, rok, row_ok = d < K, rows < n, t < n
    m16 = rok[:, None] & kmask[None, :]
    offs = (t0 + rows)[:, None] * (H * K) + h * K + d[None, :]
    # Loads first. Triton converts a tile that meets the dot results in their register layout right after its
    # load (through shared memory, behind a CTA barrier), and every later load waits for it; so those row tiles
    # come last, as two loads (pq, pk, pG and G in fp32; q and k) split in registers after one conversion each.
    # The dMqk / dL tiles become dot operands only at their dots (the tl.where there): Triton 3.6 otherwise
    # moves all four operands into registers right after their loads (64 registers held through the rest).
    # sm_90 SASS: 3 dependent waits per program (the chunk bounds, the tiles, the fused row tiles).
    k_all = load_tile(k, t0, n, h, H, K, kc, BKT)
    g_all = load_tile(G, t0, n, h, H, K, kc, BKT)
    q_all = load_tile(q, t0, n, h, H, K, kc, BKT)
    b_all = tl.load(beta + (t0 + t) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    g_r = load_col(G, t0, r0, h, H, K, kc, BKT)  # the row side's reference row (the block's first)
    g_l = load_col(G, t0, tl.minimum(r0 + 15, n - 1), h, H, K, kc, BKT)  # the column side's (its last)
    b_i = tl.load(beta + (t0 + rows) * H + h, mask=rok, other=0.0).to(tl.float32)
    if NORM:
        iq_all = tl.load(inv_q + (t0 + t) * H + h, mask=row_ok, other=0.0)
        ik_all = tl.load(inv_k + (t0 + t) * H + h, mask=row_ok, other=0.0)
        iq_i = tl.load(inv_q + (t0 + rows) * H + h, mask=rok, other=0.0)
        ik_i = tl.load(inv_k + (t0 + rows) * H + h, mask=rok, other=0.0)
    d_m_i = row_block(dM_buf, t0, r0, n, H * 64, h * 64, t, 64)
    d_l_i = row_block(dL_buf, t0, r0, n, H * 64, h * 64, t, 64)
    cols = (t0 + t)[None, :] * (H * 64) + h * 64 + rows[:, None]  # [s, t] -> dM[t, s], keys s of the block
    d_m_c = tl.load(dM_buf + cols, mask=row_ok[None, :], other=0.0)
    d_l_c = tl.load(dL_buf + cols, mask=row_ok[None, :], other=0.0)
    j2 = tl.arange(0, 2)
    ja, jb = j2[None, None, :, None], j2[None, None, None, :]
    p4 = tl.where(jb == 0, tl.where(ja == 0, pq, pk), tl.where(ja == 0, pG, G)) + offs[:, :, None, None]
    if K % 4 == 0:  # rows of fp32 buffers that chunk.py allocates (16-byte aligned): 4 columns per vector load
        p4 = tl.max_contiguous(tl.multiple_of(p4, (1, 16, 1, 1)), (1, 4, 1, 1))
    part = tl.load(p4, mask=m16[:, :, None, None], other=0.0)
    part_qk, part_g = tl.split(part)
    d_q, d_k = tl.split(part_qk)
    d_g, g_i = tl.split(part_g)
    qk_i = tl.load(tl.where(j2[None, None, :] == 0, q, k) + offs[:, :, None], mask=m16[:, :, None], other=0.0)
    q_i, k_i = tl.split(qk_i.to(tl.float32))
    if NORM:  # the rows' inverse norms, loaded with the other small vectors above
        k_all *= ik_all[:, None]
        q_all *= iq_all[:, None]
        q_i *= iq_i[:, None]
        k_i *= ik_i[:, None]

    # exp(G_t - G_s), t >= s, in two factors around a reference row. Row side (the block's rows t, keys s up to
    # its diagonal) around r = G at the block's first row: exp(G_t - r) <= 1, exp(r - G_s) <= 1 before the
    # block and <= e^{15 |g_min|} inside the diagonal tile (the forward's factorisation). Column side (the
    # block's keys s, rows t from the block on) around rl = G at its last row, the mirror image: exp(rl - G_s)
    # <= 1, exp(G_t - rl) <= 1 after the block and <= e^{15 |g_min|} inside it; a factor that underflows there
    # belongs to a product below e^-87. An unbounded gate (SAFE_GATE=False) leaves the diagonal tile to the
    # position-by-position loop below, so that every factor is <= 1.
    ncol = r0 + 16 if SAFE_GATE else r0
    nrow = r0 if SAFE_GATE else r0 + 16
    e_row = exp_ftz(tl.where(m16, g_i - g_r[None, :], float("-inf")))
    e_col = exp_ftz(tl.where(((t < ncol) & row_ok)[:, None] & kmask[None, :], g_r[None, :] - g_all, float("-inf")))
    e_t = exp_ftz(tl.where(((t >= nrow) & row_ok)[:, None] & kmask[None, :], g_all - g_l[None, :], float("-inf")))
    e_s = exp_ftz(tl.where(m16, g_l[None, :] - g_i, float("-inf")))
    kl = k_all * e_col
    x_q = q_all * e_t
    x_k = k_all * b_all[:, None] * e_t
    # (the masks repeat the loads': see above)
    r_q = dot_split(to_dot(tl.where(rok[:, None], d_m_i, 0.0), DOT_BF16), kl, False, DOT_BF16) * e_row
    r_k = dot_split(to_dot(tl.where(rok[:, None], d_l_i, 0.0), DOT_BF16), kl, False, DOT_BF16) * e_row
    col = dot_split(to_dot(tl.where(row_ok[None, :], d_m_c, 0.0), DOT_BF16), x_q, False, DOT_BF16)
    col += dot_split(to_dot(tl.where(row_ok[None, :], d_l_c, 0.0), DOT_BF16), x_k, False, DOT_BF16)
    col *= e_s
    d_q += r_q
    d_k += b_i[:, None] * r_k + col
    d_g += q_i * r_q + (k_i * b_i[:, None]) * r_k - col * k_i
    d_b = tl.sum(k_i * r_k, 1)

    if not SAFE_GATE:  # diagonal tile position by position (unbounded gate): exp(G_t - G_s), t >= s in the block
        for j in range(0, 16):
            s = r0 + j
            s_ok = s < n
            k_s = load_col(k, t0, tl.minimum(s, n - 1), h, H, K, kc, BKT)
            if NORM:
                k_s *= tl.load(inv_k + (t0 + tl.minimum(s, n - 1)) * H + h)
            g_s = load_col(G, t0, tl.minimum(s, n - 1), h, H, K, kc, BKT)
            ok = (rows >= s) & rok & s_ok
            e = exp_ftz(tl.where(ok[:, None] & kmask[None, :], g_i - g_s[None, :], float("-inf")))
            dm_s = tl.load(dM_buf + (t0 + rows) * H * 64 + h * 64 + s, mask=rok & s_ok, other=0.0).to(tl.float32)
            dl_s = tl.load(dL_buf + (t0 + rows) * H * 64 + h * 64 + s, mask=rok & s_ok, other=0.0).to(tl.float32)
            p_m = dm_s[:, None] * e
            p_l = (dl_s * b_i)[:, None] * e
            d_q += p_m * k_s[None, :]
            d_k += p_l * k_s[None, :]
            d_b += tl.sum(dl_s[:, None] * e * k_i * k_s[None, :], 1)
            pair = p_m * q_i + p_l * k_i  # gradient reaching k_s from every row t
            d_g += pair * k_s[None, :]
            d_k += tl.where(rows[:, None] == s, tl.sum(pair, 0)[None, :], 0.0)
            d_g -= tl.where(rows[:, None] == s, tl.sum(pair * k_s[None, :], 0)[None, :], 0.0)

    tl.store(dq + offs, d_q.to(dq.dtype.element_ty), mask=m16)
    tl.store(dk + offs, d_k.to(dk.dtype.element_ty), mask=m16)
    tl.store(dG_buf + offs, d_g, mask=m16)
    tl.store(dbeta_parts + (1 + kt) * part_stride + (t0 + rows) * H + h, d_b, mask=rok)


@triton.jit
def gate_bwd_kernel(dG_buf, dlast, f, A_log, dt_bias, dg, dA_parts, ddt_parts, chunk_start, chunk_len,
                    lower_bound, f_seq_len, f_seq_stride, f_tok_stride, H, K: tl.constexpr, BK: tl.constexpr,
                    HB: tl.constexpr, RB: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    """dg = reverse cumsum over the chunk of dG (plus the last row's share from inter_bwd_kernel), then through
    the gate activation, with per-program partial sums of the dA_log (per head) / ddt_bias (per column) terms.
    f and dg share one layout (strided batch and time dims: gate_token_offset).
    Grid (chunk x group of HB heads, the groups of a chunk neighbours). Memory-bound, so shaped like
    gate_cumsum_kernel: one warp, its tile RB rows x HB heads x BK columns, 8 consecutive columns a thread (16-byte
    loads of f and stores of dg, two 16-byte loads of dG) and the rows inside each thread, so the reverse cumsum
    is a running sum in registers, walked from the chunk's last row to its first (a block's rows in reverse
    order: Triton's reverse scan took warp shuffles). Two blocks a step, each loaded one block ahead into its own
    registers (see gate_cumsum_chunk)."""
    groups = tl.cdiv(H, HB)
    c, hg = tl.program_id(0) // groups, tl.program_id(0) % groups
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    col, col_ok = head_group_columns(hg, H, K, BK, HB)
    col, col_ok = col[None, :], col_ok[None, :]
    # d(G_last) reaches every row of the chunk: it starts the running sum
    carry = tl.load(dlast + c * (H * K) + col, mask=col_ok, other=0.0)
    a, bias = gate_parameters(A_log, dt_bias, col, col_ok, K, HAS_A, HAS_BIAS)
    sum_da = tl.zeros([1, HB * BK], dtype=tl.float32)  # dA_log terms per column
    sum_dt = tl.zeros([1, HB * BK], dtype=tl.float32)  # ddt_bias terms per column
    dG_col = dG_buf + t0.to(tl.int64) * (H * K) + col
    f_off = gate_token_offset(t0, f_seq_len, f_seq_stride, f_tok_stride) + col
    rows = 63 - tl.arange(0, RB)[:, None]  # a block's rows last to first: its forward cumsum is the reverse one
    d_g0, x0 = gate_bwd_load(dG_col, f + f_off, rows, n, col_ok, H, K, f_tok_stride, GATE)
    for _ in range(64 // (2 * RB)):
        d_g1, x1 = gate_bwd_load(dG_col, f + f_off, rows - RB, n, col_ok, H, K, f_tok_stride, GATE)
        carry, sum_da, sum_dt = gate_bwd_rows(d_g0, x0, dg + f_off, rows, n, col_ok, carry, sum_da, sum_dt, a,
                                              bias, lower_bound, f_tok_stride, GATE, HAS_A, HAS_BIAS)
        d_g0, x0 = gate_bwd_load(dG_col, f + f_off, rows - 2 * RB, n, col_ok, H, K, f_tok_stride, GATE)
        carry, sum_da, sum_dt = gate_bwd_rows(d_g1, x1, dg + f_off, rows - RB, n, col_ok, carry, sum_da, sum_dt,
                                              a, bias, lower_bound, f_tok_stride, GATE, HAS_A, HAS_BIAS)
        rows -= 2 * RB
    if HAS_A:
        heads = hg * HB + tl.arange(0, HB)
        tl.store(dA_parts + c * H + heads, tl.sum(tl.reshape(sum_da, [HB, BK]), 1), mask=heads < H)
    if HAS_BIAS:
        tl.store(ddt_parts + c * (H * K) + col, sum_dt, mask=col_ok)


@triton.jit
def gate_bwd_load(dG_col, f_col, rows, n, col_ok, H, K: tl.constexpr, f_tok_stride, GATE: tl.constexpr):
    """dG and the raw gate input f (read only through an activation, GATE != 0) of one block of rows; rows
    outside [0, n) read as zeros."""
    mask = (rows >= 0) & (rows < n) & col_ok
    d_g = tl.load(dG_col + rows * (H * K), mask=mask, other=0.0)
    x = d_g
    if GATE != 0:
        x = tl.load(f_col + rows * f_tok_stride, mask=mask, other=0.0)
    return d_g, x


@triton.jit
def gate_bwd_rows(d_g, x, dg_col, rows, n, col_ok, carry, sum_da, sum_dt, a, bias, lower_bound, f_tok_stride,
                  GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Stores dg for one block of rows (last to first); returns the running sum after it and the partial sums."""
    mask = (rows >= 0) & (rows < n) & col_ok
    d_gate = tl.where(mask, carry + tl.cumsum(d_g, 0), 0.0)
    carry += tl.sum(d_g, 0, keep_dims=True)
    if GATE != 0:
        dg_dx, dg_da = gate_grads(x.to(tl.float32), a, bias, lower_bound, GATE)
        if HAS_A:
            sum_da += tl.sum(d_gate * dg_da, 0, keep_dims=True)
        d_gate = d_gate * dg_dx
        if HAS_BIAS:
            sum_dt += tl.sum(d_gate, 0, keep_dims=True)
    tl.store(dg_col + rows * f_tok_stride, d_gate.to(dg_col.dtype.element_ty), mask=mask)
    return carry, sum_da, sum_dt
