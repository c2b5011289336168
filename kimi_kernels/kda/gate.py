"""KDA decay gate fused with the chunk-local cumulative sum (fp32), and the gate's derivatives.

GATE codes (constexpr): 0 = g is already the log-decay, 1 = softplus gate
-exp(A_log) * softplus(f + dt_bias), 2 = lower-bounded gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).
"""

import triton
import triton.language as tl

from kimi_kernels.kda.l2norm import l2_normalize_rows

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
def gate_tile(f, t0, n, h, K: tl.constexpr, col0, BK: tl.constexpr, f_seq_len, f_seq_stride, f_tok_stride):
    """Block pointer to the [64, BK] tile of f (or of its gradient, laid out like f) at packed tokens
    t0..t0+n-1, head h, columns col0..col0+BK-1."""
    base = gate_token_offset(t0, f_seq_len, f_seq_stride, f_tok_stride) + h * K
    return tl.make_block_ptr(f + base, (n, K), (f_tok_stride, 1), (0, col0), (64, BK), (1, 0))


@triton.jit
def gate_cumsum_kernel(f, A_log, dt_bias, G, q, k, qn, kn, chunk_start, chunk_len, lower_bound, eps,
                       f_seq_len, f_seq_stride, f_tok_stride, H, K: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr,
                       GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    """Grid (chunk, head, 1 + 2 * NORM). Part 0: G = cumsum over the chunk of gate(f), in fp32 (f addressed
    through its strides, see gate_token_offset); with NORM, parts 1 and 2 write the L2-normalised q and k
    (fp32 math, stored in their dtype).
    This kernel is bound by memory traffic, so it is shaped for many resident programs per SM: one tensor
    per program (not all three) and the chunk in blocks of RB rows (the cumsum carries the running sum of
    the rows before), which keeps the live tiles and their addresses small."""
    c, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, n = tl.load(chunk_start + c), tl.load(chunk_len + c)
    r, d = tl.arange(0, RB), tl.arange(0, BK)
    if part == 0:
        a = 1.0
        if HAS_A:
            a = tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.zeros([1, BK], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(dt_bias + h * K + d, mask=d < K, other=0.0).to(tl.float32)[None, :]
        carry = tl.zeros([BK], dtype=tl.float32)
        f_base = gate_token_offset(t0, f_seq_len, f_seq_stride, f_tok_stride) + h * K
        for r0 in tl.static_range(0, 64, RB):
            mask = (r0 + r < n)[:, None] & (d < K)[None, :]
            offs = (t0 + r0 + r)[:, None] * (H * K) + h * K + d[None, :]
            x = tl.load(f + f_base + (r0 + r)[:, None] * f_tok_stride + d[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            g = tl.where(mask, gate_value(x, a, bias, lower_bound, GATE), 0.0)
            tl.store(G + offs, carry[None, :] + tl.cumsum(g, 0), mask=mask)
            carry += tl.sum(g, 0)
    else:
        src, dst = q, qn
        if part == 2:
            src, dst = k, kn
        for r0 in tl.static_range(0, 64, RB):
            mask = (r0 + r < n)[:, None] & (d < K)[None, :]
            offs = (t0 + r0 + r)[:, None] * (H * K) + h * K + d[None, :]
            x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst + offs, l2_normalize_rows(x, eps).to(dst.dtype.element_ty), mask=mask)
