"""Triton causal depthwise short convolution + SiLU, sequence-first in, batch-first out.

    pre[t, b, c] = sum_j w[c, j] x[t - (K-1) + j, b, c]   (x = 0 before t = 0)
    y[b, t, c]   = silu(pre[t, b, c])

A program owns a tile of BT time steps x BC channels of one sample. The K-1 step halo before the
tile is read by the shifted loads (tap j reads rows t - (K-1) + j), so tiles never talk to each
other; the repeated reads of a row should hit L1/L2, leaving one read of x (and one write) to HBM.
Rows of x and y are C contiguous channels, so every load and store is contiguous along C; the
[s, b, C] -> [b, s, C] layout change is only a different row address for the store.

Backward, with g[u] = dy[u] * silu'(pre[u]) recomputed from x (pre is not saved):
    dx[t, b, c] = sum_d w[c, K-1-d] g[t + d, b, c]          (g = 0 past the end)
    dw[c, j]    = sum_{b, t} g[t, b, c] x[t - (K-1) + j, b, c]
A backward program walks a chunk of CHUNK steps in BT-step sub-tiles and writes its dw partial sums
[K, BC] to its own slot of an fp32 buffer that the caller sums afterwards: deterministic, no atomics.
"""

import torch
import triton
import triton.language as tl

# Tiles (time steps, channels, warps): channel tiles of 128 keep rows at 256 contiguous bytes in bf16.
# Time tiles are short because the compiler issues all K (forward) or K * K (backward) shifted loads
# of a tile at once: offline sm_90 compiles give 96 (fwd) / 146 (bwd) registers at K = 4 and no spills
# up to K = 8 (tests/kernels/test_short_conv_compile.py). Backward: CHUNK steps per program.
FWD_CONFIG = dict(BT=16, BC=128, num_warps=4)
BWD_CONFIG = dict(CHUNK=128, BT=8, BC=128, num_warps=4)


@triton.jit
def _shifted_pre(x, w, t, b, c, c_ok, S, B, C, K: tl.constexpr, SHIFT: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr):
    """fp32 pre-activation at time steps t + SHIFT (zero input outside [0, S))."""
    pre = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = t + (SHIFT - (K - 1) + j)
        ok = (src >= 0) & (src < S)
        rows = (src.to(tl.int64) * B + b) * C
        xv = tl.load(x + rows[:, None] + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        wj = tl.load(w + c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        pre += xv.to(tl.float32) * wj[None, :]
    return pre


@triton.jit
def conv_fwd_kernel(x, w, y, S, B, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    c_ok = c < C
    pre = _shifted_pre(x, w, t, b, c, c_ok, S, B, C, K, 0, BT, BC)
    out = pre * tl.sigmoid(pre)
    dst = (b * S + t.to(tl.int64)) * C  # batch-first rows
    tl.store(y + dst[:, None] + c[None, :], out.to(y.dtype.element_ty), mask=(t < S)[:, None] & c_ok[None, :])


@triton.jit
def conv_bwd_kernel(x, w, dy, dx, dw_part, S, B, C, K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    """A program walks CHUNK time steps in sub-tiles of BT (few registers per sub-tile, the halo rows
    of the next sub-tile already in L1) and sums its dw over the whole chunk, so the partial-sum
    buffer has s / CHUNK rows per sample, not s / BT."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2)
    c_ok = c < C
    taps = tl.arange(0, KP)  # K padded to a power of two
    dw_acc = tl.zeros([KP, BC], dtype=tl.float32)
    for t0 in range(pid_t * CHUNK, tl.minimum(pid_t * CHUNK + CHUNK, S), BT):
        t = t0 + tl.arange(0, BT)
        dx_acc = tl.zeros([BT, BC], dtype=tl.float32)
        g0 = tl.zeros([BT, BC], dtype=tl.float32)
        # g at t + d feeds dx[t] through tap K-1-d; g beyond the sequence is zero (dy masked to 0).
        for d in tl.static_range(K):
            u = t + d
            pre = _shifted_pre(x, w, t, b, c, c_ok, S, B, C, K, d, BT, BC)
            rows = (b * S + u.to(tl.int64)) * C
            dyv = tl.load(dy + rows[:, None] + c[None, :], mask=(u < S)[:, None] & c_ok[None, :], other=0.0)
            sig = tl.sigmoid(pre)
            g = dyv.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))  # silu'(p) = s (1 + p (1 - s))
            wd = tl.load(w + c * K + (K - 1 - d), mask=c_ok, other=0.0).to(tl.float32)
            dx_acc += g * wd[None, :]
            if d == 0:
                g0 = g
        dst = (t.to(tl.int64) * B + b) * C  # sequence-first rows
        tl.store(dx + dst[:, None] + c[None, :], dx_acc.to(dx.dtype.element_ty),
                 mask=(t < S)[:, None] & c_ok[None, :])
        # dw: g at the sub-tile's own steps against each tap's shifted input.
        for j in tl.static_range(K):
            src = t - (K - 1) + j
            ok = (src >= 0) & (src < S)
            rows = (src.to(tl.int64) * B + b) * C
            xv = tl.load(x + rows[:, None] + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            tap_sum = tl.sum(g0 * xv.to(tl.float32), 0)
            dw_acc += tl.where(taps[:, None] == j, tap_sum[None, :], 0.0)
    part = dw_part + ((pid_t * B + b) * K).to(tl.int64) * C
    tl.store(part + taps[:, None] * C + c[None, :], dw_acc, mask=(taps < K)[:, None] & c_ok[None, :])


def conv_fwd(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [s, b, C]`` contiguous, ``weight [C, K]`` contiguous -> ``y [b, s, C]`` in x's dtype."""
    seq, batch, channels = x.shape
    y = x.new_empty(batch, seq, channels)
    cfg = FWD_CONFIG
    grid = (triton.cdiv(seq, cfg["BT"]), triton.cdiv(channels, cfg["BC"]), batch)
    conv_fwd_kernel[grid](x, weight, y, seq, batch, channels, K=weight.shape[1], **cfg)
    return y


def conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """``dy [b, s, C]`` contiguous -> ``dx [s, b, C]`` (x's dtype), ``dweight [C, K]`` (weight's dtype,
    summed in fp32)."""
    seq, batch, channels = x.shape
    kernel_size = weight.shape[1]
    cfg = BWD_CONFIG
    grid = (triton.cdiv(seq, cfg["CHUNK"]), triton.cdiv(channels, cfg["BC"]), batch)
    dx = torch.empty_like(x)
    # One [K, C] slot per (time chunk, sample); every slot is fully written (all channel tiles).
    dw_part = torch.empty(grid[0] * batch, kernel_size, channels, device=x.device, dtype=torch.float32)
    conv_bwd_kernel[grid](x, weight, dy, dx, dw_part, seq, batch, channels, K=kernel_size,
                          KP=triton.next_power_of_2(kernel_size), **cfg)
    dweight = dw_part.sum(0).t().contiguous().to(weight.dtype)
    return dx, dweight
