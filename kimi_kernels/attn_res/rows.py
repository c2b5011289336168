"""Token-tile row helpers shared by the depth-attention kernels (``fused.py``'s forward, ``preload_bwd.py``'s
backward): a tile's offsets, its rows loaded as they are or, for 2-byte dtypes, as int32 pairs (``PACK``), and
the loaded rows as fp32.

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
