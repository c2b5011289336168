"""Triton SwiGLU over the last dim, forward and backward: ``h [M, 2f] -> silu(a) * b``, ``[a, b] = h``.

The eager path is five elementwise kernels and a concatenation: silu, mul, and in backward mul's two
grads, silu's backward and ``aten::cat`` gluing the halves' grads into ``dh`` (~6 ms a training step on
the H200 at 8 MoE layers of M = 65536, f = 1024). Here forward reads each row's a and b halves once and
writes the output; backward reads h and dout once and writes ``dh`` whole. With ``s = sigmoid(a)``:

    out = a * s * b
    da = dout * b * s * (1 + a * (1 - s))
    db = dout * a * s

All in fp32, stored in h's dtype. The output is not saved: backward recomputes s from h.

A program owns a BLOCK_ROWS x BLOCK_F tile of output columns (a 2-D grid over row blocks and column
blocks, so any f fits); offsets are int64 (M * 2f passes 2^31 at the model's sizes). Each thread holds
8 contiguous elements per tensor: one 16-byte access in bf16 when f is a multiple of 16 (and the tensors
16-byte aligned), as the launcher specializes it.
"""

import torch
import triton
import triton.language as tl

# Output elements per program (BLOCK_ROWS x BLOCK_F: f = 1024 -> 4 rows forward, 2 backward) and per thread
# (8: one 16-byte access per bf16 tensor half). Backward reads three tensors and writes two, so its tile is
# half the forward's. Offline sm_90 compiles (tests/kernels/test_swiglu_compile.py), registers at f = 1024
# and 96 with 16-byte access: forward 31, backward 32 (without alignment, one access per element: at most 38
# and 47); no spills.
FWD_TILE, BWD_TILE = 4096, 2048
MAX_BLOCK_F = 1024
ELEMS_PER_THREAD = 8


def launch_config(f: int, backward: bool = False) -> dict:
    """BLOCK_ROWS, BLOCK_F (f padded to a power of two, at most MAX_BLOCK_F) and num_warps for ``f`` output
    columns."""
    block_f = min(MAX_BLOCK_F, triton.next_power_of_2(f))
    block_rows = max(1, (BWD_TILE if backward else FWD_TILE) // block_f)
    num_warps = max(1, block_rows * block_f // (32 * ELEMS_PER_THREAD))
    return dict(BLOCK_ROWS=block_rows, BLOCK_F=block_f, num_warps=num_warps)


@triton.jit
def _tile(M, F, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's offsets into h's a half (rows of 2F) and into out (rows of F), and the mask."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    rows = rows.to(tl.int64)
    return rows[:, None] * (2 * F) + cols[None, :], rows[:, None] * F + cols[None, :], mask


@triton.jit
def swiglu_fwd_kernel(h, out, M, F, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    h_offs, o_offs, mask = _tile(M, F, BLOCK_ROWS, BLOCK_F)
    a = tl.load(h + h_offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h + h_offs + F, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(out + o_offs, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(h, dout, dh, M, F, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    h_offs, o_offs, mask = _tile(M, F, BLOCK_ROWS, BLOCK_F)
    a = tl.load(h + h_offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h + h_offs + F, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dout + o_offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    gs = g * s
    da = gs * b * (1.0 + a * (1.0 - s))
    db = gs * a
    tl.store(dh + h_offs, da.to(dh.dtype.element_ty), mask=mask)
    tl.store(dh + h_offs + F, db.to(dh.dtype.element_ty), mask=mask)


def _grid(rows: int, f: int, cfg: dict):
    return (triton.cdiv(rows, cfg["BLOCK_ROWS"]), triton.cdiv(f, cfg["BLOCK_F"]))


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    """``h [M, 2f]`` contiguous -> ``out [M, f]`` in h's dtype."""
    rows, f = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, f, device=h.device, dtype=h.dtype)
    if rows:
        cfg = launch_config(f)
        swiglu_fwd_kernel[_grid(rows, f, cfg)](h, out, rows, f, **cfg)
    return out


def swiglu_bwd(dout: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dout [M, f]``, ``h [M, 2f]`` contiguous -> ``dh [M, 2f]`` in h's dtype."""
    rows, f = dout.shape
    dh = torch.empty_like(h)
    if rows:
        cfg = launch_config(f, backward=True)
        swiglu_bwd_kernel[_grid(rows, f, cfg)](h, dout, dh, rows, f, **cfg)
    return dh
