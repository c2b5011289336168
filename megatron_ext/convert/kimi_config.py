"""Our model fields <-> Kimi Linear's ``config.json`` (the released Kimi-Linear-48B-A3B spelling).

:func:`to_kimi_config` refuses a model the format cannot hold, naming the setting;
:func:`from_kimi_config` refuses a config.json key it does not understand or a value our model
cannot reproduce, naming the key. Tensor names and shapes follow from these fields
(:mod:`megatron_ext.convert.tensor_map`).
"""

from __future__ import annotations

from megatron_ext.errors import ConfigError

MODEL_TYPE = "kimi_linear"
# Layer kinds: our attention_pattern letter <-> transformers' layer_types entry.
LAYER_TYPES = {"K": "linear_attention", "M": "full_attention"}
# transformers' KimiLinearConfig attribute_map: the released config.json spells these on the right.
ALIASES = {"norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group", "num_local_experts": "num_experts",
           "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
           "max_position_embeddings": "model_max_length"}
# Keys with no effect on the weights or the forward pass (token ids, generation, bookkeeping, and values
# transformers derives from the others).
IGNORED_KEYS = {
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
    "transformers_version", "use_cache", "initializer_range", "output_router_logits", "pretraining_tp",
    "head_dim", "qk_head_dim", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
    "model_max_length", "max_position_embeddings", "keys_to_ignore_at_inference", "moe_layer_freq",
    "num_nextn_predict_layers", "use_grouped_topk", "generation_config", "rope_theta", "rope_scaling",
    "tokenizer_class", "chat_template",
}
# Keys whose only supported value is fixed by our model: key -> (value, why).
FIXED_KEYS = {
    "hidden_act": ("silu", "our MLPs are SwiGLU"),
    "attention_bias": (False, "our projections have no bias"),
    "attention_dropout": (0.0, "our attention has no dropout"),
    "q_lora_rank": (None, "MLA queries are projected directly (q_lora_rank null)"),
    "tie_word_embeddings": (False, "our embedding and output layer are separate"),
    "moe_renormalize": (True, "the sigmoid router renormalises the chosen experts' scores"),
    "mla_use_nope": (True, "MLA layers have no positional encoding"),
    "moe_router_activation_func": ("sigmoid", "router scores are sigmoid"),
}
REQUIRED_KEYS = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "head_dim", "num_heads", "short_conv_kernel_size"}


def _refuse(setting: str, why: str) -> ConfigError:
    return ConfigError(f"{setting}: {why}; Kimi Linear's format (transformers' KimiLinearForCausalLM) cannot hold it")


def _dense_prefix(moe_flags: list[int]) -> int | None:
    """k when the layers are k dense then all MoE (Kimi's first_k_dense_replace), else None."""
    k = moe_flags.index(1) if 1 in moe_flags else len(moe_flags)
    return k if all(moe_flags[k:]) else None


def to_kimi_config(cfg, dtype: str) -> dict:
    """``config.json`` for the ``HybridConfig`` ``cfg`` (``dtype``: the tensors' dtype name)."""
    if cfg.attn_res:
        raise _refuse("attn_res: true", "Block AttnRes has no field in Kimi Linear (Kimi K3 names it "
                      "attn_res_block_size; transformers' KimiLinear would ignore it and compute another model)")
    kinds = [cfg.attention_kind(i) for i in range(cfg.num_layers)]
    bad = sorted(set(kinds) - set(LAYER_TYPES))
    if bad:
        raise _refuse(f"attention_pattern={cfg.attention_pattern!r}",
                      f"layer kind(s) {bad} are not Kimi Linear's (it has 'K' KDA and 'M' MLA layers)")
    if "K" in kinds:
        if cfg.kda_gate != "softplus":
            raise _refuse(f"kda_gate={cfg.kda_gate!r}", "Kimi Linear's KDA gate is the softplus form (the lower-"
                          "bounded gate is Kimi K3's gate_lower_bound, which KimiLinearForCausalLM ignores)")
        if cfg.kda_output_gate_bias:
            raise _refuse("kda_output_gate_bias: true", "Kimi Linear's output gate g_b_proj has no bias")
    kda_heads = cfg.kda_num_heads or cfg.num_attention_heads
    kda_dim = cfg.kda_head_dim or cfg.kv_channels
    if (cfg.kda_gate_rank or kda_dim) != kda_dim:
        raise _refuse(f"kda_gate_rank={cfg.kda_gate_rank}", f"Kimi Linear's gate rank is the KDA head dim ({kda_dim})")
    moe_flags = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    out = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": MODEL_TYPE,
        "dtype": dtype,
        "vocab_size": cfg.padded_vocab_size(),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_head_dim,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "model_max_length": cfg.max_sequence_length,
        # Token ids belong to the tokenizer, which a checkpoint does not name (transformers' defaults are
        # Kimi's 163k-vocabulary ids, out of range for a smaller vocabulary).
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "K"],  # 1-indexed, as released
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "M"],
            "head_dim": kda_dim,
            "num_heads": kda_heads,
            "short_conv_kernel_size": cfg.kda_conv_size,
        },
        "mlp_layer_types": ["sparse" if m else "dense" for m in moe_flags],
    }
    if _dense_prefix(moe_flags) is not None:
        out["first_k_dense_replace"] = _dense_prefix(moe_flags)
    if any(moe_flags):
        if cfg.moe_router_score_function != "sigmoid":
            raise _refuse(f"moe_router_score_function={cfg.moe_router_score_function!r}",
                          "Kimi Linear's router scores are sigmoid")
        shared = cfg.moe_shared_expert_intermediate_size or 0
        if shared <= 0 or shared % cfg.moe_ffn_hidden_size:
            raise _refuse(f"moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size}",
                          f"Kimi Linear's shared experts are n x moe_ffn_hidden_size ({cfg.moe_ffn_hidden_size}), n >= 1")
        out.update({
            "num_experts": cfg.num_moe_experts,
            "num_experts_per_token": cfg.moe_router_topk,
            "moe_intermediate_size": cfg.moe_ffn_hidden_size,
            "num_shared_experts": shared // cfg.moe_ffn_hidden_size,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": float(cfg.moe_router_topk_scaling_factor or 1.0),
            "num_expert_group": 1,
            "topk_group": 1,
        })
    return out


