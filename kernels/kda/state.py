"""Inter-chunk state pass (forward and backward) and the output kernel.

Per chunk, with S the state at the chunk start, Gl = G[last] and kgl = k * exp(Gl - G):
    u = u0 - w S,   o = scale (q * exp(G)) S + Mqk u,   S_next = exp(Gl) * S + kgl^T u.
The state kernels walk the chunks of one sequence in order (one program per (V tile, sequence, head))
and store S per chunk (forward) or dS_next per chunk (backward) for the parallel kernels.
"""

import triton
import triton.language as tl

from kernels.kda.intra import to_dot


@triton.jit
def load_chunk(ptr, t0, n, h, H, D: tl.constexpr, col0, BD: tl.constexpr):
    """[64, BD] fp32 tile of a [T, H, D] tensor: tokens t0..t0+n-1, columns col0..col0+BD-1."""
    t, e = tl.arange(0, 64), col0 + tl.arange(0, BD)
    mask = (t < n)[:, None] & (e < D)[None, :]
    return tl.load(ptr + (t0 + t)[:, None] * (H * D) + h * D + e[None, :], mask=mask, other=0.0).to(tl.float32)


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
def key_decay_to_end(k, G, t0, n, h, H, K: tl.constexpr, BK: tl.constexpr):
    """(kgl = k * exp(G_last - G) [64, BK], G_last [BK])."""
    d = tl.arange(0, BK)
    g = load_chunk(G, t0, n, h, H, K, 0, BK)
    g_last = tl.load(G + (t0 + n - 1) * H * K + h * K + d, mask=d < K, other=0.0)
    valid = (tl.arange(0, 64) < n)[:, None] & (d < K)[None, :]
    kgl = load_chunk(k, t0, n, h, H, K, 0, BK) * tl.exp(tl.where(valid, g_last[None, :] - g, float("-inf")))
    return kgl, g_last


@triton.jit
def state_fwd_kernel(k, W, U0, G, h0, hbuf, U, ht, seq_chunks, chunk_start, chunk_len,
                     H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, DOT_BF16: tl.constexpr):
    vb, nh = tl.program_id(0), tl.program_id(1)
    seq, h = nh // H, nh % H
    v0 = vb * BV
    offs0, mask_s = state_offsets(seq, h, v0, H, K, V, BK, BV)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + offs0, mask=mask_s, other=0.0).to(tl.float32)
    for c in range(tl.load(seq_chunks + seq), tl.load(seq_chunks + seq + 1)):
        t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
        offs_c, _ = state_offsets(c, h, v0, H, K, V, BK, BV)
        tl.store(hbuf + offs_c, S.to(hbuf.dtype.element_ty), mask=mask_s)
        w = load_chunk(W, t0, n, h, H, K, 0, BK)
        # fp32 operands (tf32 on GPU) here: this product feeds back into the state every chunk
        u = load_chunk(U0, t0, n, h, H, V, v0, BV) - tl.dot(w, S)
        store_chunk(U, u, t0, n, h, H, V, v0, BV)
        kgl, g_last = key_decay_to_end(k, G, t0, n, h, H, K, BK)
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(kgl), u)
    if STORE_FINAL:
        tl.store(ht + offs0, S, mask=mask_s)


@triton.jit
def output_kernel(q, G, hbuf, Mqk, U, O, chunk_start, chunk_len, scale,
                  H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  DOT_BF16: tl.constexpr):
    vb, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    v0 = vb * BV
    qg = load_chunk(q, t0, n, h, H, K, 0, BK) * tl.exp(load_chunk(G, t0, n, h, H, K, 0, BK)) * scale
    offs_c, mask_s = state_offsets(c, h, v0, H, K, V, BK, BV)
    S = tl.load(hbuf + offs_c, mask=mask_s, other=0.0)
    o = tl.dot(to_dot(qg, DOT_BF16), to_dot(S, DOT_BF16))
    o += tl.dot(to_dot(load_chunk(Mqk, t0, n, h, H, 64, 0, 64), DOT_BF16),
                to_dot(load_chunk(U, t0, n, h, H, V, v0, BV), DOT_BF16))
    store_chunk(O, o, t0, n, h, H, V, v0, BV)


@triton.jit
def state_bwd_kernel(q, k, W, G, Mqk, dO, dht, dhbuf, dU, dh0, seq_chunks, chunk_start, chunk_len, scale,
                     H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, DOT_BF16: tl.constexpr):
    """Reverse walk: du = Mqk^T dO + kgl dS_next;  dS = exp(Gl) dS_next - w^T du + (scale q exp(G))^T dO."""
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
        t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
        offs_c, _ = state_offsets(c, h, v0, H, K, V, BK, BV)
        tl.store(dhbuf + offs_c, dS.to(dhbuf.dtype.element_ty), mask=mask_s)
        do = to_dot(load_chunk(dO, t0, n, h, H, V, v0, BV), DOT_BF16)
        m = to_dot(load_chunk(Mqk, t0, n, h, H, 64, 0, 64), DOT_BF16)
        kgl, g_last = key_decay_to_end(k, G, t0, n, h, H, K, BK)
        du = tl.dot(tl.trans(m), do) + tl.dot(to_dot(kgl, DOT_BF16), to_dot(dS, DOT_BF16))
        store_chunk(dU, du, t0, n, h, H, V, v0, BV)
        w = to_dot(load_chunk(W, t0, n, h, H, K, 0, BK), DOT_BF16)
        qg = load_chunk(q, t0, n, h, H, K, 0, BK) * tl.exp(load_chunk(G, t0, n, h, H, K, 0, BK)) * scale
        dS = dS * tl.exp(g_last)[:, None] - tl.dot(tl.trans(w), to_dot(du, DOT_BF16))
        dS += tl.dot(tl.trans(to_dot(qg, DOT_BF16)), do)
    if HAS_H0:
        tl.store(dh0 + offs0, dS, mask=mask_s)
