"""Full causal attention through ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in ``core_attention`` for Megatron-Core's ``SelfAttention``: Megatron's own
``DotProductAttention`` allocates its score buffer on CUDA and materialises the full score
matrix; SDPA picks the flash / memory-efficient kernel on the GPU and runs everywhere. No
positional encoding is applied here (NoPE): in the hybrid model the KDA layers carry position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Core attention on tensor-parallel-local heads.

    Shapes (Megatron's convention): query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` with
    ``np`` a multiple of ``ng`` (grouped-query attention); value ``[sk, b, ng, hv]``; returns
    ``[sq, b, np * hv]``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_unused,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPAttention supports attn_mask_type causal or no_mask, got {attn_mask_type}"
            )
        self.causal = attn_mask_type == AttnMaskType.causal
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention does not take packed sequences")
        sq, b, np_, hn = query.shape
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.causal,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        # The value head dim may differ from the query's (MLA).
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * out.shape[-1])
