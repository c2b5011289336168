"""Intra-chunk forward: decayed q.k / k.k products, the UT transform and w, u (chunk C = 64).

For a chunk with cumulative log-decay G (fp32, [64, K]) every product needs exp(G_t - G_s) per channel.
Row block i (16 tokens) uses the reference row r = G[16 i] and the factorisation
    exp(G_t - G_s) = exp(G_t - r) * exp(r - G_s),
so that a whole [16, 64] block row is ONE tl.dot: (x_t * exp(G_t - r)) @ (k_s * exp(r - G_s))^T.
exp(G_t - r) <= 1 always; exp(r - G_s) <= 1 for s before the block and <= exp(15 * |g_min|) inside the
diagonal tile, which is finite in fp32 for a lower-bounded gate (g >= -5: <= e^75). SAFE_GATE=False
(an unbounded gate) keeps the dot for the blocks left of the diagonal and computes the diagonal 16x16
tile position by position instead.

Outputs per chunk: Mqk = scale * (q.k decayed, causal incl. diagonal), Ainv = (I + diag(beta) Akk)^-1
(Akk strictly lower), w = Ainv (beta k exp(G)), u0 = Ainv (beta v), and the state walk's kgl = k exp(G_last - G).
"""

import triton
import triton.language as tl


@triton.jit
def to_dot(x, DOT_BF16: tl.constexpr):
    """Operands of tl.dot: bf16 when the inputs are bf16 (fp32 accumulation), fp32 otherwise."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def dot_split(a, b, SPLIT_A: tl.constexpr, DOT_BF16: tl.constexpr):
    """a @ b where one fp32 operand (a if SPLIT_A else b) is split into bf16 hi + lo parts for bf16 inputs:
    two bf16 dots give it ~16 mantissa bits instead of 8 (the other operand is rounded to bf16 once, i.e. it
    should be bf16 data or a value that every use rounds the same way). Used where terms cancel (dG)."""
    if DOT_BF16:
        if SPLIT_A:
            hi = a.to(tl.bfloat16)
            lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
            other = b.to(tl.bfloat16)
            return tl.dot(lo, other, tl.dot(hi, other))
        else:
            hi = b.to(tl.bfloat16)
            lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
            other = a.to(tl.bfloat16)
            return tl.dot(other, lo, tl.dot(other, hi))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def chunk_block(ptr, t0, n, h, H, D: tl.constexpr, col0, BD: tl.constexpr, ROWS: tl.constexpr = 64):
    """Block pointer to a [ROWS, BD] tile of a [T, H, D] tensor: tokens t0..t0+n-1, columns col0..col0+BD-1.
    Block pointers (bounds instead of per-element masks and 64-bit addresses) keep the loops over V from
    holding a hoisted pointer tensor per operand in registers."""
    return tl.make_block_ptr(ptr + t0 * (H * D) + h * D, (n, D), (H * D, 1), (0, col0), (ROWS, BD), (1, 0))


@triton.jit
def load_tile(ptr, t0, n, h, H, D: tl.constexpr, col0, BD: tl.constexpr, ROWS: tl.constexpr = 64):
    """The chunk's first ROWS rows, columns col0..col0+BD-1, in fp32 (zero past its n rows and D columns), through a
    block pointer (see chunk_block)."""
    block = chunk_block(ptr, t0, n, h, H, D, col0, BD, ROWS)
    return tl.load(block, boundary_check=(0, 1), padding_option="zero").to(tl.float32)


@triton.jit
def store_tile(ptr, x, t0, n, h, H, D: tl.constexpr, col0, BD: tl.constexpr):
    tl.store(chunk_block(ptr, t0, n, h, H, D, col0, BD), x.to(ptr.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def gate_at_chunk_end(G, t0, n, h, H, K: tl.constexpr, cols):
    """G at the chunk's last token (t0 + n - 1), columns ``cols`` (zero from K on)."""
    return tl.load(G + (t0 + n - 1) * H * K + h * K + cols, mask=cols < K, other=0.0)


