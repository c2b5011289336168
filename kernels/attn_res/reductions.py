"""Row sums of several ``[BLOCK_T, BLOCK_H]`` operands at once: on the GPU one ``tl.reduce`` over the tuple
(one reduction tree and one set of barriers for the per-row dot products the depth-attention kernels need
together); under Triton's CPU interpreter one ``tl.sum`` each, the same sums, because the interpreter runs
a ``tl.reduce`` with a combine function element by element in Python (~100x slower: it made the kernels'
CPU tests minutes long). The compiled path is checked by the compile tests and the GPU tests."""

import os

import triton
import triton.language as tl

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add_triple(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _add_four(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _add_five(a0, b0, c0, d0, e0, a1, b1, c1, d1, e1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1, e0 + e1


@triton.jit
def row_sums2(a, b):
    if _INTERPRETED:
        sa, sb = tl.sum(a, 1), tl.sum(b, 1)
    else:
        sa, sb = tl.reduce((a, b), 1, _add_pair)
    return sa, sb


@triton.jit
def row_sums3(a, b, c):
    if _INTERPRETED:
        sa, sb, sc = tl.sum(a, 1), tl.sum(b, 1), tl.sum(c, 1)
    else:
        sa, sb, sc = tl.reduce((a, b, c), 1, _add_triple)
    return sa, sb, sc


@triton.jit
def row_sums4(a, b, c, d):
    if _INTERPRETED:
        sa, sb, sc, sd = tl.sum(a, 1), tl.sum(b, 1), tl.sum(c, 1), tl.sum(d, 1)
    else:
        sa, sb, sc, sd = tl.reduce((a, b, c, d), 1, _add_four)
    return sa, sb, sc, sd


@triton.jit
def row_sums5(a, b, c, d, e):
    if _INTERPRETED:
        sa, sb, sc, sd, se = tl.sum(a, 1), tl.sum(b, 1), tl.sum(c, 1), tl.sum(d, 1), tl.sum(e, 1)
    else:
        sa, sb, sc, sd, se = tl.reduce((a, b, c, d, e), 1, _add_five)
    return sa, sb, sc, sd, se
