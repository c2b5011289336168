"""KDA decay gate fused with the chunk-local cumulative sum (fp32), and the gate's derivatives.

GATE codes (constexpr): 0 = g is already the log-decay, 1 = softplus gate
-exp(A_log) * softplus(f + dt_bias), 2 = lower-bounded gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).
"""

import triton
import triton.language as tl

from kimi_kernels.kda.l2norm import l2_inverse_norms

GATE_GIVEN, GATE_SOFTPLUS, GATE_LOWER_BOUND = 0, 1, 2


@triton.jit
def gate_value(f, a, bias, lower_bound, GATE: tl.constexpr):
    """Log-decay from the raw gate input f; a = exp(A_log) of the head, bias = dt_bias of the channel."""
    if GATE == 1:
        x = f + bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        return -a * softplus
    elif GATE == 2:
        return lower_bound * tl.sigmoid(a * (f + bias))
    else:
        return f


@triton.jit
def gate_grads(f, a, bias, lower_bound, GATE: tl.constexpr):
    """(dg/df, dg/dA_log) of gate_value; dt_bias has the same derivative as f."""
    x = f + bias
    if GATE == 1:
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        return -a * tl.sigmoid(x), -a * softplus
    else:
        s = tl.sigmoid(a * x)
        slope = lower_bound * s * (1.0 - s)
        return slope * a, slope * a * x


