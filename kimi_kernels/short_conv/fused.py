"""Triton causal depthwise short convolution + SiLU, sequence-first in, batch-first out.

    pre[t, b, c] = sum_j w[c, j] x[t - (K-1) + j, b, c]   (x = 0 before t = 0)
    y[b, t, c]   = silu(pre[t, b, c])

Forward: a program owns a tile of BT time steps x BC channels of one sample. The K-1 step halo before
the tile is read by the shifted loads (tap j reads rows t - (K-1) + j), so tiles never talk to each
other; the repeated reads of a row should hit L1/L2, leaving one read of x (and one write) to HBM.
Rows of x and y are C contiguous channels, so every load and store is contiguous along C; the
[s, b, C] -> [b, s, C] layout change is only a different row address for the store.

Backward, with g[u] = dy[u] * silu'(pre[u]) recomputed from x (pre is not saved):
    dx[t, b, c] = sum_d w[c, K-1-d] g[t + d, b, c]          (g = 0 past the end)
    dw[c, j]    = sum_{b, t} g[t, b, c] x[t - (K-1) + j, b, c]
A backward program (one warp, BC = 128 channels of one sample) walks a chunk of T time steps in order,
a sliding window: at step u it takes row u of x and of dy (each loaded once, U rows at a time, the next
U rows already in flight), computes pre[u] from x[u-K+1 .. u] (the K-1 older rows kept in registers),
g[u], and then dx[u-K+1], whose K g values g[u-K+1 .. u] are all in the window now. So every element of
pre and g is computed once, every x and dy row is read once (plus K-1 halo rows at each end of the
chunk, L2 hits), and dx is written once. It walks K-1 steps past its chunk to finish the chunk's last
dx rows, and sums dw over its own steps in registers; its [K, BC] partial sums go to its own slot of an
fp32 buffer that the caller sums afterwards: deterministic, no atomics. T is set per call (about
BWD_PROGRAMS_PER_SM programs per SM, T + K - 1 a multiple of U).
"""

from types import MappingProxyType

import torch
import triton
import triton.language as tl

from kimi_kernels.device import sm_count

# Forward tiles (time steps, channels, warps): channel tiles of 128 keep rows at 256 contiguous bytes in
# bf16. Time tiles are short because the compiler issues all K shifted loads of a tile at once.
FWD_CONFIG = MappingProxyType(dict(BT=16, BC=128, num_warps=4))  # launch tables: read-only
# Backward: one warp per program, 4 channels per thread (8-byte bf16 loads), U rows per load group.
# Offline sm_90 compiles (C a multiple of 16): 64 (fwd) / 178 (bwd) registers at K = 4, no spills up to
# K = 8, where U is halved (tests/kernels/test_short_conv_compile.py). At 178 registers 11 one-warp
# programs fit an SM, each with 2 x U rows of x and dy (4 KB) in flight at the top of a group.
BWD_CONFIG = MappingProxyType(dict(U=8, BC=128, num_warps=1))
BWD_SMALL_U_ABOVE_K = 4  # K > 4: U / 2 (the K-1 row windows need the registers)
# Chunk length T: about BWD_PROGRAMS_PER_SM programs per SM in all, at least BWD_MIN_GROUPS groups of U
# steps each so the halo rows (K-1 at each end) and the dw partial sums stay a small fraction of the bytes.
BWD_PROGRAMS_PER_SM = 16
BWD_MIN_GROUPS = 4


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
def _pick(part, p0, p1, p2):
    """Part ``part``'s pointer of three (a select, so the kernel body is compiled once)."""
    return tl.where(part == 0, p0, tl.where(part == 1, p1, p2))


@triton.jit
def _conv_fwd_tile(x, w, y, S, B, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2) % B
    c_ok = c < C
    pre = _shifted_pre(x, w, t, b, c, c_ok, S, B, C, K, 0, BT, BC)
    out = pre * tl.sigmoid(pre)
    dst = (b * S + t.to(tl.int64)) * C  # batch-first rows
    tl.store(y + dst[:, None] + c[None, :], out.to(y.dtype.element_ty), mask=(t < S)[:, None] & c_ok[None, :])


