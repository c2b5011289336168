"""Multi-head latent attention (MLA) without positional encoding, as Kimi Linear's full-attention layers.

DeepSeek-V2's MLA with no query low rank (``q_lora_rank`` null) and NoPE: the "rope" part of the
keys (``qk_pos_emb_head_dim`` channels, one vector shared by all heads) is kept in the weights and
in the dot product but never rotated. Data flow (``H_l`` = heads on this TP rank; ``s_l`` = the
local sequence shard under sequence parallelism, else ``s``)::

    x [s_l, b, h]
      q       = ColumnParallel(x)               [s, b, H_l * (dn + dr)]
      latent  = kv_a_proj(x)  (replicated)      [s_l, b, r + dr] = [c | k_shared]
      kv      = ColumnParallel(RMSNorm_r(c))    [s, b, H_l * (dn + dv)] = per head [k_nope | v]
      k       = [k_nope, k_shared broadcast over heads]           [s, b, H_l, dn + dr]
      o       = SDPA(q, k, v; causal, scale (dn + dr)^-1/2)      [s, b, H_l * dv]
      out     = RowParallel(o)  -> [s_l, b, h]  (reduce-scatter under SP)

The latent projection is small and replicated (like the KDA low-rank gates); the column-parallel
``kv_b_proj`` gathers the normalised latent over the sequence, and the shared key part is gathered
separately (its gradient is a partial sum over this rank's heads: the gather's backward, or the
copy's all-reduce without SP, sums it over TP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_pg_size

from megatron_ext.config import ConfigError
from megatron_ext.kda.lowrank import ReplicatedLinear
from megatron_ext.kda.sharding import TPShardedModule, full_sequence
from megatron_ext.layers.attention import SDPAttention
from megatron_ext.layers.norm import RMSNorm

# Kimi Linear (and DeepSeek-V2) build the latent's RMSNorm with the norm's default eps, not the
# model's rms_norm_eps: part of the format, so fixed here rather than a config value.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAttentionSubmodules:
    column_linear: type = ColumnParallelLinear
    row_linear: type = RowParallelLinear
    core_attention: type = SDPAttention
    latent_norm: type = RMSNorm


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    local_heads: int
    kv_lora_rank: int
    nope_dim: int  # dn: per-head key channels from the latent
    shared_dim: int  # dr: key channels shared by all heads (DeepSeek's rope part; NoPE here)
    v_dim: int

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.shared_dim


def mla_dims(config, tp_size: int) -> MLADims:
    heads = config.num_attention_heads
    if heads % tp_size:
        raise ConfigError(
            f"num_attention_heads={heads} must be divisible by tensor_model_parallel_size={tp_size} "
            "for MLA layers"
        )
    return MLADims(heads, heads // tp_size, config.kv_lora_rank, config.qk_head_dim,
                   config.qk_pos_emb_head_dim, config.v_head_dim)


class MLAttention(TPShardedModule):
    """MLA self-attention with the constructor and ``(output, bias)`` return of ``SelfAttention``."""

    def __init__(
        self,
        config,
        submodules: MLAttentionSubmodules | None = None,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
        **_unused,  # attn_mask_type, cp_comm_type, pp_layer_offset, name
    ):
        super().__init__(config=config)
        submodules = submodules or MLAttentionSubmodules()
        self._use_tp_group(pg_collection, "MLA")
        self.layer_number = layer_number
        self.dims = d = mla_dims(config, get_pg_size(self.tp_group))
        hidden = config.hidden_size

        def column(inp: int, out: int):
            return submodules.column_linear(
                inp, out, config=config, init_method=config.init_method, gather_output=False,
                bias=False, skip_bias_add=False, tp_group=self.tp_group,
            )

        self.q_proj = column(hidden, d.num_heads * d.qk_dim)
        self.kv_a_proj = ReplicatedLinear(config, hidden, d.kv_lora_rank + d.shared_dim, config.init_method,
                                          self.tp_group)
        self.kv_a_norm = submodules.latent_norm(config, d.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = column(d.kv_lora_rank, d.num_heads * (d.nope_dim + d.v_dim))
        self.core_attention = submodules.core_attention(
            config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
            softmax_scale=d.qk_dim ** -0.5,
        )
        self.o_proj = submodules.row_linear(
            d.num_heads * d.v_dim, hidden, config=config, init_method=config.output_layer_init_method,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group,
        )

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                **_unused):  # rotary embeddings, attention_bias: MLA here is NoPE
        if packed_seq_params is not None:
            raise NotImplementedError("MLAttention does not take packed sequences (cu_seqlens) yet")
        if inference_context is not None:
            raise NotImplementedError("MLAttention has no inference (KV cache) path yet")
        d = self.dims
        q, _ = self.q_proj(hidden_states)
        s, b = q.shape[:2]
        q = q.view(s, b, d.local_heads, d.qk_dim)
        latent, shared = self.kv_a_proj(hidden_states).split([d.kv_lora_rank, d.shared_dim], dim=-1)
        kv, _ = self.kv_b_proj(self.kv_a_norm(latent))
        k_nope, v = kv.view(s, b, d.local_heads, d.nope_dim + d.v_dim).split([d.nope_dim, d.v_dim], dim=-1)
        shared = full_sequence(shared, self.config.sequence_parallel, self.tp_group)
        k = torch.cat([k_nope, shared.unsqueeze(2).expand(s, b, d.local_heads, d.shared_dim)], dim=-1)
        o = self.core_attention(q, k, v.contiguous())  # [s, b, H_l * dv]
        return self.o_proj(o)


def mla_attention_spec(config):
    """``self_attention`` spec for an MLA layer (attention kind "M")."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=MLAttention, submodules=MLAttentionSubmodules())
