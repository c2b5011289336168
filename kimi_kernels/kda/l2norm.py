"""L2 normalisation of q and k per (token, head) row, as F.normalize(x.float(), dim=-1, eps=1e-6).

The forward's inverse norms come from gate_cumsum_kernel (gate.py), per (token, head) in fp32: the kernels
that read q and k, forward and backward, scale by them (docs/kda.md), so no normalised copy is ever written. The backward
is one kernel per tensor that recomputes the norm from x in fp32 and writes dx in x's dtype, so neither the
normalised copies nor fp32 gradients go through PyTorch ops. The backward runs at HBM bandwidth (docs/kda.md,
memory-bound passes): 32 rows per 4-warp program, all of its 16-byte loads issued before the first use.
"""

import triton
import triton.language as tl

EPS = 1e-6


@triton.jit
def l2_inverse_norms(x, eps):
    """1 / max(|x|, eps) per row of an fp32 tile: the factor that L2-normalises the row."""
    return 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), eps)


@triton.jit
def l2norm_bwd_kernel(x, dxn, dx, rows, eps, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """dx = (dxn - xn (xn . dxn)) / |x| where |x| > eps, else dxn / eps (the clamp is a constant)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BK)
    mask = (r < rows)[:, None] & (d < K)[None, :]
    offs = r[:, None] * K + d[None, :]
    xr = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dxn + offs, mask=mask, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(xr * xr, 1))
    inv = 1.0 / tl.maximum(norm, eps)
    xn = xr * inv[:, None]
    proj = tl.where((norm > eps)[:, None], xn * tl.sum(xn * g, 1)[:, None], 0.0)
    tl.store(dx + offs, ((g - proj) * inv[:, None]).to(dx.dtype.element_ty), mask=mask)
