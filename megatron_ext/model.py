"""The model builder: ``HybridConfig`` -> Megatron-Core layer specs -> ``GPTModel``.

One function per level, each a plain Megatron ``ModuleSpec`` seam:

* :func:`attention_spec` - the attention sublayer for an attention kind ("A" full, "K" KDA, "M" MLA);
* :func:`mlp_spec` - the MLP sublayer (dense SwiGLU or our MoE layer);
* :func:`layer_spec` - one ``TransformerLayer`` from the two;
* :func:`decoder_block_spec` - the ``TransformerBlockSubmodules`` of the layers this pipeline
  stage (and virtual stage) builds;
* :func:`build_model` - the ``GPTModel`` on top (untied embeddings, NoPE or RoPE on the full-attention layers; the LM loss through the fused
  cross-entropy with ``fused_cross_entropy``, ``megatron_ext.layers.lm_loss``).

Activations are sequence-first ``[s, b, h]`` throughout, as in Megatron-Core; under sequence
parallelism ``s`` is the local shard between the tensor-parallel regions.
"""

from __future__ import annotations

import functools
from typing import Callable

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_ext.config import ConfigError, HybridConfig
from megatron_ext.kda import kda_attention_spec
from megatron_ext.layers.attention import SDPAttention
from megatron_ext.layers.lm_loss import HybridGPTModel
from megatron_ext.layers.mla import mla_attention_spec
from megatron_ext.layers.norm import RMSNorm


def full_attention_spec(config: HybridConfig) -> ModuleSpec:
    """Megatron's ``SelfAttention`` (column-parallel QKV, row-parallel proj) with SDPA inside."""
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


# Attention kind -> spec function. Other techniques register themselves here.
ATTENTION_SPECS: dict[str, Callable[[HybridConfig], ModuleSpec]] = {
    "A": full_attention_spec,
    "K": kda_attention_spec,
    "M": mla_attention_spec,
}


def attention_spec(config: HybridConfig, kind: str) -> ModuleSpec:
    if kind not in ATTENTION_SPECS:
        raise ConfigError(f"attention kind {kind!r} has no spec; known: {sorted(ATTENTION_SPECS)}")
    return ATTENTION_SPECS[kind](config)


def mlp_spec(config: HybridConfig, moe: bool):
    """The MLP builder for a layer: our MoE layer or Megatron's dense (SwiGLU) MLP."""
    if moe:
        from megatron_ext.moe.layer import moe_layer_spec

        return moe_layer_spec()
    return functools.partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def layer_spec(config: HybridConfig, layer_index: int) -> ModuleSpec:
    """The ``TransformerLayer`` spec of the 0-based global layer ``layer_index``."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=attention_spec(config, config.attention_kind(layer_index)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp_spec(config, config.is_moe_layer(layer_index)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_block_spec(
    config: HybridConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """Layer specs of the layers this (virtual) pipeline stage builds, plus the final norm."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(config, offset + i) for i in range(count)],
        layer_norm=RMSNorm,
    )


def build_model(
    config: HybridConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    pg_collection: ProcessGroupCollection | None = None,
) -> HybridGPTModel:
    """The hybrid decoder as a Megatron ``GPTModel`` (:class:`HybridGPTModel`, or its AttnRes subclass) for
    one (virtual) pipeline stage."""
    model_class, block_spec = HybridGPTModel, decoder_block_spec(config, vp_stage=vp_stage)
    if config.attn_res:
        from megatron_ext.attn_res import AttnResGPTModel, attn_res_block_spec

        model_class, block_spec = AttnResGPTModel, attn_res_block_spec(block_spec)
    return model_class(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=config.padded_vocab_size(),
        max_sequence_length=config.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type=config.position_embedding_type,  # "none" (NoPE) unless a RoPE reference
        rotary_base=config.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
