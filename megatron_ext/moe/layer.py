"""``MoELayer``: router + all-to-all dispatcher + grouped experts (+ shared expert), as the
``mlp`` submodule of Megatron's ``TransformerLayer``.

Use ``TransformerLayerSubmodules(..., mlp=moe_layer_spec())``: the layer is then built as
``MoELayer.as_mlp_submodule(config=..., pg_collection=..., is_mtp_layer=..., name=...)`` and
called as ``mlp(hidden [s, b, h], padding_mask=...) -> (output [s, b, h], None)``.
"""

from __future__ import annotations

import functools

import torch

from megatron.core.transformer.module import MegatronModule
from megatron_ext.moe.dispatcher import AllToAllDispatcher
from megatron_ext.moe.experts import GroupedExperts, SharedExpertMLP, group_size
from megatron_ext.moe.router import TopKRouter

__all__ = ["MoELayer", "moe_layer_spec"]


def _check_layout(config, pg_collection) -> None:
    if not config.num_moe_experts:
        raise ValueError(f"num_moe_experts must be a positive int for MoELayer, got {config.num_moe_experts!r}")
    if config.moe_ffn_hidden_size is None:
        raise ValueError("moe_ffn_hidden_size must be set for MoELayer")
    etp = max(config.expert_tensor_parallel_size or 1, group_size(pg_collection.expt_tp))
    if etp != 1:
        raise ValueError(f"expert_tensor_parallel_size must be 1 for megatron_ext's MoELayer, got {etp}")
    if group_size(pg_collection.tp) > 1 and not config.sequence_parallel:
        # Each TP rank must route a distinct sequence shard; without SP they would all route
        # the same tokens.
        raise ValueError("sequence_parallel must be True when tensor_model_parallel_size > 1 with "
                         "megatron_ext's MoELayer")


class MoELayer(MegatronModule):
    """Mixture of experts on ``[s, b, h]`` (under sequence parallelism: this TP rank's shard).

    ``pg_collection`` needs ``ep`` (expert parallel; ``None`` = 1 rank), ``expt_dp`` (expert data
    parallel, for checkpoint replicas), ``tp`` and ``expt_tp`` (only checked).
    ``use_grouped_mm``: ``None`` picks ``torch._grouped_mm`` when supported, else the loop.
    """

    def __init__(self, config, pg_collection, name: str | None = None,
                 use_grouped_mm: bool | None = None):
        super().__init__(config)
        _check_layout(config, pg_collection)
        self.name = name
        self.layer_number = None
        self.tp_group = pg_collection.tp
        # One draw from the default CPU generator (identical on every rank of a pipeline stage,
        # whatever the EP layout); every weight below derives its private seed from it.
        seed = int(torch.randint(0, 2**62, (1,)))
        self.router = TopKRouter(config, seed, capacity_group=pg_collection.ep)
        self.router.tp_group = pg_collection.tp
        self.dispatcher = AllToAllDispatcher(config.num_moe_experts, pg_collection.ep)
        self.experts = GroupedExperts(config, self.dispatcher.num_local_experts, pg_collection.ep,
                                      pg_collection.expt_dp, seed + 1, use_grouped_mm)
        self.shared_expert = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(config, config.moe_shared_expert_intermediate_size,
                                                 seed + 2 * config.num_moe_experts + 3)
            self.shared_expert.tp_group = pg_collection.tp

    @classmethod
    def as_mlp_submodule(cls, config, pg_collection, is_mtp_layer: bool = False, name: str | None = None,
                         **kwargs) -> "MoELayer":
        """The builder ``TransformerLayer`` calls for its ``mlp`` submodule."""
        del is_mtp_layer
        return cls(config, pg_collection, name=name, **kwargs)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """``[s, b, h]`` -> ``([s, b, h], None)``. ``padding_mask`` is accepted for the
        ``TransformerLayer`` contract; padding tokens are routed like any other token."""
        del padding_mask
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        routing, local_counts = self.router(tokens)
        counts_per_rank = self.dispatcher.global_counts(local_counts)
        self.router.record_global_counts(counts_per_rank)
        expert_input, tokens_per_expert, state = self.dispatcher.dispatch(tokens, routing, counts_per_rank)
        expert_output = self.experts(expert_input, tokens_per_expert)
        output = self.dispatcher.combine(expert_output, routing.gates, state)
        if self.shared_expert is not None:
            output = output + self.shared_expert(tokens)
        return output.view(shape), None


def moe_layer_spec(**options):
    """The ``mlp`` entry for ``TransformerLayerSubmodules``; ``options`` go to ``MoELayer``
    (e.g. ``use_grouped_mm=False``)."""
    return functools.partial(MoELayer.as_mlp_submodule, **options)
