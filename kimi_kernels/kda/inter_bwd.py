"""Backward through the state terms of a chunk: the parts of dq, dk, dG and dbeta that come from the per-chunk
states S (forward) and dS (backward walk), one program per (K tile, chunk, head) over all 64 rows.

With kb = beta k exp(G), w = Ainv kb, kgl = k exp(Gl - G) (Gl = G at the chunk's last row) and
qg = scale q exp(G), the forward used the state through u = u0 - w S, o += qg S, S_next += kgl^T u, so
    dw = -dU S^T,  dkb = Ainv^T dw,  dkgl = u dS^T,  dqg = dO S^T,  d(Gl) += sum_v S * dS * exp(Gl).
The three contractions over V are [64, BV] x [BV, BK] dots (M = 64: the tensor-core shape), summed over the
V tiles; dkb is one [64, 64] x [64, BK] product after the loop (dw through dot_split: its fp32 value feeds dG,
whose terms cancel). The kernel then takes them to dq, dk and dG per token (and the chunk's last row, which
the gate backward adds) and writes fp32 partials that intra_bwd_dqk_kernel completes with the intra-chunk
terms. Computing these per 16-row block (as that kernel did before) read every S / dS tile four times and dU
sixteen times per chunk and ran the contractions as M = 16 dots.
"""

import triton
import triton.language as tl

from kimi_kernels.kda.intra import dot_split, gate_at_chunk_end, load_tile, store_tile, to_dot


@triton.jit
def inter_bwd_kernel(q, k, beta, G, inv_q, inv_k, hbuf, dhbuf, U, dU, dO, Ainv, pq, pk, pG, dlast, dbeta_parts,
                     chunk_start, chunk_len, scale, H, part_stride, part_offset, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr, NORM: tl.constexpr):
    """One (K tile, chunk, head). q and k come raw; with NORM their inverse L2 norms (inv_q, inv_k [T, H]) scale
    their rows where they are loaded, and dq, dk are w.r.t. the normalised q, k."""
    kt, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    kc = kt * BK
    t, d = tl.arange(0, 64), kc + tl.arange(0, BK)
    kmask, row_ok = d < K, t < n
    m2 = row_ok[:, None] & kmask[None, :]

    d_w = tl.zeros([64, BK], dtype=tl.float32)
    d_qg = tl.zeros([64, BK], dtype=tl.float32)
    d_kgl = tl.zeros([64, BK], dtype=tl.float32)
    d_glast = tl.zeros([BK], dtype=tl.float32)
    state = (c * H + h) * K * V
    for v0 in range(0, V, BV):
        S = tl.load(tl.make_block_ptr(hbuf + state, (K, V), (V, 1), (kc, v0), (BK, BV), (1, 0)),
                    boundary_check=(0, 1), padding_option="zero")
        dS = tl.load(tl.make_block_ptr(dhbuf + state, (K, V), (V, 1), (kc, v0), (BK, BV), (1, 0)),
                     boundary_check=(0, 1), padding_option="zero")
        S_t = tl.trans(to_dot(S, DOT_BF16))
        d_w = tl.dot(to_dot(load_tile(dU, t0, n, h, H, V, v0, BV), DOT_BF16), S_t, d_w)
        d_qg = tl.dot(to_dot(load_tile(dO, t0, n, h, H, V, v0, BV), DOT_BF16), S_t, d_qg)
        d_kgl = tl.dot(to_dot(load_tile(U, t0, n, h, H, V, v0, BV), DOT_BF16), tl.trans(to_dot(dS, DOT_BF16)), d_kgl)
        d_glast += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)
    # through qg = scale q e^G, kgl = k e^{Gl - G}, kb = beta k e^G, in that order so that each accumulator is
    # dead before the next [64, BK] temporaries appear (padded rows are zero in every product)
    g_c = load_tile(G, t0, n, h, H, K, kc, BK)
    e_g = tl.exp(g_c)
    d_q = d_qg * e_g * scale
    store_tile(pq, d_q, t0, n, h, H, K, kc, BK)
    q_c = load_tile(q, t0, n, h, H, K, kc, BK)
    k_c = load_tile(k, t0, n, h, H, K, kc, BK)
    if NORM:
        q_c *= tl.load(inv_q + (t0 + t) * H + h, mask=row_ok, other=0.0)[:, None]
        k_c *= tl.load(inv_k + (t0 + t) * H + h, mask=row_ok, other=0.0)[:, None]
    d_g = d_q * q_c
    g_last = gate_at_chunk_end(G, t0, n, h, H, K, d)
    d_k = d_kgl * tl.exp(tl.where(m2, g_last[None, :] - g_c, float("-inf")))
    to_last = d_k * k_c  # moves from row t to the chunk's last row (through Gl)
    d_g -= to_last
    tl.store(dlast + (c * H + h) * K + d, tl.sum(to_last, 0) + tl.exp(g_last) * d_glast, mask=kmask)
    a_t = tl.trans(to_dot(load_tile(Ainv, t0, n, h, H, 64, 0, 64), DOT_BF16))
    d_kbe = -dot_split(a_t, d_w, False, DOT_BF16) * e_g  # Ainv^T dw e^G, dw = dU S^T (u = u0 - w S)
    b_c = tl.load(beta + (t0 + t) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    d_kb = d_kbe * b_c[:, None]
    d_k += d_kb
    d_g += d_kb * k_c
    store_tile(pk, d_k, t0, n, h, H, K, kc, BK)
    store_tile(pG, d_g, t0, n, h, H, K, kc, BK)
    d_b = tl.sum(d_kbe * k_c, 1)
    tl.store(dbeta_parts + (part_offset + kt) * part_stride + (t0 + t) * H + h, d_b, mask=row_ok)
