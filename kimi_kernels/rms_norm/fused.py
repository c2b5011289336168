"""Triton RMSNorm over the last dim, forward and backward, optionally times ``sigmoid(gate)``.

A program owns BLOCK_ROWS whole rows (a row of up to 16384 columns is one tile, so the mean of squares is
one in-register reduction). Forward reads x (and the gate), writes y in x's dtype and the fp32 per-row
``rstd = rsqrt(mean(x^2) + eps)``; with ``xhat = x * rstd``, ``n = xhat * w`` and ``s = sigmoid(gate)``
(``s = 1`` without a gate):

    y = n * s
    dgate = dy * n * s * (1 - s)
    dn = dy * s;  dw = sum_rows dn * xhat;  dx = rstd * (dn * w - xhat * mean(dn * w * xhat))

Backward recomputes xhat from x and rstd (y is not saved). Its grid is a fixed number of programs that
stride over the row blocks, each summing its share of dw in an fp32 [BLOCK_ROWS, BLOCK_N] accumulator and
writing one fp32 row of a [programs, h] buffer that the caller sums: deterministic, no atomics.
"""

import torch
import triton
import triton.language as tl

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


def launch_config(hidden: int, backward: bool = False) -> dict:
    """BLOCK_N (hidden padded to a power of two), BLOCK_ROWS and num_warps for rows of ``hidden``."""
    block_n = triton.next_power_of_2(hidden)
    block_rows = max(1, (BWD_TILE if backward else FWD_TILE) // block_n)
    num_warps = min(MAX_WARPS, max(1, block_rows * block_n // (32 * ELEMS_PER_THREAD)))
    return dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=num_warps)


@triton.jit
def rms_norm_fwd_kernel(x, weight, gate, y, rstd, M, N, eps, HAS_GATE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xv * xv, 1) / N + eps)
    w = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = xv * r[:, None] * w[None, :]
    if HAS_GATE:
        g = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
        out = out * tl.sigmoid(g)
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(x, weight, gate, dy, rstd, dx, dgate, dw_part, M, N, HAS_GATE: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
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
        r = tl.load(rstd + rows, mask=row_ok, other=0.0)  # masked rows: xhat = 0, no contribution
        xhat = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) * r[:, None]
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
        tl.store(dx + offs, dxv.to(dx.dtype.element_ty), mask=mask)
    tl.store(dw_part + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, 0), mask=col_ok)


def backward_programs(num_blocks: int, num_warps: int, device: torch.device) -> int:
    """About one wave of backward programs: PROGRAMS_PER_SM per SM (what the registers of the h = 2048 / 128
    configs allow at once), fewer when threads are the limit (2048 per SM). Each writes one fp32 row of dw
    partials: at [8192, 2048] on 132 SMs, 4 MiB written and read again against 96 MiB of x, dy and dx."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        per_sm = max(1, min(PROGRAMS_PER_SM, 2048 // (32 * num_warps)))
        return max(1, min(num_blocks, sms * per_sm))
    return max(1, min(num_blocks, CPU_PROGRAMS))


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, eps: float):
    """``x [M, h]``, ``gate [M, h]`` or None (contiguous), ``weight [h]`` -> ``y [M, h]`` (x's dtype),
    ``rstd [M]`` fp32."""
    rows, hidden = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows:
        cfg = launch_config(hidden)
        rms_norm_fwd_kernel[(triton.cdiv(rows, cfg["BLOCK_ROWS"]),)](
            x, weight, gate if gate is not None else x, y, rstd, rows, hidden, float(eps),
            HAS_GATE=gate is not None, **cfg)
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None,
                 rstd: torch.Tensor):
    """``dy [M, h]`` contiguous -> ``dx`` (x's dtype), ``dweight`` (weight's dtype, fp32 sums), ``dgate``
    (gate's dtype, or None)."""
    rows, hidden = x.shape
    dx = torch.empty_like(x)
    dgate = torch.empty_like(gate) if gate is not None else None
    if not rows:
        return dx, torch.zeros_like(weight), dgate
    cfg = launch_config(hidden, backward=True)
    programs = backward_programs(triton.cdiv(rows, cfg["BLOCK_ROWS"]), cfg["num_warps"], x.device)
    dw_part = torch.empty(programs, hidden, device=x.device, dtype=torch.float32)  # every row written
    rms_norm_bwd_kernel[(programs,)](
        x, weight, gate if gate is not None else x, dy, rstd, dx, dgate if dgate is not None else dx, dw_part,
        rows, hidden, HAS_GATE=gate is not None, **cfg)
    return dx, dw_part.sum(0).to(weight.dtype), dgate
