"""Triton MoE combine, forward and backward: gathers the expert-output rows of each token's k pairs
directly (no [N * k, h] slot buffer, no fp32 copy of it), accumulates in fp32 with fp32 gates.

Forward (program per (token block, column block)):  out[n] = sum_j g[n, j] * rows[source[n, j]].
Backward (program per token block, columns looped): d_rows[source[n, j]] = g[n, j] * d_out[n] (each
row belongs to one pair: plain stores, no atomics) and d_g[n, j] = rows[source[n, j]] . d_out[n] (fp32).
A dropped pair (source == M) reads zeros and writes nothing.
"""

from types import MappingProxyType

import triton
import triton.language as tl

# Launch tables, read-only: (tokens, columns, warps) per program; chosen with offline sm_90 compiles (no spills,
# 88 / 161 registers)
FWD_CONFIG = MappingProxyType(dict(BN=16, BH=128, num_warps=4))
BWD_CONFIG = MappingProxyType(dict(BN=8, BH=256, num_warps=4))


@triton.jit
def combine_fwd_kernel(rows, gates, source, out, N, M, H, TOPK: tl.constexpr, BN: tl.constexpr,
                       BH: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    n_ok, c_ok = n < N, cols < H
    acc = tl.zeros([BN, BH], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(source + n * TOPK + j, mask=n_ok, other=M).to(tl.int64)
        g = tl.load(gates + n * TOPK + j, mask=n_ok, other=0.0)
        take = (n_ok & (r < M))[:, None] & c_ok[None, :]
        acc += g[:, None] * tl.load(rows + r[:, None] * H + cols[None, :], mask=take, other=0.0).to(tl.float32)
    dst = n.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out + dst, acc.to(out.dtype.element_ty), mask=n_ok[:, None] & c_ok[None, :])


@triton.jit
def combine_bwd_kernel(d_out, rows, gates, source, d_rows, d_gates, N, M, H, TOPK: tl.constexpr,
                       BN: tl.constexpr, BH: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    for j in range(TOPK):  # a loop: one pair's temporaries live at a time
        r = tl.load(source + n * TOPK + j, mask=n_ok, other=M).to(tl.int64)
        g = tl.load(gates + n * TOPK + j, mask=n_ok, other=0.0)
        take = n_ok & (r < M)
        d_g = tl.zeros([BN], dtype=tl.float32)
        for c0 in range(0, H, BH):
            cols = c0 + tl.arange(0, BH)
            c_ok = cols < H
            do = tl.load(d_out + n.to(tl.int64)[:, None] * H + cols[None, :],
                         mask=n_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            at = r[:, None] * H + cols[None, :]
            m = take[:, None] & c_ok[None, :]
            x = tl.load(rows + at, mask=m, other=0.0).to(tl.float32)
            tl.store(d_rows + at, (g[:, None] * do).to(d_rows.dtype.element_ty), mask=m)
            d_g += tl.sum(x * do, 1)
        tl.store(d_gates + n * TOPK + j, d_g, mask=n_ok)


def combine_fwd(rows, gates, source):
    num_tokens, top_k = gates.shape
    num_rows, hidden = rows.shape
    out = rows.new_empty(num_tokens, hidden)
    grid = (triton.cdiv(num_tokens, FWD_CONFIG["BN"]), triton.cdiv(hidden, FWD_CONFIG["BH"]))
    combine_fwd_kernel[grid](rows, gates, source, out, num_tokens, num_rows, hidden, TOPK=top_k, **FWD_CONFIG)
    return out


def combine_bwd(d_out, rows, gates, source):
    num_tokens, top_k = gates.shape
    num_rows, hidden = rows.shape
    d_rows = rows.new_empty(num_rows, hidden)  # every kept row is one pair's: all written
    d_gates = gates.new_empty(num_tokens, top_k)
    combine_bwd_kernel[(triton.cdiv(num_tokens, BWD_CONFIG["BN"]),)](
        d_out, rows, gates, source, d_rows, d_gates, num_tokens, num_rows, hidden, TOPK=top_k, **BWD_CONFIG)
    return d_rows, d_gates
