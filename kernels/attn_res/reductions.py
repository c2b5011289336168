"""Combine functions for ``tl.reduce`` over several operands at once: one reduction tree (and one set of
barriers) for the per-row dot products the depth-attention kernels need together."""

import triton


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add_triple(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _add_five(a0, b0, c0, d0, e0, a1, b1, c1, d1, e1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1, e0 + e1