@triton.jit
def row_block(ptr, t0, r0, n, row_stride, col0, cols, ncols):
    """Load rows r0..r0+15 of a chunk starting at token t0 (n valid rows) as fp32 [16, len(cols)]."""
    rows = r0 + tl.arange(0, 16)
    mask = (rows < n)[:, None] & (cols < ncols)[None, :]
    return tl.load(ptr + (t0 + rows)[:, None] * row_stride + col0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def decay_factors(g_c, g_i, G, t0, r0, n, h, H, K: tl.constexpr, d, NC: tl.constexpr, SAFE_GATE: tl.constexpr):
    """Factors of exp(G_t - G_s) around r = G[min(r0, n - 1)] for the channels d: rows exp(G_t - r) [16, len(d)]
    and columns exp(r - G_s) [NC, len(d)], zero outside the valid tokens and the columns the dot path covers."""
    t, s16 = tl.arange(0, NC), tl.arange(0, 16)
    kmask = d < K
    g_r = tl.load(G + (t0 + tl.minimum(r0, n - 1)) * H * K + h * K + d, mask=kmask, other=0.0)
    row_ok = ((r0 + s16) < n)[:, None] & kmask[None, :]
    e_row = tl.exp(tl.where(row_ok, g_i - g_r[None, :], float("-inf")))
    if SAFE_GATE:
        ncol = r0 + 16
    else:
        ncol = r0
    col_ok = ((t < ncol) & (t < n))[:, None] & kmask[None, :]
    e_col = tl.exp(tl.where(col_ok, g_r[None, :] - g_c, float("-inf")))
    return e_row, e_col


@triton.jit
def block_row_products(mq, lk, q, k, G, k_c, g_c, t0, r0, n, h, H, K: tl.constexpr, dc, NC: tl.constexpr,
                       SAFE_GATE: tl.constexpr, DOT_BF16: tl.constexpr):
    """Adds one K slice (channels dc) of row block r0's decayed products with the chunk's first NC keys
    (k_c, g_c: [NC, KS]) to mq, lk [16, NC]: one dot each, the diagonal tile included on the dense path. q and k
    as given (raw under NORM: store_block_row scales the sums)."""
    t = tl.arange(0, NC)
    rows = r0 + tl.arange(0, 16)
    q_i = row_block(q, t0, r0, n, H * K, h * K, dc, K)
    k_i = row_block(k, t0, r0, n, H * K, h * K, dc, K)
    g_i = row_block(G, t0, r0, n, H * K, h * K, dc, K)
    e_row, e_col = decay_factors(g_c, g_i, G, t0, r0, n, h, H, K, dc, NC, SAFE_GATE)
    kl = to_dot(k_c * e_col, DOT_BF16)
    mq = tl.dot(to_dot(q_i * e_row, DOT_BF16), tl.trans(kl), mq)
    lk = tl.dot(to_dot(k_i * e_row, DOT_BF16), tl.trans(kl), lk)
    if not SAFE_GATE:
        for s in range(16):  # diagonal tile, position by position (unbounded gate)
            col = r0 + s
            cmask = (dc < K) & (col < n)
            k_s = tl.load(k + (t0 + col) * H * K + h * K + dc, mask=cmask, other=0.0).to(tl.float32)
            g_s = tl.load(G + (t0 + col) * H * K + h * K + dc, mask=cmask, other=0.0)
            ok = ((rows < n) & (rows >= col))[:, None] & (dc < K)[None, :]
            e = tl.exp(tl.where(ok, g_i - g_s[None, :], float("-inf")))
            mq += tl.where(t[None, :] == col, tl.sum(q_i * k_s[None, :] * e, 1)[:, None], 0.0)
            lk += tl.where(t[None, :] == col, tl.sum(k_i * k_s[None, :] * e, 1)[:, None], 0.0)
    return mq, lk


@triton.jit
def store_block_row(Mqk, a_base, mq, lk, beta, inv_q, inv_k, t0, r0, n, h, H, scale, NC: tl.constexpr,
                    NORM: tl.constexpr):
    """Row block r0 of Mqk (scaled, causal incl. the diagonal; zero from column NC on) and of L = diag(beta) Akk
    (strictly lower, columns < NC, to the inverse's scratch: step 2 reads no column past the block). With NORM the
    products were of raw q and k: each row and column is scaled by its inverse L2 norm here, on the [16, NC] sums,
    instead of every element of the [*, K] operands."""
    t = tl.arange(0, NC)
    rows = r0 + tl.arange(0, 16)
    rok = rows < n
    b_i = tl.load(beta + (t0 + rows) * H + h, mask=rok, other=0.0).to(tl.float32)
    if NORM:
        ik_c = tl.load(inv_k + (t0 + t) * H + h, mask=t < n, other=0.0)[None, :]
        mq = mq * tl.load(inv_q + (t0 + rows) * H + h, mask=rok, other=0.0)[:, None] * ik_c
        b_i = b_i * tl.load(inv_k + (t0 + rows) * H + h, mask=rok, other=0.0)
        lk = lk * ik_c
    valid = rok[:, None] & (t < n)[None, :]
    mq = tl.where(valid & (t[None, :] <= rows[:, None]), mq * scale, 0.0)
    lk = tl.where(valid & (t[None, :] < rows[:, None]), lk * b_i[:, None], 0.0)
    offs_a = (t0 + rows)[:, None] * (H * 64) + t[None, :]
    tl.store(Mqk + h * 64 + offs_a, mq.to(Mqk.dtype.element_ty), mask=rok[:, None])
    tl.store(a_base + offs_a, lk, mask=rok[:, None])
    if NC < 64:
        zeros = tl.zeros([16, 64 - NC], dtype=Mqk.dtype.element_ty)
        tl.store(Mqk + h * 64 + offs_a + NC, zeros, mask=rok[:, None])


@triton.jit
def half_chunk_products(q, k, G, Mqk, a_base, beta, inv_q, inv_k, t0, n, h, H, K: tl.constexpr, scale,
                        R0: tl.constexpr, NC: tl.constexpr, KS: tl.constexpr, SAFE_GATE: tl.constexpr,
                        DOT_BF16: tl.constexpr, NORM: tl.constexpr, STAGES: tl.constexpr):
    """Rows R0..R0+31 (two 16-row blocks) of Mqk and L against the chunk's first NC keys, the only ones they
    reach (R0 + 32 <= NC), summed over K slices of KS channels: each slice's key tile is loaded once for both
    blocks. STAGES > 1 pipelines the slices' loads (the next slice's tiles in flight through shared memory)."""
    mq_a = tl.zeros([16, NC], dtype=tl.float32)
    lk_a = tl.zeros([16, NC], dtype=tl.float32)
    mq_b, lk_b = mq_a, lk_a
    for kc in tl.range(0, K, KS, num_stages=STAGES):
        dc = kc + tl.arange(0, KS)
        k_c = load_tile(k, t0, n, h, H, K, kc, KS, NC)
        g_c = load_tile(G, t0, n, h, H, K, kc, KS, NC)
        mq_a, lk_a = block_row_products(mq_a, lk_a, q, k, G, k_c, g_c, t0, R0, n, h, H, K, dc, NC, SAFE_GATE,
                                        DOT_BF16)
        mq_b, lk_b = block_row_products(mq_b, lk_b, q, k, G, k_c, g_c, t0, R0 + 16, n, h, H, K, dc, NC, SAFE_GATE,
                                        DOT_BF16)
    store_block_row(Mqk, a_base, mq_a, lk_a, beta, inv_q, inv_k, t0, R0, n, h, H, scale, NC, NORM)
    store_block_row(Mqk, a_base, mq_b, lk_b, beta, inv_q, inv_k, t0, R0 + 16, n, h, H, scale, NC, NORM)


@triton.jit
def intra_fwd_kernel(q, k, v, beta, G, inv_q, inv_k, Mqk, Ainv, W, U0, KGL, chunk_start, chunk_len, scale,
                     H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     SAFE_GATE: tl.constexpr, DOT_BF16: tl.constexpr, KS: tl.constexpr, NORM: tl.constexpr,
                     PRODUCT_STAGES: tl.constexpr):
    """One (chunk, head). q and k come raw; with NORM their L2 normalisation is applied through the inverse norms
    inv_q, inv_k ([T, H] fp32, from the gate pass): on the products' sums and on beta (see store_block_row)."""
    c, h = tl.program_id(0), tl.program_id(1)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    t, s16 = tl.arange(0, 64), tl.arange(0, 16)
    row_ok = t < n
    a_base = Ainv + h * 64  # Ainv rows hold L = diag(beta) Akk first, then the inverse (scratch reuse)

    # 1) decayed products in two halves of 32 rows: the first half reaches only the first 32 keys
    # (loops over K slices, [NC, KS] key tiles: what keeps this kernel within 128 registers at K = 128)
    half_chunk_products(q, k, G, Mqk, a_base, beta, inv_q, inv_k, t0, n, h, H, K, scale, 0, 32, KS, SAFE_GATE,
                        DOT_BF16, NORM, PRODUCT_STAGES)
    half_chunk_products(q, k, G, Mqk, a_base, beta, inv_q, inv_k, t0, n, h, H, K, scale, 32, 64, KS, SAFE_GATE,
                        DOT_BF16, NORM, PRODUCT_STAGES)
    tl.debug_barrier()

    # 2) (I + L)^-1 by block forward substitution: X_i = D_i^-1 (E_i - L_{i,<i} X_{<i})
    for i in tl.static_range(4):
        r0 = i * 16
        rows = r0 + s16
        rok = rows < n
        offs_a = (t0 + rows)[:, None] * (H * 64) + t[None, :]
        eye = (s16[:, None] == s16[None, :]).to(tl.float32)
        d_inv = eye
        for s in range(1, 16):
            l_s = tl.load(a_base + (t0 + r0 + s) * (H * 64) + r0 + s16, mask=(s16 < s) & (r0 + s < n), other=0.0)
            new_row = tl.where(s16 == s, 1.0, -tl.sum(l_s[:, None] * d_inv, 0))
            d_inv = tl.where(s16[:, None] == s, new_row[None, :], d_inv)
        rhs = (t[None, :] == rows[:, None]).to(tl.float32)
        if i > 0:
            l_i = tl.load(a_base + offs_a, mask=rok[:, None] & (t[None, :] < r0), other=0.0)
            x_prev = tl.load(a_base + (t0 + t)[:, None] * (H * 64) + t[None, :],
                             mask=((t < r0) & row_ok)[:, None], other=0.0)
            rhs -= tl.dot(l_i, x_prev)
        x_i = tl.dot(d_inv, rhs)
        tl.debug_barrier()
        tl.store(a_base + offs_a, x_i, mask=rok[:, None])
        tl.debug_barrier()

    # 3) w = Ainv (beta k exp(G)), u0 = Ainv (beta v), KS channels / BV values at a time
    a_inv = tl.load(a_base + (t0 + t)[:, None] * (H * 64) + t[None, :], mask=row_ok[:, None], other=0.0)
    a_dot = to_dot(a_inv, DOT_BF16)
    b_all = tl.load(beta + (t0 + t) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    if NORM:
        ik_all = tl.load(inv_k + (t0 + t) * H + h, mask=row_ok, other=0.0)
    for kc in range(0, K, KS):
        dc = kc + tl.arange(0, KS)
        mk = row_ok[:, None] & (dc < K)[None, :]
        offs = (t0 + t)[:, None] * (H * K) + h * K + dc[None, :]
        k_c = tl.load(k + offs, mask=mk, other=0.0).to(tl.float32)
        if NORM:
            k_c *= ik_all[:, None]  # kn
        g_c = tl.load(G + offs, mask=mk, other=0.0)
        w = tl.dot(a_dot, to_dot(k_c * b_all[:, None] * tl.exp(g_c), DOT_BF16))
        tl.store(W + offs, w.to(W.dtype.element_ty), mask=mk)
        g_last = gate_at_chunk_end(G, t0, n, h, H, K, dc)
        kgl = k_c * tl.exp(tl.where(mk, g_last[None, :] - g_c, float("-inf")))  # the state walk's operand
        tl.store(KGL + offs, kgl.to(KGL.dtype.element_ty), mask=mk)
    for v0 in range(0, V, BV):
        e = v0 + tl.arange(0, BV)
        mv = row_ok[:, None] & (e < V)[None, :]
        offs_v = (t0 + t)[:, None] * (H * V) + h * V + e[None, :]
        vb = tl.load(v + offs_v, mask=mv, other=0.0).to(tl.float32) * b_all[:, None]
        u0 = tl.dot(a_dot, to_dot(vb, DOT_BF16))
        tl.store(U0 + offs_v, u0.to(U0.dtype.element_ty), mask=mv)
