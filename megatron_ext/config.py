"""The model configuration: Megatron-Core's ``TransformerConfig`` plus our fields.

``HybridConfig`` is the one object the model builder reads. Fields Megatron already has keep
Megatron's names and meaning (``num_layers``, ``num_moe_experts``, ``moe_layer_freq``, ...); the
defaults below that differ from Megatron's describe the Kimi-style hybrid model (RMSNorm, SwiGLU,
no biases, no dropout, no fusions that need Apex or Transformer Engine). Our own fields are
grouped at the end, each with a comment.

Bad values raise :class:`ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


from megatron_ext.errors import ConfigError  # noqa: F401  (re-exported for callers)
from megatron_ext.moe.balancers import BALANCERS as MOE_BALANCERS, check_balancer_settings
from megatron_ext.moe.quantile_capacity import ROUNDS_IMPLS as MOE_QB_ROUNDS_IMPLS


# Attention kinds a layer pattern may use.
ATTENTION_KINDS = {
    "A": "full causal softmax attention (SDPA, NoPE)",
    "K": "Kimi Delta Attention (megatron_ext.kda)",
    "M": "multi-head latent attention, NoPE (megatron_ext.layers.mla), Kimi Linear's full attention",
}
KDA_GATES = ("lower_bound", "softplus")
# (lo, hi), both open: any finite negative bound. Bounds >= -5 take the kernel's dense diagonal-tile path
# (kimi_kernels.kda.dense_tiles_ok); below -5 its 16-token tiles would overflow fp32 there, so the kernel takes the
# per-position diagonal path instead (exact, slower: the softplus gate's path), decided once from the bound.
KDA_GATE_LOWER_BOUND_RANGE = (float("-inf"), 0.0)
POSITION_EMBEDDING_TYPES = ("none", "rope")


@dataclass
class HybridConfig(TransformerConfig):
    # --- Megatron fields with hybrid-model defaults -------------------------------------------
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-6
    add_bias_linear: bool = False
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Fusions that need Apex / Transformer Engine / CUDA-only JIT paths.
    gradient_accumulation_fusion: bool = False
    masked_softmax_fusion: bool = False
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    persist_layer_norm: bool = False
    apply_rope_fusion: bool = False
    # Batched p2p posts a stage's sends in one order and its peer's receives in another; with
    # two pipeline ranks (prev == next peer) that swaps activations and gradients of equal
    # shape under gloo. The unbatched path orders the ops by rank parity and is correct.
    batch_p2p_comm: bool = False
    # Our MoE layer keeps whole experts per rank (Megatron would default this to the TP size).
    expert_tensor_parallel_size: int = 1

    # --- Our fields --------------------------------------------------------------------------
    # Attention kind per layer, repeated cyclically over num_layers: "A" = full attention,
    # "K" = KDA. "KKKA" gives the 3:1 hybrid.
    attention_pattern: str = "A"
    # Tokenizer vocabulary (before padding) and the multiple the embedding is padded to. Unlike
    # Megatron-LM the multiple does not scale with the tensor-parallel size, so the padded
    # vocabulary (and every checkpoint) is the same under every layout.
    vocab_size: int = 257
    make_vocab_size_divisible_by: int = 128
    # Longest sequence the model is built for (NoPE: only bounds buffers and data).
    max_sequence_length: int = 4096
    # Positions: "none" (NoPE, the hybrid model's: the KDA layers carry position) or "rope" (Megatron's
    # RotaryEmbedding, as GPTModel applies it inside SelfAttention, on the full-attention "A" layers only; KDA
    # layers ignore it). For reference models such as the full-attention RoPE baseline of
    # tools/gmin_sweep.py; not with MLA ("M": NoPE by design).
    position_embedding_type: str = "none"
    rotary_base: int = 10000
    # MoE load balancing: none | aux_loss | sign_bias | qb_capacity | qb_bias | qb_both.
    moe_balancer: str = "none"
    # Histogram bins of the quantile balancers (capacity thresholds and the dual bias).
    moe_qb_num_bins: int = 1000
    # Capacity mode's rounds and host reads (megatron_ext/moe/quantile_capacity.py); None = decided per device:
    # on one CUDA rank no host reads, every round that can matter on the device (the Triton rounds skip those
    # after the last useful one) replayed from one CUDA graph per router, nothing dropped that reads would
    # place; on an EP group or the CPU, host reads.
    # moe_qb_device_rounds: with host reads, the overflow rounds run before the second read (None: 2); without,
    # the overflow rounds run at all (None: num_moe_experts, lossless; fewer drops a token that could move).
    moe_qb_device_rounds: int | None = None
    # false: capacity routing never reads the device (no host sync; one EP rank keeps static [N k] buffers).
    # true: rounds until nothing can move, reading between them.
    moe_qb_host_reads: bool | None = None
    # true (needs no host reads): one-rank capacity routing on CUDA replayed from a CUDA graph per router
    # (~10 launches on the Triton rounds, ~160 on the PyTorch ones -> 1); the eager call elsewhere.
    moe_qb_cuda_graph: bool | None = None
    # Capacity routing's rounds: "auto" = Triton kernels (kimi_kernels/moe_routing) on one CUDA rank, PyTorch ops on a
    # capacity group and off CUDA; "torch" = always the PyTorch ops (same routing; for A/B runs and as a fallback);
    # "triton" = always the kernels (one capacity rank only).
    moe_qb_rounds_impl: str = "auto"
    # KDA layers ("K" in attention_pattern). None means: heads = num_attention_heads,
    # head dim = kv_channels, gate rank = the KDA head dim.
    kda_num_heads: int | None = None
    kda_head_dim: int | None = None
    # Decay gate: "lower_bound" g = lb * sigmoid(exp(A_log) * (f + dt_bias)), or "softplus"
    # g = -exp(A_log) * softplus(f + dt_bias). kda_gate_lower_bound: any finite value < 0; in [-5, 0) the
    # kernel takes its dense diagonal-tile path, below -5 (where those tiles would overflow fp32) the
    # per-position one, as for softplus (slower; docs/kda.md, docs/gate_lower_bound.md).
    kda_gate: str = "lower_bound"
    kda_gate_lower_bound: float = -5.0
    kda_conv_size: int = 4
    kda_gate_rank: int | None = None
    # A bias on the output gate's up projection (ours so far). Kimi Linear has none (g_b_proj):
    # false for checkpoints that convert to Hugging Face's format.
    kda_output_gate_bias: bool = True
    # MLA layers ("M" in attention_pattern), Megatron's MLATransformerConfig names: heads are
    # num_attention_heads; q_lora_rank must stay None (Kimi Linear projects queries directly);
    # keys are qk_head_dim channels from the latent plus qk_pos_emb_head_dim channels shared by
    # all heads (not rotated: NoPE); values v_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Block Attention Residuals (DESIGN.md section 4, megatron_ext/attn_res): each sublayer's
    # input is a softmax over depth of the embedding, the finished block sums and the block's
    # partial sum. Blocks: attn_res_num_blocks N (must divide the 2 * num_layers sublayers;
    # N = 2 * num_layers is Full AttnRes), or attn_res_block_size S sublayers when set.
    attn_res: bool = False
    attn_res_num_blocks: int = 8
    attn_res_block_size: int | None = None
    attn_res_impl: str = "auto"  # depth-attention op: auto | triton | torch
    # Sum the grads of the embedding and the finished block sums (each read by every later depth
    # mix) in place in one buffer per source, instead of one tensor per mix added by autograd.
    attn_res_inplace_source_grads: bool = True
    # Fuse each sublayer's input RMSNorm (and the final norm) into the depth mix that feeds it:
    # one op returns Norm(mix), so no separate pass over [s, b, h] in forward or backward. The
    # norm modules and their weights stay as they are (same checkpoint keys); norms other than
    # megatron_ext.layers.norm.RMSNorm run separately.
    attn_res_fuse_norm: bool = True
    # With in-place source grads and the Triton kernels: the attention and MLP mixers of a layer
    # share one backward pass over the blocks both read (kimi_kernels/attn_res/pair.py).
    attn_res_pair_backward: bool = True
    # The LM loss through kimi_kernels.cross_entropy (megatron_ext/layers/lm_loss.py): the logits read once
    # forward and once backward, no fp32 copy of them. False: Megatron's vocab_parallel_cross_entropy.
    fused_cross_entropy: bool = True

    def __post_init__(self):
        self._validate_hybrid()
        # Layers of different attention kinds hold different parameters: checkpoint them per
        # layer (Megatron otherwise stacks every layer's tensors along one layer axis).
        if len({self.attention_kind(i) for i in range(self.num_layers)}) > 1:
            self.hetereogenous_dist_checkpoint = True
        super().__post_init__()
        from megatron_ext.attn_res.validation import set_attn_res_pipeline_fields

        set_attn_res_pipeline_fields(self)

    def _validate_hybrid(self):
        if not self.attention_pattern:
            raise ConfigError("attention_pattern must not be empty; e.g. 'A' or 'KKKA'")
        bad = sorted(set(self.attention_pattern) - set(ATTENTION_KINDS))
        if bad:
            allowed = ", ".join(f"{k!r} ({v})" for k, v in ATTENTION_KINDS.items())
            raise ConfigError(
                f"attention_pattern={self.attention_pattern!r} uses unknown kind(s) {bad}; "
                f"allowed: {allowed}"
            )
        if self.normalization != "RMSNorm":
            raise ConfigError(f"normalization={self.normalization!r}: only 'RMSNorm' is supported")
        if self.moe_balancer not in MOE_BALANCERS:
            raise ConfigError(f"moe_balancer={self.moe_balancer!r}; allowed: {', '.join(MOE_BALANCERS)}")
        if self.num_moe_experts:
            check_balancer_settings(self)
        self._validate_kda()
        self._validate_mla()
        self._validate_positions()
        from megatron_ext.attn_res.validation import validate_attn_res

        validate_attn_res(self, ConfigError)
        if self.moe_qb_num_bins < 2:
            raise ConfigError(f"moe_qb_num_bins={self.moe_qb_num_bins} must be >= 2")
        rounds = self.moe_qb_device_rounds
        if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0):
            raise ConfigError(f"moe_qb_device_rounds={rounds!r} must be an int >= 0 or null (the default)")
        for key in ("moe_qb_host_reads", "moe_qb_cuda_graph"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r} must be true, false or null (decided per device)")
        if self.moe_qb_rounds_impl not in MOE_QB_ROUNDS_IMPLS:
            raise ConfigError(f"moe_qb_rounds_impl={self.moe_qb_rounds_impl!r}; allowed: "
                              f"{', '.join(MOE_QB_ROUNDS_IMPLS)}")
        if self.moe_qb_cuda_graph and self.moe_qb_host_reads:
            raise ConfigError("moe_qb_cuda_graph: true needs moe_qb_host_reads: false (a CUDA graph cannot read "
                              "the device back to the host)")
        if self.moe_router_enable_expert_bias:
            raise ConfigError(
                "moe_router_enable_expert_bias is Megatron's own bias update; set "
                "moe_balancer='sign_bias' (or 'qb_bias') instead"
            )
        if not isinstance(self.fused_cross_entropy, bool):
            raise ConfigError(f"fused_cross_entropy={self.fused_cross_entropy!r} must be true or false")
        if self.vocab_size < 2:
            raise ConfigError(f"vocab_size={self.vocab_size} must be >= 2")
        if self.num_moe_experts is not None and self.moe_router_topk > self.num_moe_experts:
            raise ConfigError(
                f"moe_router_topk={self.moe_router_topk} exceeds num_moe_experts="
                f"{self.num_moe_experts}"
            )

    def _validate_kda(self):
        if self.kda_gate not in KDA_GATES:
            raise ConfigError(f"kda_gate={self.kda_gate!r}; allowed: {', '.join(KDA_GATES)}")
        lo, hi = KDA_GATE_LOWER_BOUND_RANGE
        if not lo < self.kda_gate_lower_bound < hi:
            raise ConfigError(
                f"kda_gate_lower_bound={self.kda_gate_lower_bound} must be a finite value < {hi} (-5, the "
                "default, is the lowest that keeps the kernel's dense diagonal tiles; lower bounds run the "
                "slower per-position path)"
            )
        if self.kda_head_dim is not None and not 16 <= self.kda_head_dim <= 256:
            raise ConfigError(f"kda_head_dim={self.kda_head_dim} must be in [16, 256] (kernel limit)")
        for key in ("kda_num_heads", "kda_gate_rank", "kda_conv_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{key}={value} must be >= 1")

    def _validate_mla(self):
        if self.q_lora_rank is not None:
            raise ConfigError(f"q_lora_rank={self.q_lora_rank}: only null is supported (MLA queries are "
                              "projected directly, as in Kimi Linear)")
        for key in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}={value!r} must be an int >= 1")
        if not isinstance(self.qk_pos_emb_head_dim, int) or self.qk_pos_emb_head_dim < 0:
            raise ConfigError(f"qk_pos_emb_head_dim={self.qk_pos_emb_head_dim!r} must be an int >= 0")
        if not isinstance(self.kda_output_gate_bias, bool):
            raise ConfigError(f"kda_output_gate_bias={self.kda_output_gate_bias!r} must be true or false")

    def _validate_positions(self):
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(f"position_embedding_type={self.position_embedding_type!r}; allowed: "
                              f"{', '.join(POSITION_EMBEDDING_TYPES)}")
        if self.position_embedding_type == "rope":
            if "M" in self.attention_pattern:
                raise ConfigError(f"position_embedding_type='rope' with MLA layers ('M' in attention_pattern="
                                  f"{self.attention_pattern!r}) is not supported: our MLA is NoPE")
            head_dim = self.kv_channels or (self.hidden_size // self.num_attention_heads)
            if head_dim % 2:
                raise ConfigError(f"position_embedding_type='rope' needs an even attention head dim "
                                  f"(kv_channels), got {head_dim}")
            if self.apply_rope_fusion:
                raise ConfigError("apply_rope_fusion needs Transformer Engine; leave it false")
        if not isinstance(self.rotary_base, int) or self.rotary_base < 2:
            raise ConfigError(f"rotary_base={self.rotary_base!r} must be an int >= 2")

    # --- Derived -----------------------------------------------------------------------------
    def attention_kind(self, layer_index: int) -> str:
        """Attention kind of the 0-based global layer ``layer_index``."""
        return self.attention_pattern[layer_index % len(self.attention_pattern)]

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether the 0-based global layer uses MoE, from Megatron's ``moe_layer_freq``."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return layer_index % freq == 0
        if len(freq) != self.num_layers:
            raise ConfigError(
                f"moe_layer_freq has {len(freq)} entries; it needs one 0/1 per layer "
                f"(num_layers={self.num_layers})"
            )
        return bool(freq[layer_index])

    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


# Fields a user may set from YAML / flags; the rest keep the defaults above.
USER_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "layernorm_epsilon",
    "init_method_std",
    "attention_pattern",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "max_sequence_length",
    "position_embedding_type",
    "rotary_base",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "moe_aux_loss_coeff",
    "moe_router_bias_update_rate",
    "moe_expert_capacity_factor",
    "moe_balancer",
    "moe_qb_num_bins",
    "moe_qb_device_rounds",
    "moe_qb_host_reads",
    "moe_qb_cuda_graph",
    "moe_qb_rounds_impl",
    "kda_num_heads",
    "kda_head_dim",
    "kda_gate",
    "kda_gate_lower_bound",
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
    "attn_res_impl",
    "attn_res_inplace_source_grads",
    "attn_res_fuse_norm",
    "attn_res_pair_backward",
    "fused_cross_entropy",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
)


def config_field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(HybridConfig)}


def default_dtype(bf16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float32
