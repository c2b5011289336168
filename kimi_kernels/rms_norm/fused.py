"""Triton RMSNorm over the last dim, forward and backward, optionally times ``sigmoid(gate)``.

A program owns BLOCK_ROWS whole rows (a row of up to 16384 columns is one tile, so the mean of squares is
one in-register reduction). Forward reads x (and the gate), writes y in x's dtype and the fp32 per-row
``rstd = rsqrt(mean(x^2) + eps)``; with ``xhat = x * rstd``, ``n = xhat * w`` and ``s = sigmoid(gate)``
(``s = 1`` without a gate):

    y = n * s
    dgate = dy * n * s * (1 - s)
    dn = dy * s;  dw = sum_rows dn * xhat;  dx = rstd * (dn * w - xhat * mean(dn * w * xhat))

x may be a view whose two leading (token) dims have any strides while the rows of one token lie together (the
KDA layer's batch-first output read sequence-first): the kernels address its rows through those strides
(X_STRIDED) and write dx in x's layout; y, the gate, dy and dgate are contiguous.

Backward recomputes xhat from x and rstd (y is not saved). Its grid is a fixed number of programs that
stride over the row blocks, each summing its share of dw in an fp32 [BLOCK_ROWS, BLOCK_N] accumulator and
writing one fp32 row of a [programs, h] buffer that the caller sums: deterministic, no atomics.
"""

import math

import torch
import triton
import triton.language as tl

from kimi_kernels.device import sm_count
from kimi_kernels.layout import tokens_lie_apart

# Elements per program (BLOCK_ROWS x BLOCK_N: narrow rows are stacked, h = 128 -> 32 rows forward) and per
# thread (8: one 16-byte access per bf16 tensor). Backward keeps about 8 fp32 registers per element (x, dy,
# the dw accumulator, the weight, addresses), so its tile is half the forward's. Offline sm_90 compiles
# (tests/kernels/test_rms_norm_compile.py), registers at h = 2048 / 128: forward 40 / 40 (40 / 57 gated),
# backward 62 / 80 (64 / 94 gated), no spills. Wider rows: 32 warps from h = 8192; at h = 16384 the
# backward spills (76 bytes, 316 gated), still one pass.
FWD_TILE, BWD_TILE = 4096, 2048
ELEMS_PER_THREAD = 8
MAX_WARPS = 32
PROGRAMS_PER_SM = 4
CPU_PROGRAMS = 3  # backward programs off CUDA (the interpreter): several, each striding over row blocks