@triton.jit
def conv_fwd_kernel(x0, x1, x2, w0, w1, w2, y0, y1, y2, S, B, C, K: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    """Up to three convolutions of one shape in one launch (a KDA layer's q, k, v): grid axis 2 is part x
    sample; a part's tensors are its own arguments, picked by the program's part (no table to load)."""
    part = tl.program_id(2) // B
    _conv_fwd_tile(_pick(part, x0, x1, x2), _pick(part, w0, w1, w2), _pick(part, y0, y1, y2), S, B, C, K, BT, BC)


@triton.jit
def _load_rows(x, dy, u0, limit, b, c, c_ok, S, B, C, U: tl.constexpr):
    """Rows u0 .. u0+U-1 of x ([s, b, C]) and dy ([b, s, C]) in their storage dtype, zero from `limit` on."""
    xs = ()
    dys = ()
    for i in tl.static_range(U):
        u = tl.cast(u0 + i, tl.int64)
        ok = c_ok & (u < limit)
        xs = xs + (tl.load(x + (u * B + b) * C + c, mask=ok, other=0.0),)
        dys = dys + (tl.load(dy + (b * S + u) * C + c, mask=ok, other=0.0),)
    return xs, dys


@triton.jit
def _conv_bwd_chunk(x, w, dy, dx, dw_part, S, B, C, T, K: tl.constexpr, U: tl.constexpr, BC: tl.constexpr):
    """One program: channels c of sample b over the chunk [t0, t0 + T). Steps u = t0 .. t0 + T + K - 2 in
    order, each loading rows u of x and dy once (loaded a group of U rows ahead): pre[u] from the window
    x[u-K+1 .. u] (the older K-1 rows kept in registers), g[u], then dx[u-K+1], whose K future g values
    g[u-K+1 .. u] are now all in the window. dw sums g[u] x[u-K+1+j] over the chunk's own steps; the K-1 steps
    past the chunk only complete its last dx rows."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2) % B
    c_ok = c < C
    t0 = pid_t * T
    t_end = tl.minimum(t0 + T, S)  # rows of dx (and steps of dw) this program owns
    limit = tl.minimum(t_end + K - 1, S)  # rows it reads; dy = 0 past the sequence makes g = 0 there
    ws = ()
    for j in tl.static_range(K):
        ws = ws + (tl.load(w + c * K + j, mask=c_ok, other=0.0).to(tl.float32),)
    # Window: x[u-K+1 .. u-1] and g[u-K+1 .. u-1] before step u (oldest first); g before t0 only feeds dx
    # rows of the previous chunk, which this program does not store, so it starts at zero.
    xwin = ()
    gwin = ()
    for j in tl.static_range(K - 1):
        src = (t0 - (K - 1) + j).to(tl.int64)
        xv = tl.load(x + (src * B + b) * C + c, mask=c_ok & (src >= 0), other=0.0)
        xwin = xwin + (xv.to(tl.float32),)
        gwin = gwin + (tl.zeros([BC], dtype=tl.float32),)
    dws = ()
    for j in tl.static_range(K):
        dws = dws + (tl.zeros([BC], dtype=tl.float32),)
    xs, dys = _load_rows(x, dy, t0, limit, b, c, c_ok, S, B, C, U)
    for u0 in range(t0, t_end + K - 1, U):
        next_xs, next_dys = _load_rows(x, dy, u0 + U, limit, b, c, c_ok, S, B, C, U)  # in flight meanwhile
        for i in tl.static_range(U):
            u = u0 + i
            xu = xs[i].to(tl.float32)
            pre = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(K - 1):
                pre += xwin[j] * ws[j]
            pre += xu * ws[K - 1]
            sig = tl.sigmoid(pre)
            g = dys[i].to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))  # silu'(p) = s (1 + p (1 - s))
            # dx[r] = sum_d w[K-1-d] g[r+d] for r = u-K+1: g[r .. u-1] from the window, g[u] just computed.
            dx_r = tl.zeros([BC], dtype=tl.float32)
            for d in tl.static_range(K - 1):
                dx_r += gwin[d] * ws[K - 1 - d]
            dx_r += g * ws[0]
            r = tl.cast(u - (K - 1), tl.int64)
            tl.store(dx + (r * B + b) * C + c, dx_r.to(dx.dtype.element_ty), mask=c_ok & (r >= t0) & (r < t_end))
            # dw[j] += g[u] x[u-K+1+j] for the chunk's own steps.
            g_own = tl.where(u < t_end, g, 0.0)
            new_dws = ()
            for j in tl.static_range(K - 1):
                new_dws = new_dws + (dws[j] + g_own * xwin[j],)
            dws = new_dws + (dws[K - 1] + g_own * xu,)
            # Slide the window by one step.
            new_xwin = ()
            new_gwin = ()
            for j in tl.static_range(1, K - 1):
                new_xwin = new_xwin + (xwin[j],)
                new_gwin = new_gwin + (gwin[j],)
            if K > 1:
                xwin = new_xwin + (xu,)
                gwin = new_gwin + (g,)
        xs, dys = next_xs, next_dys
    slot = dw_part + ((pid_t * B + b) * C).to(tl.int64) * K  # [C, K]: the weight's layout
    for j in tl.static_range(K):
        tl.store(slot + c * K + j, dws[j], mask=c_ok)


@triton.jit
def conv_bwd_kernel(x0, x1, x2, w0, w1, w2, dy0, dy1, dy2, dx0, dx1, dx2, dw_part, S, B, C, T,
                    K: tl.constexpr, U: tl.constexpr, BC: tl.constexpr):
    """conv_fwd_kernel's parts in one launch; part p's dweight slots start at p * (time chunks * B) slots."""
    part = tl.program_id(2) // B
    slots = (tl.num_programs(0) * B * C).to(tl.int64) * K
    _conv_bwd_chunk(_pick(part, x0, x1, x2), _pick(part, w0, w1, w2), _pick(part, dy0, dy1, dy2),
                    _pick(part, dx0, dx1, dx2), dw_part + part * slots, S, B, C, T, K, U, BC)


MAX_PARTS = 3  # convolutions one launch takes (conv_fwd_kernel's pointer arguments)


def _three(tensors):
    """A part's tensors padded to the kernels' three pointer slots (the unused ones are never read)."""
    return list(tensors) + [tensors[0]] * (MAX_PARTS - len(tensors))


def conv_fwd(xs, weights) -> list:
    """Per part ``x [s, b, C]`` contiguous, ``weight [C, K]`` contiguous (all parts one shape) -> ``y [b, s, C]``
    in x's dtype, in one launch."""
    seq, batch, channels = xs[0].shape
    ys = [x.new_empty(batch, seq, channels) for x in xs]
    cfg = FWD_CONFIG
    grid = (triton.cdiv(seq, cfg["BT"]), triton.cdiv(channels, cfg["BC"]), batch * len(xs))
    conv_fwd_kernel[grid](*_three(xs), *_three(weights), *_three(ys), seq, batch, channels,
                          K=weights[0].shape[1], **cfg)
    return ys


def bwd_config(kernel_size: int) -> dict:
    """BWD_CONFIG for kernel size K (U halved above BWD_SMALL_U_ABOVE_K)."""
    cfg = dict(BWD_CONFIG)
    if kernel_size > BWD_SMALL_U_ABOVE_K:
        cfg["U"] = max(1, cfg["U"] // 2)
    return cfg


def _sm_count(device: torch.device) -> int:
    return sm_count(device) if device.type == "cuda" else 132


def bwd_chunk(seq: int, batch: int, channels: int, kernel_size: int, device: torch.device) -> int:
    """Steps per backward program: about BWD_PROGRAMS_PER_SM programs per SM, at least BWD_MIN_GROUPS
    groups of U steps each, with T + K - 1 (the steps a program walks) a multiple of U."""
    cfg = bwd_config(kernel_size)
    unroll, programs_per_chunk = cfg["U"], batch * triton.cdiv(channels, cfg["BC"])
    chunks = max(1, triton.cdiv(BWD_PROGRAMS_PER_SM * _sm_count(device), programs_per_chunk))
    groups = max(BWD_MIN_GROUPS, triton.cdiv(triton.cdiv(seq, chunks) + kernel_size - 1, unroll))
    return groups * unroll - (kernel_size - 1)


def conv_bwd(dys, xs, weights, chunk: int | None = None):
    """Per part ``dy [b, s, C]`` contiguous -> ``dx [s, b, C]`` (x's dtype), ``dweight [C, K]`` (weight's dtype,
    summed in fp32), in one launch. ``chunk``: time steps per program, any T >= 1 (default :func:`bwd_chunk`)."""
    seq, batch, channels = xs[0].shape
    kernel_size = weights[0].shape[1]
    cfg = bwd_config(kernel_size)
    if chunk is None:
        chunk = bwd_chunk(seq, batch * len(xs), channels, kernel_size, xs[0].device)
    grid = (triton.cdiv(seq, chunk), triton.cdiv(channels, cfg["BC"]), batch * len(xs))
    dxs = [torch.empty_like(x) for x in xs]
    # One [C, K] slot per (part, time chunk, sample); every slot is fully written (all channel tiles).
    dw_part = torch.empty(len(xs), grid[0] * batch, channels, kernel_size, device=xs[0].device, dtype=torch.float32)
    conv_bwd_kernel[grid](*_three(xs), *_three(weights), *_three(dys), *_three(dxs), dw_part, seq, batch, channels,
                          chunk, K=kernel_size, **cfg)
    dweights = dw_part.sum(1)  # [parts, C, K] fp32, one reduction for all parts
    if all(w.dtype == weights[0].dtype for w in weights):
        dweights = dweights.to(weights[0].dtype)  # one cast (none for fp32 weights)
        return dxs, list(dweights.unbind(0))
    return dxs, [dw.to(w.dtype) for dw, w in zip(dweights.unbind(0), weights)]
