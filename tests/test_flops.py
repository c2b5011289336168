"""megatron_ext/flops.py against a hand count of a small hybrid config."""

import pytest

from megatron_ext.config import HybridConfig
from megatron_ext.flops import flops_breakdown, model_flops_per_token


def small_config(**overrides):
    fields = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, attention_pattern="KA", kda_num_heads=2, kda_head_dim=32, kda_gate_rank=8,
        vocab_size=300, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_layer_freq=[0, 1], use_cpu_initialization=True,
    )
    return HybridConfig(**{**fields, **overrides})


def test_flops_match_a_hand_count():
    h, seq, vocab_padded = 64, 128, 384  # 300 padded to a multiple of 128
    # Layer 0: KDA (H=2, d=32, gate rank 8, chunk 64) + dense SwiGLU (f=96).
    kda = (2 * h * 3 * 2 * 32 + 2 * 2 * 32 * h  # q/k/v and output projections
           + 2 * 2 * (h * 8 + 8 * 2 * 32)  # low-rank decay gate and output gate
           + 2 * h * 2  # beta
           + 2 * (6 * 32 * 32 + 4 * 64 * 32))  # chunked kernel
    dense = 6 * h * 96
    # Layer 1: full attention (4 query heads, 2 KV groups, d=16) + MoE (E=4, k=2, f_e=24).
    attention = 2 * h * (4 + 2 * 2) * 16 + 2 * 4 * 16 * h + 2 * 4 * 16 * seq
    moe = 2 * h * 4 + 2 * 6 * h * 24
    output = 2 * h * vocab_padded
    cfg = small_config()
    assert flops_breakdown(cfg, seq) == {"attention": attention, "kda": kda, "mlp": dense + moe, "output": output}
    assert model_flops_per_token(cfg, seq) == 3 * (kda + dense + attention + moe + output)


def test_only_attention_depends_on_sequence_length():
    cfg = small_config(attention_pattern="A")
    short, long = flops_breakdown(cfg, 1024), flops_breakdown(cfg, 4096)
    assert long["attention"] - short["attention"] == pytest.approx(2 * (2 * 4 * 16 * 3072))
    assert {k: v for k, v in short.items() if k != "attention"} == {k: v for k, v in long.items() if k != "attention"}
