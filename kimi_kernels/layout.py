"""Token layouts the kernels read in place: a ``[d0, d1, ...]`` tensor whose two leading (token) dims have any
strides, each token's values contiguous. Megatron's activations are sequence-first ``[s, b, ...]`` while the KDA
kernels work batch-first; a view of one as the other is such a tensor, read and written without a copy."""

import torch


def tokens_lie_apart(x: torch.Tensor) -> bool:
    """Whether every token ``x[i, j]`` is contiguous and no two tokens overlap, whatever the strides of the
    first two dims (dims of size 1 do not count)."""
    if x.dim() < 3 or x.numel() == 0 or not x[0, 0].is_contiguous():
        return False
    span = x[0, 0].numel()
    for stride, size in sorted((x.stride(i), x.shape[i]) for i in (0, 1) if x.shape[i] > 1):
        if stride < span:
            return False
        span = stride * size
    return True
