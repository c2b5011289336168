"""Kimi Delta Attention (KDA) as a Megatron-Core attention sublayer (see docs/kda_layer.md)."""

from megatron_ext.kda.core import kda_core, kda_gate
from megatron_ext.kda.layer import KDAAttention, KDAAttentionSubmodules, kda_dims
from megatron_ext.kda.spec import kda_attention_spec

__all__ = ["KDAAttention", "KDAAttentionSubmodules", "kda_attention_spec", "kda_core", "kda_gate", "kda_dims"]
