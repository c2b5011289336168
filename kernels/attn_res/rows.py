"""Token-tile row helpers shared by the depth-attention kernels (``fused.py``'s forward, ``preload_bwd.py``'s
backward): a tile's offsets, its rows loaded as they are or, for 2-byte dtypes, as int32 pairs (``PACK``), and
the loaded rows as fp32, and an L2 prefetch of a tile's rows.

Why pairs: ptxas kept loop-carried and long-lived bf16 values one per 32-bit register (each 16-bit value its own
register) and spilled them in the preload backward; an int32 pair is one register for two values, unpacked (bf16
by shifts, fp16 by bitcasts, both exact) where it is used. Needs h even and every packed tensor 4-byte aligned
(``fused._packable``).
"""

import triton
import triton.language as tl


@triton.jit
def _tile_offsets(tile, T, H, cols, col_mask, BLOCK_T: tl.constexpr):
    """(rows, row mask, element mask, element offsets) of token tile ``tile`` (all masked off past T)."""
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    mask = row_mask[:, None] & col_mask[None, :]
    return rows, row_mask, mask, rows.to(tl.int64)[:, None] * H + cols[None, :]


@triton.jit
def _load_rows(ptr, tile_at, H, BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """A token tile's rows (``tile_at``, from ``_tile_offsets``) of the ``[T, H]`` tensor at ``ptr`` as loaded;
    with ``PACK`` (H even, 2-byte dtypes, 4-byte aligned) as int32 pairs, ``[BLOCK_T, BLOCK_H / 2]``: one
    register per pair (ptxas kept loop-carried and long-lived bf16 values one per 16-bit register and spilled
    them). ``_rows_f32`` unpacks."""
    rows, row_mask, mask, offs = tile_at
    if PACK and ptr.dtype.element_ty.primitive_bitwidth == 16:
        cols = tl.arange(0, BLOCK_H // 2)
        offs = rows.to(tl.int64)[:, None] * (H // 2) + cols[None, :]
        mask = row_mask[:, None] & (cols < H // 2)[None, :]
        return tl.load(ptr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _rows_f32(x, ptr, BLOCK_H: tl.constexpr, PACK: tl.constexpr):
    """``_load_rows(ptr, ...)`` as fp32 ``[BLOCK_T, BLOCK_H]`` (pairs: element 2k in the low half)."""
    if PACK and ptr.dtype.element_ty.primitive_bitwidth == 16:
        if ptr.dtype.element_ty == tl.bfloat16:
            low = (x << 16).to(tl.float32, bitcast=True)
            high = (x & -65536).to(tl.float32, bitcast=True)
        else:
            low = x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            high = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.reshape(tl.join(low, high), [x.shape[0], BLOCK_H])
    else:
        return x.to(tl.float32)


@triton.jit
def _prefetch_rows_l2(ptr, tile, T, H, BLOCK_T: tl.constexpr):
    """Asks L2 for token tile ``tile``'s rows of the ``[T, H]`` tensor at ``ptr`` (nothing past T): one bulk
    prefetch (``cp.async.bulk.prefetch.L2``, sm_90) issued by the program's first thread, no registers held, so a
    later load of those rows waits for L2 instead of HBM. Needs ``ptr`` 16-byte aligned and ``H`` times the
    element size a multiple of 16 (``fused._bulk_prefetchable``); compiled GPUs only (no interpreter)."""
    first = tile * BLOCK_T
    if first < T:
        nbytes = tl.minimum(T - first, BLOCK_T) * H * (ptr.dtype.element_ty.primitive_bitwidth // 8)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + first.to(tl.int64) * H, nbytes], dtype=tl.int32, is_pure=False, pack=1)
