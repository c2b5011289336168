"""Depthwise causal short convolution over the sequence, split over TP ranks with the heads."""

from __future__ import annotations

import math

import torch

from kimi_kernels.short_conv import causal_conv_silu, causal_conv_silu_group, causal_conv_silu_reference
from megatron_ext.kda.sharding import TPShardedModule, head_split_parameter, param_device


class CausalShortConv(TPShardedModule):
    """``y[t, c] = silu(sum_j w[c, j] x[t - (K-1) + j, c])`` per channel, zero before each sample.

    ``channels`` is the global channel count (heads x head dim); this rank holds the channels of
    its heads, the same contiguous slice a ``ColumnParallelLinear`` output has. Takes the full
    sequence ``[s, b, C_local]`` and returns it batch-first, ``[b, s, C_local]``, the layout the
    kernel wants. Samples in the batch never see each other (the batch is the conv's batch dim).

    CUDA inputs go through the fused Triton kernel (``kimi_kernels/short_conv``: the layout change fused in,
    fp32 maths with the fp32 weight); CPU inputs through the PyTorch path (:meth:`reference`).
    """

    def __init__(self, config, channels: int, kernel_size: int, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.kernel_size = kernel_size
        # torch's Conv1d default for a depthwise conv (fan_in = kernel_size): U(-1/sqrt(k), 1/sqrt(k)).
        bound = 1.0 / math.sqrt(kernel_size)
        weight = torch.empty(channels, kernel_size).uniform_(-bound, bound)
        self.weight = head_split_parameter(weight, tp_group, param_device(config), config.params_dtype)

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        """The weight as the kernel takes it for input ``x``: fp32 or x's dtype."""
        weight = self.weight
        if weight.dtype not in (torch.float32, x.dtype):  # e.g. fp16 params under bf16 activations
            weight = weight.to(x.dtype)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return causal_conv_silu(x, self.weight_for(x))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch path (pad + depthwise conv1d + SiLU, weight cast to x's dtype) on any device."""
        return causal_conv_silu_reference(x, self.weight)


def convolve_together(convs, xs) -> list:
    """Each of ``convs`` on its input of ``xs``, as its forward does, in one kernel launch each way where the
    inputs share a shape (a KDA layer's q, k and v: three convolutions and three backwards become one each)."""
    return causal_conv_silu_group(list(xs), [conv.weight_for(x) for conv, x in zip(convs, xs)])
