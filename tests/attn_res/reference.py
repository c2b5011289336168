"""Block AttnRes written plainly, from DESIGN.md section 4, on a built model's own modules.

Independent of ``megatron_ext.attn_res``'s bookkeeping: it keeps every sublayer output and
forms each source list from the definition (block sums as sums of outputs), and it computes the
depth softmax directly in fp64-free plain PyTorch (no recompute op, no kernel).
"""

from __future__ import annotations

import torch


def plain_depth_attention(sources, query, key_norm_weight, eps):
    v = torch.stack([s.float() for s in sources])  # [n, s, b, h]
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * key_norm_weight
    weights = torch.softmax(keys @ query.float(), dim=0)  # [n, s, b]
    return (weights.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


def sources_for(embedding, outputs, sublayer: int, block_size: int):
    """Sources of ``sublayer`` (0-based): b_0, finished block sums, partial sum if non-empty."""
    finished = sublayer // block_size
    blocks = [sum(outputs[i * block_size : (i + 1) * block_size]) for i in range(finished)]
    partial = outputs[finished * block_size : sublayer]
    return [embedding, *blocks] + ([sum(partial)] if partial else [])


def reference_logits(model, tokens, position_ids, block_size: int):
    """Logits ``[b, s, v]`` of a one-stage AttnRes ``GPTModel`` computed from the definition."""
    eps = model.config.layernorm_epsilon
    embedding = model.embedding(input_ids=tokens, position_ids=position_ids)
    outputs = []

    def mix(mixer, sublayer):
        sources = sources_for(embedding, outputs, sublayer, block_size)
        return plain_depth_attention(sources, mixer.query, mixer.key_norm_weight, eps)

    for layer in model.decoder.layers:
        first = 2 * (layer.layer_number - 1)
        h = mix(layer.attn_mixer, first)
        outputs.append(layer.self_attention(layer.input_layernorm(h), attention_mask=None)[0])
        h = mix(layer.mlp_mixer, first + 1)
        outputs.append(layer.mlp(layer.pre_mlp_layernorm(h))[0])
    final = model.decoder.final_mixer
    h = plain_depth_attention(
        sources_for(embedding, outputs, len(outputs), block_size), final.query, final.key_norm_weight, eps
    )
    logits, _ = model.output_layer(model.decoder.final_layernorm(h))
    return logits.transpose(0, 1)
