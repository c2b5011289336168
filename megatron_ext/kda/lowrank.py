"""Low-rank projection ``hidden -> rank -> heads x dim``: replicated down, column-parallel up.

The down projection is small and not split (its output feeds every head). It runs on the
input as it arrives, i.e. on this rank's sequence shard under sequence parallelism; the
column-parallel up projection then all-gathers the rank-sized activations (cheaper than the
hidden-sized input) and its backward reduce-scatters their gradient, so the down projection's
input gradient is complete for the local shard. Its weight gradient is then a partial sum over
the sequence shards: the weight is marked ``sequence_parallel`` so that Megatron's
``finalize_model_grads`` all-reduces it over TP, as for the norms. Without sequence parallelism
the up projection all-reduces its input gradient and the down weight's gradient is complete and
identical on every TP rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megatron_ext.kda.sharding import param_device


class ReplicatedLinear(MegatronModule):
    """``y = x W^T`` with ``W`` the same on every TP rank, applied to the local sequence shard."""

    def __init__(self, config, input_size: int, output_size: int, init_method, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group  # checkpointed as replicated over this group
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, device=param_device(config), dtype=config.params_dtype)
        )
        if config.perform_initialization:
            init_method(self.weight)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LowRankProjection(MegatronModule):
    """``up(down(x))``: ``[s_local, b, h] -> [s, b, out_local]`` (column-parallel output)."""

    def __init__(self, config, column_linear, hidden: int, rank: int, out: int, bias: bool, tp_group):
        super().__init__(config=config)
        self.down = ReplicatedLinear(config, hidden, rank, config.init_method, tp_group)
        self.up = column_linear(
            rank, out, config=config, init_method=config.init_method, gather_output=False,
            bias=bias, skip_bias_add=False, tp_group=tp_group,
        )

    def up_project(self, low: torch.Tensor) -> torch.Tensor:
        """``up(low)`` for ``low = down(x)``, which the KDA layer computes with its other projections of
        ``x`` (kda/shared_input.py)."""
        y, _ = self.up(low)
        return y
