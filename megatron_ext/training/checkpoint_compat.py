"""Whether a checkpoint's model fits the model of this run.

dist_checkpointing loads the tensors the model asks for by name, so a checkpoint of a deeper model
loads into a shallower one without complaint, and a changed width fails deep inside the loader.
The checkpoint's common state carries the merged config it was saved with; ``check_same_model``
compares the keys that decide parameter shapes or which kind of layer sits where, and refuses a
checkpoint that differs in any, naming each. Everything else may change on resume: the parallel
layout (checkpoints reshard), the batch, the schedule, balancer tuning, recomputation, kernels.
"""

from __future__ import annotations

from typing import Optional

from megatron_ext.errors import ConfigError

# Model keys that change parameter shapes or layer kinds (megatron_ext.config.USER_FIELDS).
STRUCTURAL_MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "attention_pattern",
    "position_embedding_type",  # no parameters, but a NoPE model resumed with RoPE is another model
    "vocab_size",
    "make_vocab_size_divisible_by",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "kda_num_heads",
    "kda_head_dim",
    "kda_gate",
    "kda_conv_size",
    "kda_gate_rank",
    "kda_output_gate_bias",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "attn_res",
    "attn_res_num_blocks",
    "attn_res_block_size",
)


def model_differences(saved: dict, current: dict) -> list[str]:
    """``["key: <saved> in the checkpoint, <current> now", ...]`` for the structural keys that differ
    (a key the checkpoint's config lacks is not compared)."""
    return [f"{key}: {saved[key]!r} in the checkpoint, {current.get(key)!r} now"
            for key in STRUCTURAL_MODEL_KEYS if key in saved and saved[key] != current.get(key)]


def check_same_model(checkpoint_path: str, saved: Optional[dict], current: dict) -> None:
    """Raise ``ConfigError`` naming every structural key in which ``saved`` (the checkpoint's config;
    None: saved without one, not checked) differs from ``current``."""
    differences = model_differences(saved or {}, current)
    if differences:
        raise ConfigError(
            f"load: {checkpoint_path} holds a different model ({'; '.join(differences)}); "
            "set those keys as saved, or start a new run without --load (the parallel layout may differ)"
        )
