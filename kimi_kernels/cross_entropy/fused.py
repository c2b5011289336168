"""Triton LM cross-entropy over a (shard of the) vocab: one read of the logits forward, one read and one
write backward.

A program owns one row (token) and loops over its vocab in BLOCK_V tiles. Forward keeps an online max ``m``
and ``s = sum(exp(x - m))`` in fp32 (``s`` is rescaled by ``exp(m_old - m_new)`` when a tile raises the
max) and loads the target logit directly when the target falls in this shard; it writes the three fp32
per-row partials and nothing of the logits' size. The caller combines the partials over the
tensor-parallel ranks into ``lse`` and the loss. Backward reads each logit once more and writes

    dlogits = (exp(x - lse) - [col == target]) * dloss          in the logits' dtype

into a buffer the size of the logits (it may be the logits themselves: each element is read before its
program writes it, and no other program touches that row). Offsets are int64 (8192 x 32768 rows alone
are 2^28 elements; a few more and int32 wraps).
"""

import torch
import triton
import triton.language as tl

# 4096 columns per tile: 16 per thread at 8 warps (two 16-byte bf16 loads), ~8 tiles for V = 32768.
MAX_BLOCK_V = 4096
ELEMS_PER_THREAD = 16
MAX_WARPS = 8


def launch_config(vocab: int) -> dict:
    """BLOCK_V (the vocab padded to a power of two, at most MAX_BLOCK_V) and num_warps."""
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(vocab))
    num_warps = min(MAX_WARPS, max(1, block_v // (32 * ELEMS_PER_THREAD)))
    return dict(BLOCK_V=block_v, num_warps=num_warps)


@triton.jit
def ce_fwd_kernel(logits, target, row_max, sum_exp, target_logit, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * V
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        ok = start + cols < V
        x = tl.load(base + start + cols, mask=ok, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))  # finite after the first tile (it has >= 1 column)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    t = tl.load(target + row).to(tl.int64) - vocab_start
    owned = (t >= 0) & (t < V)
    x_t = tl.load(base + tl.where(owned, t, 0), mask=owned, other=0.0).to(tl.float32)
    tl.store(row_max + row, m)
    tl.store(sum_exp + row, s)
    tl.store(target_logit + row, x_t)


@triton.jit
def ce_bwd_kernel(logits, target, lse, dloss, dlogits, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(target + row).to(tl.int64) - vocab_start  # out of [0, V): not this shard's, no one-hot
    r_lse = tl.load(lse + row)
    g = tl.load(dloss + row)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        ok = c < V
        x = tl.load(logits + row * V + c, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x - r_lse) - tl.where(c == t, 1.0, 0.0)
        tl.store(dlogits + row * V + c, (p * g).to(dlogits.dtype.element_ty), mask=ok)


def cross_entropy_partials(logits: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """``logits [N, V]`` contiguous, ``target [N]`` integer global ids -> fp32 ``(max, sum(exp(x - max)),
    target logit or 0)``, each ``[N]`` (as ``naive.cross_entropy_partials``)."""
    rows, vocab = logits.shape
    stats = torch.empty(3, rows, device=logits.device, dtype=torch.float32)
    if rows:
        cfg = launch_config(vocab)
        ce_fwd_kernel[(rows,)](logits, target, stats[0], stats[1], stats[2], vocab, vocab_start, **cfg)
    return stats[0], stats[1], stats[2]


def cross_entropy_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                       dloss: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``dlogits [N, V]`` in the logits' dtype, written into ``out`` when given (it may be ``logits``).
    ``lse`` and ``dloss`` are fp32 ``[N]``, contiguous."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits) if out is None else out
    if rows:
        cfg = launch_config(vocab)
        ce_bwd_kernel[(rows,)](logits, target, lse, dloss, out, vocab, vocab_start, **cfg)
    return out