def _vocab_multiple(vocab: int) -> int:
    """The largest power of two <= 128 dividing ``vocab``: our padding then adds no rows."""
    return next(m for m in (128, 64, 32, 16, 8, 4, 2, 1) if vocab % m == 0)


def from_kimi_config(hf: dict) -> dict:
    """Our model fields (``USER_FIELDS`` names) for a Kimi Linear ``config.json`` dict."""
    hf = {ALIASES.get(k, k): v for k, v in hf.items()}
    if hf.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"config.json model_type={hf.get('model_type')!r}; expected {MODEL_TYPE!r}")
    absent = [k for k in REQUIRED_KEYS if k not in hf]
    if absent:
        raise ConfigError(f"config.json lacks {absent} (transformers' defaults are Kimi-Linear-48B's; this "
                          "converter asks for the sizes)")
    for key, (value, why) in FIXED_KEYS.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"config.json {key}={hf[key]!r} is not supported: only {value!r} ({why})")
    layers = hf["num_hidden_layers"]
    linear = dict(hf.get("linear_attn_config") or {})
    unknown = sorted(set(linear) - LINEAR_ATTN_KEYS)
    if unknown:
        raise ConfigError(f"config.json linear_attn_config has unknown key(s) {unknown}; known: {sorted(LINEAR_ATTN_KEYS)}")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        layer_types = [None] * layers
        for key, kind in (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention")):
            for index in linear.get(key, []):  # 1-indexed
                if not 1 <= index <= layers:
                    raise ConfigError(f"config.json linear_attn_config.{key} has layer {index}; layers are 1..{layers}")
                layer_types[index - 1] = kind
    kinds = {v: k for k, v in LAYER_TYPES.items()}
    for i, kind in enumerate(layer_types):
        if kind not in kinds:
            raise ConfigError(f"config.json: layer {i + 1} has type {kind!r}; allowed: {sorted(kinds)}")
    mlp_types = hf.get("mlp_layer_types") or [
        "dense" if i < hf.get("first_k_dense_replace", 1) else "sparse" for i in range(layers)]
    if len(mlp_types) != layers or set(mlp_types) - {"dense", "sparse"}:
        raise ConfigError(f"config.json mlp_layer_types={mlp_types!r}: needs {layers} entries 'dense' or 'sparse'")
    if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        raise ConfigError(f"config.json num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads "
                          f"({hf['num_attention_heads']}): MLA expands keys and values for every head")
    if hf.get("num_expert_group", 1) != hf.get("topk_group", 1):
        raise ConfigError(f"config.json num_expert_group={hf.get('num_expert_group')} with topk_group="
                          f"{hf.get('topk_group')}: group-limited routing is not supported (only topk_group == "
                          "num_expert_group, where it selects every group)")
    known = (set(FIXED_KEYS) | IGNORED_KEYS | set(ALIASES.values()) | {
        "model_type", "num_hidden_layers", "linear_attn_config", "layer_types", "mlp_layer_types",
        "first_k_dense_replace", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
        "moe_intermediate_size", "routed_scaling_factor", "topk_group"})
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ConfigError(f"config.json has unsupported key(s) {unknown}")
    vocab = hf["vocab_size"]
    moe = "sparse" in mlp_types
    fields = dict(
        num_layers=layers,
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-5)),
        attention_pattern="".join(kinds[t] for t in layer_types),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_vocab_multiple(vocab),
        kda_num_heads=linear.get("num_heads", 32),
        kda_head_dim=linear.get("head_dim", 128),
        kda_gate_rank=linear.get("head_dim", 128),
        kda_conv_size=linear.get("short_conv_kernel_size", 4),
        kda_gate="softplus",
        kda_output_gate_bias=False,
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_head_dim=hf.get("qk_nope_head_dim", 128),
        qk_pos_emb_head_dim=hf.get("qk_rope_head_dim", 64),
        v_head_dim=hf.get("v_head_dim", 128),
    )
    if moe:
        shared = hf.get("num_shared_experts", 1)
        fields.update(
            num_moe_experts=hf.get("num_experts", 256),
            moe_router_topk=hf.get("num_experts_per_token", 8),
            moe_ffn_hidden_size=hf.get("moe_intermediate_size", 1024),
            moe_shared_expert_intermediate_size=(hf.get("moe_intermediate_size", 1024) * shared) or None,
            moe_layer_freq=[int(t == "sparse") for t in mlp_types],
            moe_router_score_function="sigmoid",
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 2.446)),
        )
    return fields
