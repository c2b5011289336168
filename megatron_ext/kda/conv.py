"""Depthwise causal short convolution over the sequence, split over TP ranks with the heads."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_ext.kda.sharding import TPShardedModule, head_split_parameter, param_device


class CausalShortConv(TPShardedModule):
    """``y[t, c] = silu(sum_j w[c, j] x[t - (K-1) + j, c])`` per channel, zero before each sample.

    ``channels`` is the global channel count (heads x head dim); this rank holds the channels of
    its heads, the same contiguous slice a ``ColumnParallelLinear`` output has. Takes the full
    sequence ``[s, b, C_local]`` and returns it batch-first, ``[b, s, C_local]``, the layout the
    kernel wants. Samples in the batch never see each other (the batch is the conv's batch dim).
    """

    def __init__(self, config, channels: int, kernel_size: int, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.kernel_size = kernel_size
        # torch's Conv1d default for a depthwise conv (fan_in = kernel_size): U(-1/sqrt(k), 1/sqrt(k)).
        bound = 1.0 / math.sqrt(kernel_size)
        weight = torch.empty(channels, kernel_size).uniform_(-bound, bound)
        self.weight = head_split_parameter(weight, tp_group, param_device(config), config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[-1]
        x = x.permute(1, 2, 0)  # [b, C, s]
        x = F.pad(x, (self.kernel_size - 1, 0))  # causal: left padding only
        y = F.conv1d(x, self.weight.unsqueeze(1).to(x.dtype), groups=channels)
        return F.silu(y).transpose(1, 2)