def launch_config(hidden: int, backward: bool = False, x_strided: bool = False) -> dict:
    """BLOCK_N (hidden padded to a power of two), BLOCK_ROWS and num_warps for rows of ``hidden``. The backward
    of a token-strided x holds x's own addresses besides dy's: half the elements per thread (at h = 128, gated:
    64 registers and no spills where 8 elements per thread take 128 and spill)."""
    block_n = triton.next_power_of_2(hidden)
    block_rows = max(1, (BWD_TILE if backward else FWD_TILE) // block_n)
    per_thread = ELEMS_PER_THREAD // 2 if backward and x_strided else ELEMS_PER_THREAD
    num_warps = min(MAX_WARPS, max(1, block_rows * block_n // (32 * per_thread)))
    return dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=num_warps)


@triton.jit
def x_row_offsets(rows, N, d1, rows_per_token, s0, s1, X_STRIDED: tl.constexpr):
    """Element offset of each row of x: rows * N when x is contiguous, else through the strides s0, s1 of its
    two leading dims (d1 = the second one's size), the rows_per_token rows of a token lying together."""
    rows = rows.to(tl.int64)
    if X_STRIDED:
        token = rows // rows_per_token
        return (token // d1) * s0 + (token % d1) * s1 + (rows % rows_per_token) * N
    else:
        return rows * N


@triton.jit
def rms_norm_fwd_kernel(x, weight, gate, y, rstd, M, N, eps, x_d1, x_rows_per_token, x_s0, x_s1,
                        HAS_GATE: tl.constexpr, X_STRIDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x_offs = x_row_offsets(rows, N, x_d1, x_rows_per_token, x_s0, x_s1, X_STRIDED)[:, None] + cols[None, :]
    xv = tl.load(x + x_offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xv * xv, 1) / N + eps)
    w = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = xv * r[:, None] * w[None, :]
    if HAS_GATE:
        g = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
        out = out * tl.sigmoid(g)
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(x, weight, gate, dy, rstd, dx, dgate, dw_part, M, N, x_d1, x_rows_per_token, x_s0, x_s1,
                        HAS_GATE: tl.constexpr, X_STRIDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_ROWS), tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x_offs = x_row_offsets(rows, N, x_d1, x_rows_per_token, x_s0, x_s1, X_STRIDED)[:, None] + cols[None, :]
        r = tl.load(rstd + rows, mask=row_ok, other=0.0)  # masked rows: xhat = 0, no contribution
        xhat = tl.load(x + x_offs, mask=mask, other=0.0).to(tl.float32) * r[:, None]
        dn = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            s = tl.sigmoid(tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32))
            dg = dn * (xhat * w[None, :]) * s * (1.0 - s)
            tl.store(dgate + offs, dg.to(dgate.dtype.element_ty), mask=mask)
            dn = dn * s
        dw_acc += dn * xhat
        dxhat = dn * w[None, :]
        c = tl.sum(dxhat * xhat, 1) / N
        dxv = (dxhat - xhat * c[:, None]) * r[:, None]
        tl.store(dx + x_offs, dxv.to(dx.dtype.element_ty), mask=mask)
    tl.store(dw_part + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, 0), mask=col_ok)


def backward_programs(num_blocks: int, num_warps: int, device: torch.device) -> int:
    """About one wave of backward programs: PROGRAMS_PER_SM per SM (what the registers of the h = 2048 / 128
    configs allow at once), fewer when threads are the limit (2048 per SM). Each writes one fp32 row of dw
    partials: at [8192, 2048] on 132 SMs, 4 MiB written and read again against 96 MiB of x, dy and dx."""
    if device.type == "cuda":
        sms = sm_count(device)
        per_sm = max(1, min(PROGRAMS_PER_SM, 2048 // (32 * num_warps)))
        return max(1, min(num_blocks, sms * per_sm))
    return max(1, min(num_blocks, CPU_PROGRAMS))


def token_layout(x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``x [..., h]`` as the kernels read it and their X_* arguments: contiguous as it is; a view whose two
    leading dims have any strides but whose dims from the third on are contiguous (the rows of one token lie
    together) through those strides, without a copy; anything else copied to contiguous."""
    if x.is_contiguous() or not tokens_lie_apart(x):
        return x.contiguous(), dict(x_d1=1, x_rows_per_token=1, x_s0=0, x_s1=0, X_STRIDED=False)
    return x, dict(x_d1=x.shape[1], x_rows_per_token=math.prod(x.shape[2:-1]), x_s0=x.stride(0), x_s1=x.stride(1),
                   X_STRIDED=True)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float):
    """``x [..., h]`` (addressed as :func:`token_layout` returns it), ``gate`` x's shape, contiguous, or None,
    ``weight [h]`` -> ``y`` (x's shape, contiguous, x's dtype), ``rstd [M]`` fp32 (M = rows), and x as the kernel
    read it with its layout arguments (what the backward takes)."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    x, layout = token_layout(x)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows:
        cfg = launch_config(hidden)
        rms_norm_fwd_kernel[(triton.cdiv(rows, cfg["BLOCK_ROWS"]),)](
            x, weight, gate if gate is not None else y, y, rstd, rows, hidden, float(eps), **layout,
            HAS_GATE=gate is not None, **cfg)
    return y, rstd, x, layout


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, layout: dict, weight: torch.Tensor,
                 gate: torch.Tensor | None, rstd: torch.Tensor):
    """``dy`` (x's shape) contiguous, ``x`` and ``layout`` as the forward read it -> ``dx`` (x's dtype, in x's
    layout when the kernels read x through its strides), ``dweight`` (weight's dtype, fp32 sums), ``dgate``
    (gate's dtype, or None)."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    dx = torch.empty_strided(x.shape, x.stride(), device=x.device, dtype=x.dtype)
    dgate = torch.empty_like(gate) if gate is not None else None
    if not rows:
        return dx, torch.zeros_like(weight), dgate
    cfg = launch_config(hidden, backward=True, x_strided=layout["X_STRIDED"])
    programs = backward_programs(triton.cdiv(rows, cfg["BLOCK_ROWS"]), cfg["num_warps"], x.device)
    dw_part = torch.empty(programs, hidden, device=x.device, dtype=torch.float32)  # every row written
    rms_norm_bwd_kernel[(programs,)](
        x, weight, gate if gate is not None else dy, dy, rstd, dx, dgate if dgate is not None else dx, dw_part,
        rows, hidden, **layout, HAS_GATE=gate is not None, **cfg)
    return dx, dw_part.sum(0).to(weight.dtype), dgate
