"""PyTorch reference of the MoE combine: each token's k expert-output rows weighted by its fp32 gates."""

import torch


def combine_reference(rows: torch.Tensor, gates: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``rows [M, h]``, ``gates [N, k]`` fp32, ``source [N * k]`` (row of each (token, slot) pair, or ``M``
    for a dropped pair) -> ``[N, h]`` in ``rows``' dtype: ``sum_j gates[n, j] * rows[source[n k + j]]``,
    computed in fp32 (autograd through plain ops)."""
    num_tokens, top_k = gates.shape
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    slots = padded.index_select(0, source).view(num_tokens, top_k, rows.shape[1]).float()
    return torch.bmm(gates.unsqueeze(1), slots).squeeze(1).to(rows.dtype)
