"""The Megatron ``ModuleSpec`` of the KDA attention sublayer (attention kind "K")."""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.kda.layer import KDAAttention, KDAAttentionSubmodules


def kda_attention_spec(config) -> ModuleSpec:
    """``self_attention`` spec for a KDA layer; sizes and gate come from ``config.kda_*``."""
    return ModuleSpec(
        module=KDAAttention,
        submodules=KDAAttentionSubmodules(
            column_linear=ColumnParallelLinear, row_linear=RowParallelLinear
        ),
    )