@triton.jit
def gate_token_offset(t0, f_seq_len, f_seq_stride, f_tok_stride):
    """Offset of packed token t0 in the raw gate f ``[B, T, H, K]``, whose batch and time dims may have any
    strides (a sequence-first projection read batch-first: no copy), a token's H x K values contiguous."""
    t0 = t0.to(tl.int64)
    return (t0 // f_seq_len) * f_seq_stride + (t0 % f_seq_len) * f_tok_stride


@triton.jit
def head_group_columns(hg, H, K: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr):
    """The K columns of HB consecutive heads (group hg) as one flat axis of HB * BK: per column its offset
    h * K + d inside a token's H x K values and whether it is real (h < H, d < K). With BK = K the offsets are
    contiguous, so a thread's 8 columns are one 16-byte load of bf16 (two of fp32)."""
    j = tl.arange(0, HB * BK)
    head, d = hg * HB + j // BK, j % BK
    return head * K + d, (head < H) & (d < K)


@triton.jit
def gate_parameters(A_log, dt_bias, col, col_ok, K: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(a, bias) of the gate for columns col (head = col // K): a = exp(A_log[head]) or 1, bias = dt_bias[col] or 0,
    fp32."""
    a = 1.0
    if HAS_A:
        a = tl.exp(tl.load(A_log + col // K, mask=col_ok, other=0.0).to(tl.float32))
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dt_bias + col, mask=col_ok, other=0.0).to(tl.float32)
    return a, bias


@triton.jit
def gate_cumsum_chunk(f, A_log, dt_bias, G, q, inv_q, QG, t0, n, hg, col, col_ok, lower_bound, eps, scale, f_seq_len,
                      f_seq_stride, f_tok_stride, H, K: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr,
                      RB: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr):
    """G = cumsum over the chunk's rows of gate(f) for the HB * BK columns col (head_group_columns), RB rows at a
    time, in [RB, HB * BK] tiles; with each block of G, the same rows of q: their inverse L2 norms per head into
    inv_q (NORM; fp32 [T, H]) and QG = scale qn exp(G), qn = q inv_q, the output's query (so that the forward walk
    reads neither q nor the fp32 G).
    f's column offsets are marked contiguous in runs of 4 only (tl.max_contiguous), so f (bf16) is read in 8-byte
    runs, 4 columns a run as in G's 16-byte fp32 stores: both accesses take one layout (4 columns a vector, the
    threads across the columns, a block's rows inside each thread) and the scan over rows is a sum in registers.
    With f in 16-byte runs, Triton converted every tile between the two layouts through warp shuffles. (An
    [RB, cols / 4, 4] tile ties its two outer axes in contiguity, and Triton 3.6 broke the tie the other way from
    3.8: threads across the rows, a cross-lane scan, and spills.)"""
    col, col_ok = col[None, :], col_ok[None, :]
    a, bias = gate_parameters(A_log, dt_bias, col, col_ok, K, HAS_A, HAS_BIAS)
    carry = tl.zeros([1, HB * BK], dtype=tl.float32)
    f_col = f + gate_token_offset(t0, f_seq_len, f_seq_stride, f_tok_stride) + tl.max_contiguous(col, [1, 4])
    start = t0.to(tl.int64) * (H * K) + col  # G, q and QG are packed [T, H, K]
    rows = tl.arange(0, RB)[:, None]
    # two blocks a step, each loaded one block ahead into its own registers: the next block's loads go out
    # before this block's stores, and no loaded register is copied at the loop's back edge (where the warp
    # would wait for the load to land); rows past the chunk (n <= 64) are masked off
    x0 = tl.load(f_col + rows * f_tok_stride, mask=(rows < n) & col_ok, other=0.0)
    y0 = tl.load(q + start + rows * (H * K), mask=(rows < n) & col_ok, other=0.0)
    for _ in range(64 // (2 * RB)):
        x1 = tl.load(f_col + (rows + RB) * f_tok_stride, mask=(rows + RB < n) & col_ok, other=0.0)
        y1 = tl.load(q + start + (rows + RB) * (H * K), mask=(rows + RB < n) & col_ok, other=0.0)
        carry = gate_cumsum_rows(x0, y0, G, inv_q, QG, start, t0, hg, rows, n, col_ok, carry, a, bias, lower_bound,
                                 eps, scale, H, K, HB, BK, RB, GATE, NORM)
        x0 = tl.load(f_col + (rows + 2 * RB) * f_tok_stride, mask=(rows + 2 * RB < n) & col_ok, other=0.0)
        y0 = tl.load(q + start + (rows + 2 * RB) * (H * K), mask=(rows + 2 * RB < n) & col_ok, other=0.0)
        carry = gate_cumsum_rows(x1, y1, G, inv_q, QG, start, t0, hg, rows + RB, n, col_ok, carry, a, bias,
                                 lower_bound, eps, scale, H, K, HB, BK, RB, GATE, NORM)
        rows += 2 * RB


@triton.jit
def gate_cumsum_rows(x, y, G, inv_q, QG, start, t0, hg, rows, n, col_ok, carry, a, bias, lower_bound, eps, scale, H,
                     K: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr, GATE: tl.constexpr,
                     NORM: tl.constexpr):
    """Stores G, inv_q (NORM) and QG for one block of rows (x: its raw gate values, y: its q); returns the running
    sum after it."""
    mask = (rows < n) & col_ok
    offs = start + rows * (H * K)
    g = tl.where(mask, gate_value(x.to(tl.float32), a, bias, lower_bound, GATE), 0.0)
    g_rows = carry + tl.cumsum(g, 0)
    tl.store(G + offs, g_rows, mask=mask)
    y = y.to(tl.float32)
    if NORM:
        y = tl.reshape(y, [RB * HB, BK])
        inv = l2_inverse_norms(y, eps)
        store_row_values(inv_q, inv, t0, hg, rows, n, H, HB, RB)
        y = tl.reshape(y * inv[:, None], [RB, HB * BK])
    tl.store(QG + offs, (y * tl.exp(g_rows) * scale).to(QG.dtype.element_ty), mask=mask)
    return carry + tl.sum(g, 0, keep_dims=True)


@triton.jit
def store_row_values(dst, values, t0, hg, rows, n, H, HB: tl.constexpr, RB: tl.constexpr):
    """values [RB * HB] (rows outer, the group's heads inner) into dst [T, H] at the rows ``rows`` [RB, 1]."""
    r = tl.reshape(rows + tl.zeros([RB, HB], dtype=tl.int32), [RB * HB])
    head = hg * HB + tl.arange(0, RB * HB) % HB
    tl.store(dst + (t0 + r).to(tl.int64) * H + head, values, mask=(r < n) & (head < H))


@triton.jit
def inverse_norms_chunk(src, inv, t0, n, hg, col, col_ok, eps, H, K: tl.constexpr, HB: tl.constexpr,
                        BK: tl.constexpr, RB: tl.constexpr):
    """inv = 1 / max(|src|, eps) per (row, head) over the chunk's rows, RB rows at a time (two blocks a step,
    loaded one block ahead as in gate_cumsum_chunk)."""
    rows = tl.arange(0, RB)[:, None]
    src_col = src + t0.to(tl.int64) * (H * K) + col[None, :]
    x0 = tl.load(src_col + rows * (H * K), mask=(rows < n) & col_ok[None, :], other=0.0)
    for _ in range(64 // (2 * RB)):
        x1 = tl.load(src_col + (rows + RB) * (H * K), mask=(rows + RB < n) & col_ok[None, :], other=0.0)
        store_row_values(inv, l2_inverse_norms(tl.reshape(x0.to(tl.float32), [RB * HB, BK]), eps), t0, hg, rows, n,
                         H, HB, RB)
        x0 = tl.load(src_col + (rows + 2 * RB) * (H * K), mask=(rows + 2 * RB < n) & col_ok[None, :], other=0.0)
        store_row_values(inv, l2_inverse_norms(tl.reshape(x1.to(tl.float32), [RB * HB, BK]), eps), t0, hg,
                         rows + RB, n, H, HB, RB)
        rows += 2 * RB


@triton.jit
def gate_cumsum_kernel(f, A_log, dt_bias, G, q, k, inv_q, inv_k, QG, chunk_start, chunk_len, lower_bound, eps, scale,
                       f_seq_len, f_seq_stride, f_tok_stride, H, K: tl.constexpr, BK: tl.constexpr, HB: tl.constexpr,
                       RB: tl.constexpr, RB_NORM: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    """Grid (chunk x group of HB heads, 1 + NORM). Part 0: G = cumsum over the chunk of gate(f), in fp32 (f
    addressed through its strides, see gate_token_offset), and from q QG = scale qn exp(G), qn = q inv_q (with
    NORM: inv_q = 1 / max(|q|, eps) per (token, head), stored fp32 [T, H]; else qn = q); with NORM, part 1 stores
    k's inverse norms, inv_k. No normalised copy of q or k is written: the kernels that read them scale by these.
    Memory-bound, so shaped for few instructions per element and enough loads in flight: one warp a program (launch
    table), its tile RB rows x HB heads x BK columns (HB * BK = 256), the rows inside each thread. The cumsum over
    rows is a sequential sum in registers (no shuffles, no shared memory), carried from block to block; a row's L2
    norm is a sum over the threads of its head's columns. The head groups of a chunk are neighbouring programs, so
    programs launched together read whole token rows of q, k and f."""
    groups = tl.cdiv(H, HB)
    c, hg, part = tl.program_id(0) // groups, tl.program_id(0) % groups, tl.program_id(1)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    col, col_ok = head_group_columns(hg, H, K, BK, HB)
    if part == 0:
        gate_cumsum_chunk(f, A_log, dt_bias, G, q, inv_q, QG, t0, n, hg, col, col_ok, lower_bound, eps, scale,
                          f_seq_len, f_seq_stride, f_tok_stride, H, K, HB, BK, RB, GATE, HAS_A, HAS_BIAS, NORM)
    else:
        inverse_norms_chunk(k, inv_k, t0, n, hg, col, col_ok, eps, H, K, HB, BK, RB_NORM)
