"""Row sums of several ``[BLOCK_T, BLOCK_H]`` operands at once: on the GPU one ``tl.reduce`` over the tuple
(one reduction tree and one set of barriers for the per-row dot products the depth-attention kernels need
together); under Triton's CPU interpreter one ``tl.sum`` each, the same sums, because the interpreter runs
a ``tl.reduce`` with a combine function element by element in Python (~100x slower: it made the kernels'
CPU tests minutes long). The compiled path is checked by the compile tests and the GPU tests.

``batch_row_sums``: several sources' products of one kind stacked into one tensor (``tl.join``: trailing axes of
size 2, held in the same threads), so that one row reduction sums them all: the kernels reduce up to B sources at
once (``sources_per_reduction`` of ``fused.FORWARD_LAUNCH`` and ``fused.BACKWARD_LAUNCH``) and wait on one cross-warp
exchange instead of B."""

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


@triton.jit
def stack_rows(xs, B: tl.constexpr):
    """The B (1, 2 or 4) same-shape tensors of the tuple ``xs`` as one, with log2(B) trailing axes of size 2."""
    if B == 1:
        return xs[0]
    elif B == 2:
        return tl.join(xs[0], xs[1])
    else:
        return tl.join(tl.join(xs[0], xs[1]), tl.join(xs[2], xs[3]))


@triton.jit
def unstack_sums(x, B: tl.constexpr):
    """The row sums of a ``stack_rows`` result back as a tuple of B tensors, in ``xs``'s order."""
    if B == 1:
        return (x,)
    elif B == 2:
        a, b = tl.split(x)
        return (a, b)
    else:
        low, high = tl.split(x)  # sums of join(xs[0], xs[1]) and of join(xs[2], xs[3])
        a, b = tl.split(low)
        c, d = tl.split(high)
        return (a, b, c, d)


@triton.jit
def _kind(rows, j: tl.constexpr, SIZE: tl.constexpr):
    """Product ``j`` of each of the SIZE sources' tuples in ``rows``."""
    kind = ()
    for k in tl.static_range(SIZE):
        kind = kind + (rows[k][j],)
    return kind


@triton.jit
def _separate_row_sums(rows, SIZE: tl.constexpr):
    """What ``_stacked_row_sums`` returns, from one ``tl.sum`` per source and product."""
    sums = ()
    for j in tl.static_range(len(rows[0])):
        kind = ()
        for k in tl.static_range(SIZE):
            kind = kind + (tl.sum(rows[k][j], 1),)
        sums = sums + (kind,)
    return sums


@triton.jit
def _stacked_row_sums(source_products, context, first: tl.constexpr, end: tl.constexpr, SIZE: tl.constexpr,
                      BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """``batch_row_sums`` for a batch of SIZE (1, 2 or 4) sources, padded past ``end``. Under the interpreter each
    source's sums separately: numpy adds a stacked tensor's rows in another order than a single row's, and the
    backward's logits must be the forward's to the bit whatever either batched (the stacking itself is checked by
    ``tests/kernels/test_attn_res_reductions.py``)."""
    rows = ()
    for k in tl.static_range(SIZE):
        if first + k < end:  # past the end: the source before again (its sums unused)
            products = source_products(context, first + k, BLOCK_H, PACK)
        rows = rows + (products,)
    if _INTERPRETED:
        return _separate_row_sums(rows, SIZE)
    elif len(rows[0]) == 2:
        a, b = row_sums2(stack_rows(_kind(rows, 0, SIZE), SIZE), stack_rows(_kind(rows, 1, SIZE), SIZE))
        return unstack_sums(a, SIZE), unstack_sums(b, SIZE)
    elif len(rows[0]) == 3:
        a, b, c = row_sums3(stack_rows(_kind(rows, 0, SIZE), SIZE), stack_rows(_kind(rows, 1, SIZE), SIZE),
                            stack_rows(_kind(rows, 2, SIZE), SIZE))
        return unstack_sums(a, SIZE), unstack_sums(b, SIZE), unstack_sums(c, SIZE)
    else:
        a, b, c, d, e = row_sums5(stack_rows(_kind(rows, 0, SIZE), SIZE), stack_rows(_kind(rows, 1, SIZE), SIZE),
                                  stack_rows(_kind(rows, 2, SIZE), SIZE), stack_rows(_kind(rows, 3, SIZE), SIZE),
                                  stack_rows(_kind(rows, 4, SIZE), SIZE))
        return unstack_sums(a, SIZE), unstack_sums(b, SIZE), unstack_sums(c, SIZE), unstack_sums(d, SIZE), \
            unstack_sums(e, SIZE)


@triton.jit
def batch_row_sums(source_products, context, first: tl.constexpr, end: tl.constexpr, B: tl.constexpr,
                   BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """The row sums of sources ``first``, ``first + 1``, ... (at most B (1, 2 or 4) of them, before ``end``) in one
    reduction: ``source_products(context, i, BLOCK_H, PACK)`` gives source i's 2, 3 or 5 ``[BLOCK_T, BLOCK_H]``
    products (``context``: a tuple of its tensors; constexprs in a tuple would not stay constexprs); returns
    one tuple per product of the batch's row sums (``[BLOCK_T]`` each, index 0 = source ``first``). The last batch
    of a call takes what is left (1 or 2 sources; 3 are padded to 4)."""
    if end - first >= B:
        return _stacked_row_sums(source_products, context, first, end, B, BLOCK_H, PACK)
    elif end - first == 3:
        return _stacked_row_sums(source_products, context, first, end, 4, BLOCK_H, PACK)
    else:
        return _stacked_row_sums(source_products, context, first, end, end - first, BLOCK_H, PACK)
