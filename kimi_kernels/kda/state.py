"""Inter-chunk state pass (forward, with the output, and backward).

Per chunk, with S the state at the chunk start, Gl = G[last] and kgl = k * exp(Gl - G):
    u = u0 - w S,   o = scale (q * exp(G)) S + Mqk u,   S_next = exp(Gl) * S + kgl^T u.
The state kernels walk the chunks of one sequence in order (one program per (V tile, sequence, head))
and store S per chunk (forward) or dS_next per chunk (backward) for the parallel kernels. Their chunk steps
are serial, so whatever does not depend on the state is computed before, in parallel over chunks: kgl (by
``intra_fwd_kernel``) and scale q exp(G) (by the gate pass), kept from the forward for the backward walk.
The forward walk writes o as it goes: its products hang off the chain (nothing later in the walk reads them),
so they fill the walk's latency instead of a separate pass re-reading S, u, qg and Mqk.
"""

import triton
import triton.language as tl

from kimi_kernels.kda.intra import gate_at_chunk_end, to_dot


@triton.jit
def load_rows(ptr, t0, n, h, H, D: tl.constexpr, col0, BD: tl.constexpr):
    """[64, BD] tile of a [T, H, D] tensor in its stored dtype: tokens t0..t0+n-1, columns col0..col0+BD-1
    (zero elsewhere)."""
    t, e = tl.arange(0, 64), col0 + tl.arange(0, BD)
    mask = (t < n)[:, None] & (e < D)[None, :]
    return tl.load(ptr + (t0 + t)[:, None] * (H * D) + h * D + e[None, :], mask=mask, other=0.0)


@triton.jit
def store_chunk(ptr, x, t0, n, h, H, D: tl.constexpr, col0, BD: tl.constexpr):
    t, e = tl.arange(0, 64), col0 + tl.arange(0, BD)
    mask = (t < n)[:, None] & (e < D)[None, :]
    tl.store(ptr + (t0 + t)[:, None] * (H * D) + h * D + e[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def state_offsets(c, h, v0, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr):
    d, e = tl.arange(0, BK), v0 + tl.arange(0, BV)
    offs = ((c * H + h) * K + d)[:, None] * V + e[None, :]
    return offs, (d < K)[:, None] & (e < V)[None, :]


@triton.jit
def chunk_step_bounds(G, chunk_start, chunk_len, c, h, H, K: tl.constexpr, BK: tl.constexpr):
    """(first token, length, G at the last token [BK]) of chunk c."""
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    return t0, n, gate_at_chunk_end(G, t0, n, h, H, K, tl.arange(0, BK))


@triton.jit
def state_fwd_kernel(KGL, W, U0, G, QG, Mqk, h0, hbuf, U, O, ht, seq_chunks, chunk_start, chunk_len,
                     H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, DOT_BF16: tl.constexpr):
    """Forward walk: u = u0 - w S and o = qg S + Mqk u per chunk, S per chunk to hbuf (for the backward)."""
    vb, nh = tl.program_id(0), tl.program_id(1)
    seq, h = nh // H, nh % H
    v0 = vb * BV
    offs0, mask_s = state_offsets(seq, h, v0, H, K, V, BK, BV)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + offs0, mask=mask_s, other=0.0).to(tl.float32)
    c_lo, c_hi = tl.load(seq_chunks + seq), tl.load(seq_chunks + seq + 1)
    for c in range(c_lo, c_hi):
        t0, n, g_last = chunk_step_bounds(G, chunk_start, chunk_len, c, h, H, K, BK)
        w, u0 = load_rows(W, t0, n, h, H, K, 0, BK), load_rows(U0, t0, n, h, H, V, v0, BV)
        kgl = load_rows(KGL, t0, n, h, H, K, 0, BK)
        qg, m = load_rows(QG, t0, n, h, H, K, 0, BK), load_rows(Mqk, t0, n, h, H, 64, 0, 64)
        offs_c, _ = state_offsets(c, h, v0, H, K, V, BK, BV)
        tl.store(hbuf + offs_c, S.to(hbuf.dtype.element_ty), mask=mask_s)
        # the state stays fp32; its products take it rounded to the dot dtype, as the backward walk does
        s_dot = to_dot(S, DOT_BF16)
        u = u0.to(tl.float32) - tl.dot(to_dot(w, DOT_BF16), s_dot)
        store_chunk(U, u, t0, n, h, H, V, v0, BV)
        u_dot = to_dot(u, DOT_BF16)
        o = tl.dot(to_dot(m, DOT_BF16), u_dot, tl.dot(to_dot(qg, DOT_BF16), s_dot))
        store_chunk(O, o, t0, n, h, H, V, v0, BV)
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(to_dot(kgl, DOT_BF16)), u_dot)
    if STORE_FINAL:
        tl.store(ht + offs0, S, mask=mask_s)


@triton.jit
def state_bwd_kernel(QG, KGL, W, G, Mqk, dO, dht, dhbuf, dU, dh0, seq_chunks, chunk_start, chunk_len,
                     H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, DOT_BF16: tl.constexpr):
    """Reverse walk: du = Mqk^T dO + kgl dS_next;  dS = exp(Gl) dS_next - w^T du + qg^T dO."""
    vb, nh = tl.program_id(0), tl.program_id(1)
    seq, h = nh // H, nh % H
    v0 = vb * BV
    offs0, mask_s = state_offsets(seq, h, v0, H, K, V, BK, BV)
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + offs0, mask=mask_s, other=0.0).to(tl.float32)
    c_lo, c_hi = tl.load(seq_chunks + seq), tl.load(seq_chunks + seq + 1)
    for j in range(c_hi - c_lo):
        c = c_hi - 1 - j
        t0, n, g_last = chunk_step_bounds(G, chunk_start, chunk_len, c, h, H, K, BK)
        do, m = load_rows(dO, t0, n, h, H, V, v0, BV), load_rows(Mqk, t0, n, h, H, 64, 0, 64)
        kgl, w = load_rows(KGL, t0, n, h, H, K, 0, BK), load_rows(W, t0, n, h, H, K, 0, BK)
        qg = load_rows(QG, t0, n, h, H, K, 0, BK)
        offs_c, _ = state_offsets(c, h, v0, H, K, V, BK, BV)
        tl.store(dhbuf + offs_c, dS.to(dhbuf.dtype.element_ty), mask=mask_s)
        do = to_dot(do, DOT_BF16)
        # the state-independent products first: they need not wait for dS
        du_in = tl.dot(tl.trans(to_dot(m, DOT_BF16)), do)
        dS_in = tl.dot(tl.trans(to_dot(qg, DOT_BF16)), do)
        du = du_in + tl.dot(to_dot(kgl, DOT_BF16), to_dot(dS, DOT_BF16))
        store_chunk(dU, du, t0, n, h, H, V, v0, BV)
        dS = dS * tl.exp(g_last)[:, None] - tl.dot(tl.trans(to_dot(w, DOT_BF16)), to_dot(du, DOT_BF16)) + dS_in
    if HAS_H0:
        tl.store(dh0 + offs0, dS, mask=mask_s)
