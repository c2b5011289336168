"""Model FLOPs per token (forward + backward = 3x forward), for MFU and TFLOP/s.

Matrix multiplies only (2 FLOPs per multiply-add); norms, activations and routing are ignored,
as in Megatron-LM's MFU. Per layer and token, ``h`` hidden, ``s`` sequence length:

* full attention: QKV ``2 h (n_q + 2 n_kv) d`` + output ``2 n_q d h`` + causal scores and
  weighted values ``2 n_q d s`` (QK^T and AV, each ``2 d`` per key, over ``s / 2`` keys on average);
* KDA: q/k/v and output projections as above with ``n_kv = n_q = H``, the low-rank gate and output
  gate ``2 (h r + r H d)`` each, beta ``2 h H``, and the chunked kernel ``H (6 d^2 + 4 C d)``
  (state read for the output and for the WY correction and the state update: ``3 x 2 d^2``;
  intra-chunk q.k and k.k products and the WY products over ``C / 2`` keys on average: ``4 C d``);
* MLA (NoPE, no query low rank; ``dq = dn + dr``): queries ``2 h H dq``, latent ``2 h (r + dr)``,
  its expansion ``2 r H (dn + dv)``, output ``2 H dv h``, scores and values ``H (dq + dv) s``;
* dense SwiGLU MLP ``6 h f``; MoE ``2 h E`` (router) + ``k 6 h f_e`` + shared ``6 h f_s``;
* the output layer ``2 h V`` (``V`` the padded vocabulary).

Not counted: Block AttnRes's depth mixing (a softmax over at most ``N + 1`` sources per sublayer,
``~4 (N + 1) h`` per sublayer: under 0.1% of the model at hidden 2048), RoPE, the aux loss.
:func:`flops_breakdown` gives the forward FLOPs per token term by term.
"""

from __future__ import annotations

KDA_CHUNK = 64


def _attention_flops(cfg, seq: int) -> float:
    h, d = cfg.hidden_size, cfg.kv_channels
    n_q = cfg.num_attention_heads
    n_kv = cfg.num_query_groups or n_q
    return 2 * h * (n_q + 2 * n_kv) * d + 2 * n_q * d * h + 2 * n_q * d * seq


def _mla_flops(cfg, seq: int) -> float:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    dn, dr, dv, r = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    projections = 2 * h * heads * (dn + dr) + 2 * h * (r + dr) + 2 * r * heads * (dn + dv) + 2 * heads * dv * h
    return projections + heads * (dn + dr + dv) * seq


def _kda_flops(cfg) -> float:
    h = cfg.hidden_size
    heads = getattr(cfg, "kda_num_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "kda_head_dim", None) or cfg.kv_channels
    rank = getattr(cfg, "kda_gate_rank", None) or d
    projections = 2 * h * 3 * heads * d + 2 * heads * d * h
    gates = 2 * 2 * (h * rank + rank * heads * d) + 2 * h * heads
    kernel = heads * (6 * d * d + 4 * KDA_CHUNK * d)
    return projections + gates + kernel


def _mlp_flops(cfg, layer: int) -> float:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 6 * h * cfg.ffn_hidden_size
    moe = 2 * h * cfg.num_moe_experts + cfg.moe_router_topk * 6 * h * cfg.moe_ffn_hidden_size
    if cfg.moe_shared_expert_intermediate_size:
        moe += 6 * h * cfg.moe_shared_expert_intermediate_size
    return moe


def flops_breakdown(cfg, seq_length: int) -> dict[str, float]:
    """Forward FLOPs per token of ``cfg`` (a ``HybridConfig``), summed over layers, per term:
    ``attention`` (full-attention and MLA layers), ``kda`` (KDA layers), ``mlp`` (dense and MoE) and
    ``output`` (the output layer)."""
    terms = {"attention": 0.0, "kda": 0.0, "mlp": 0.0,
             "output": float(2 * cfg.hidden_size * cfg.padded_vocab_size())}
    for layer in range(cfg.num_layers):
        if cfg.attention_kind(layer) == "K":
            terms["kda"] += _kda_flops(cfg)
        elif cfg.attention_kind(layer) == "M":
            terms["attention"] += _mla_flops(cfg, seq_length)
        else:
            terms["attention"] += _attention_flops(cfg, seq_length)
        terms["mlp"] += _mlp_flops(cfg, layer)
    return terms


def model_flops_per_token(cfg, seq_length: int) -> float:
    """Training FLOPs per token of ``cfg`` (a ``HybridConfig``) at ``seq_length``."""
    return 3.0 * sum(flops_breakdown(cfg, seq_length).values())
