"""MoE combine: ``out[n] = sum_j gates[n, j] * rows[source[n k + j]]`` (the reverse of the dispatcher's
permute, weighted by the fp32 gates). Entry point :func:`moe_combine`: the Triton kernels (``fused.py``)
for CUDA tensors, the PyTorch reference (``naive.py``) otherwise."""

import torch

from kimi_kernels.moe_combine.naive import combine_reference

__all__ = ["moe_combine", "combine_reference"]


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, gates, source):
        from kimi_kernels.moe_combine.fused import combine_fwd

        rows, gates, source = rows.contiguous(), gates.contiguous(), source.contiguous()
        ctx.save_for_backward(rows, gates, source)
        return combine_fwd(rows, gates, source)

    @staticmethod
    def backward(ctx, d_out):
        from kimi_kernels.moe_combine.fused import combine_bwd

        d_rows, d_gates = combine_bwd(d_out.contiguous(), *ctx.saved_tensors)
        return d_rows, d_gates, None


def moe_combine(rows: torch.Tensor, gates: torch.Tensor, source: torch.Tensor, use_kernel: bool | None = None):
    """``rows [M, h]`` (expert outputs in dispatch order), ``gates [N, k]`` fp32, ``source [N * k]`` int64
    (row of each (token, slot) pair; ``M`` for a dropped pair) -> ``[N, h]`` in ``rows``' dtype, summed in
    fp32. ``use_kernel`` defaults to ``rows.is_cuda``."""
    if gates.dtype != torch.float32 or gates.dim() != 2:
        raise ValueError(f"gates must be fp32 [N, k], got {gates.dtype} {tuple(gates.shape)}")
    if source.shape != (gates.numel(),):
        raise ValueError(f"source must be [N * k] = [{gates.numel()}], got {tuple(source.shape)}")
    if rows.is_cuda if use_kernel is None else use_kernel:
        return _CombineFunction.apply(rows, gates, source)
    return combine_reference(rows, gates, source)
