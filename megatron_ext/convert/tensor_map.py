"""Every tensor of our model <-> its tensors in Kimi Linear's released on-disk layout.

A :class:`Conversion` ties one of our checkpoint keys (a global tensor) to the Hugging Face tensors
it becomes: ``split`` makes them from ours (export), ``join`` makes ours from them (import); the
two are exact inverses (slices, transposes, reshapes only), so a round trip is bit-exact.

Layouts (ours -> released):

* KDA: ``q_conv.weight [C, K]`` -> ``q_conv1d.weight [C, 1, K]``; ``A_log [H]`` -> ``[1, 1, H, 1]``;
  ``f_proj.down/up`` -> ``f_a_proj/f_b_proj``; ``g_proj.down/up`` -> ``g_a_proj/g_b_proj``;
  ``o_norm_weight`` -> ``o_norm.weight``.
* MLA: ``kv_a_proj`` -> ``kv_a_proj_with_mqa``; ``kv_a_norm`` -> ``kv_a_layernorm``.
* dense MLP: ``linear_fc1 [2f, h]`` = ``[gate; up]`` -> ``mlp.gate_proj`` + ``mlp.up_proj``.
* MoE: ``experts.w1 [E, h, 2f]`` (columns ``[gate | up]``) -> per expert ``w1`` (gate) and ``w3`` (up),
  ``[f, h]`` each; ``experts.w2 [E, f, h]`` -> per expert ``w2 [h, f]``; the shared expert likewise
  (``w1 [h, 2f]``, ``w2 [f, h]``); ``router.expert_bias`` -> ``gate.e_score_correction_bias`` (zeros when
  our balancer keeps no bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Conversion:
    ours: str  # our checkpoint key
    hf: tuple[str, ...]  # the Hugging Face tensor names it becomes
    split: Callable[[torch.Tensor], Tensors]
    join: Callable[[Tensors], torch.Tensor]
    optional: bool = False  # ours may be absent (the expert bias of a balancer without one): zeros in HF


def _same(ours: str, hf: str) -> Conversion:
    return Conversion(ours, (hf,), lambda t: [t], lambda ts: ts[0])


def _reshaped(ours: str, hf: str, hf_shape: Callable[[torch.Size], tuple], ours_shape: Callable[[torch.Size], tuple]):
    return Conversion(ours, (hf,), lambda t: [t.reshape(hf_shape(t.shape))],
                      lambda ts: ts[0].reshape(ours_shape(ts[0].shape)))


def _halves(ours: str, gate: str, up: str, transposed: bool) -> Conversion:
    """``[gate; up]`` along dim 0 (Megatron's fc1 ``[2f, h]``), or along the last dim transposed (our experts'
    ``[h, 2f]``), -> ``gate [f, h]`` and ``up [f, h]``."""
    if transposed:
        return Conversion(ours, (gate, up), lambda t: [c.t().contiguous() for c in t.chunk(2, dim=-1)],
                          lambda ts: torch.cat([c.t() for c in ts], dim=-1).contiguous())
    return Conversion(ours, (gate, up), lambda t: [c.contiguous() for c in t.chunk(2, dim=0)],
                      lambda ts: torch.cat(ts, dim=0))


def _transposed(ours: str, hf: str) -> Conversion:
    return Conversion(ours, (hf,), lambda t: [t.t().contiguous()], lambda ts: ts[0].t().contiguous())


def _experts(ours: str, prefix: str, num_experts: int) -> list[Conversion]:
    """Stacked ``w1 [E, h, 2f]`` / ``w2 [E, f, h]`` <-> per-expert ``w1``/``w3`` and ``w2``."""
    gate_up = Conversion(
        f"{ours}.w1",
        tuple(f"{prefix}.{e}.{w}.weight" for e in range(num_experts) for w in ("w1", "w3")),
        lambda t: [c.t().contiguous() for expert in t for c in expert.chunk(2, dim=-1)],
        lambda ts: torch.stack([torch.cat([ts[2 * e].t(), ts[2 * e + 1].t()], dim=-1)
                                for e in range(num_experts)]).contiguous(),
    )
    down = Conversion(
        f"{ours}.w2",
        tuple(f"{prefix}.{e}.w2.weight" for e in range(num_experts)),
        lambda t: [expert.t().contiguous() for expert in t],
        lambda ts: torch.stack([w.t() for w in ts]).contiguous(),
    )
    return [gate_up, down]


def _kda(ours: str, hf: str) -> list[Conversion]:
    convs = [_same(f"{ours}.{n}_proj.weight", f"{hf}.{n}_proj.weight") for n in ("q", "k", "v", "b", "o")]
    convs += [_reshaped(f"{ours}.{n}_conv.weight", f"{hf}.{n}_conv1d.weight",
                        lambda s: (s[0], 1, s[1]), lambda s: (s[0], s[2])) for n in ("q", "k", "v")]
    convs += [
        _same(f"{ours}.f_proj.down.weight", f"{hf}.f_a_proj.weight"),
        _same(f"{ours}.f_proj.up.weight", f"{hf}.f_b_proj.weight"),
        _same(f"{ours}.g_proj.down.weight", f"{hf}.g_a_proj.weight"),
        _same(f"{ours}.g_proj.up.weight", f"{hf}.g_b_proj.weight"),
        _reshaped(f"{ours}.A_log", f"{hf}.A_log", lambda s: (1, 1, s[0], 1), lambda s: (s[2],)),
        _same(f"{ours}.dt_bias", f"{hf}.dt_bias"),
        _same(f"{ours}.o_norm_weight", f"{hf}.o_norm.weight"),
    ]
    return convs


def _mla(ours: str, hf: str) -> list[Conversion]:
    return [
        _same(f"{ours}.q_proj.weight", f"{hf}.q_proj.weight"),
        _same(f"{ours}.kv_a_proj.weight", f"{hf}.kv_a_proj_with_mqa.weight"),
        _same(f"{ours}.kv_a_norm.weight", f"{hf}.kv_a_layernorm.weight"),
        _same(f"{ours}.kv_b_proj.weight", f"{hf}.kv_b_proj.weight"),
        _same(f"{ours}.o_proj.weight", f"{hf}.o_proj.weight"),
    ]


def layer_conversions(cfg, i: int) -> list[Conversion]:
    """The conversions of the 0-based global layer ``i`` of the ``HybridConfig`` ``cfg``."""
    ours, hf = f"decoder.layers.{i}", f"model.layers.{i}"
    convs = [_same(f"{ours}.input_layernorm.weight", f"{hf}.input_layernorm.weight"),
             _same(f"{ours}.pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight")]
    attention = {"K": _kda, "M": _mla}[cfg.attention_kind(i)]
    convs += attention(f"{ours}.self_attention", f"{hf}.self_attn")
    if not cfg.is_moe_layer(i):
        return convs + [
            _halves(f"{ours}.mlp.linear_fc1.weight", f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight", False),
            _same(f"{ours}.mlp.linear_fc2.weight", f"{hf}.mlp.down_proj.weight"),
        ]
    moe = f"{hf}.block_sparse_moe"
    return convs + [
        _same(f"{ours}.mlp.router.weight", f"{moe}.gate.weight"),
        Conversion(f"{ours}.mlp.router.expert_bias", (f"{moe}.gate.e_score_correction_bias",),
                   lambda t: [t], lambda ts: ts[0], optional=True),
        *_experts(f"{ours}.mlp.experts", f"{moe}.experts", cfg.num_moe_experts),
        _halves(f"{ours}.mlp.shared_expert.w1", f"{moe}.shared_experts.gate_proj.weight",
                f"{moe}.shared_experts.up_proj.weight", True),
        _transposed(f"{ours}.mlp.shared_expert.w2", f"{moe}.shared_experts.down_proj.weight"),
    ]


def model_conversions(cfg) -> list[list[Conversion]]:
    """Groups of conversions, converted one group at a time: the embedding, each layer, the head."""
    return ([[_same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]]
            + [layer_conversions(cfg, i) for i in range(cfg.num_layers)]
            + [[_same("decoder.final_layernorm.weight", "model.norm.weight"),
                _same("output_layer.weight", "lm_head.weight")]])


# Tensors kept in fp32 whatever the model dtype (decay parameters and the router's correction bias: in
# bf16 the bias flips expert choices).
FP32_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias")


def hf_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


# transformers' save_pretrained writes a dense layer's MLP under block_sparse_moe (its loader renames
# block_sparse_moe to mlp for every layer); the released files, and our export, use mlp.
HF_NAME_ALIASES = ((".block_sparse_moe.gate_proj.", ".mlp.gate_proj."),
                   (".block_sparse_moe.up_proj.", ".mlp.up_proj."),
                   (".block_sparse_moe.down_proj.", ".mlp.down_proj."))


def canonical_hf_name(name: str) -> str:
    for alias, canonical in HF_NAME_ALIASES:
        name = name.replace(alias, canonical)
    return name
