"""MLAttention (attention kind "M"): equals the MLA math written out with explicit loops over heads and
positions, and under TP2 (with and without sequence parallelism) equals one rank."""

import pytest
import torch

from megatron_ext.config import ConfigError, HybridConfig
from megatron_ext.layers.mla import LATENT_NORM_EPS, MLAttention
from tests._dist import run_distributed
from tests.kda import runner
from tests.parallel import harness

SEQ, BATCH, HIDDEN, HEADS = 12, 2, 24, 3
DIMS = dict(kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=7)


def mla_config(**overrides):
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, attention_pattern="M",
                  params_dtype=torch.float32, use_cpu_initialization=True, **DIMS)
    return HybridConfig(**{**fields, **overrides})




def reference_mla(x, p):
    """MLA with NoPE from its definition, one head and one query position at a time (fp64)."""
    dn, dr, dv, r = DIMS["qk_head_dim"], DIMS["qk_pos_emb_head_dim"], DIMS["v_head_dim"], DIMS["kv_lora_rank"]
    x = x.double()
    w = {k: v.double() for k, v in p.items()}
    out = torch.zeros(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    for b in range(BATCH):
        xb = x[:, b]
        q = (xb @ w["q_proj.weight"].T).view(SEQ, HEADS, dn + dr)
        latent = xb @ w["kv_a_proj.weight"].T
        c, k_shared = latent[:, :r], latent[:, r:]
        c = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + LATENT_NORM_EPS) * w["kv_a_norm.weight"]
        kv = (c @ w["kv_b_proj.weight"].T).view(SEQ, HEADS, dn + dv)
        heads = []
        for h in range(HEADS):
            k = torch.cat([kv[:, h, :dn], k_shared], dim=-1)
            v = kv[:, h, dn:]
            rows = []
            for t in range(SEQ):
                scores = (k[: t + 1] @ q[t, h]) / (dn + dr) ** 0.5
                rows.append(torch.softmax(scores, 0) @ v[: t + 1])
            heads.append(torch.stack(rows))
        out[:, b] = torch.cat(heads, dim=-1) @ w["o_proj.weight"].T
    return out


def test_mla_matches_reference(one_rank_megatron):
    torch.manual_seed(0)
    layer = MLAttention(mla_config())
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.3 * torch.randn_like(param))  # the norm starts at 1: make every weight random
    x = torch.randn(SEQ, BATCH, HIDDEN)
    out, bias = layer(x)
    assert bias is None
    expected = reference_mla(x, dict(layer.named_parameters()))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # The shared key part matters: changing it changes the output.
    with torch.no_grad():
        layer.kv_a_proj.weight[DIMS["kv_lora_rank"]:].mul_(2.0)
    assert not torch.allclose(layer(x)[0], out, atol=1e-4)


def test_mla_config_rejects_query_low_rank():
    with pytest.raises(ConfigError, match="q_lora_rank=16: only null"):
        mla_config(q_lora_rank=16)
    with pytest.raises(ConfigError, match="kv_lora_rank=0"):
        mla_config(kv_lora_rank=0)


def _gather_sequence(shards):
    return torch.cat(shards, dim=0)


def test_tp2_mla_layer_matches_one_rank(tmp_path):
    (one,) = run_distributed(runner.layer_reference, 1, str(tmp_path), "M")
    ranks = run_distributed(runner.layer_tensor_parallel, 2, str(tmp_path), "M")
    for sp in (True, False):
        results = [r[sp] for r in ranks]
        if sp:
            out = _gather_sequence([r["out"] for r in results])
            dx = _gather_sequence([r["dx"] for r in results])
        else:
            out, dx = results[0]["out"], results[1]["dx"]
        torch.testing.assert_close(out, one["out"], rtol=1e-4, atol=1e-5, msg=f"sp={sp} output")
        torch.testing.assert_close(dx, one["dx"], rtol=1e-4, atol=1e-5, msg=f"sp={sp} input grad")
        harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)


# The hybrid MoE model with MLA as its full attention (3 KDA : 1 MLA), one rank vs TP2 (SP) x EP2 and PP2.
HYBRID_MLA = dict(harness.HYBRID, attention_pattern="KKKM", kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4,
                  v_head_dim=5)


@pytest.mark.parametrize("world,layout", [
    (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2)),
    (2, dict(pipeline_model_parallel_size=2)),
], ids=["tp2-sp-ep2", "pp2"])
def test_hybrid_mla_model_layout_matches_one_rank(tmp_path, world, layout):
    ckpt = str(tmp_path)
    run_distributed(harness.save_reference, 1, ckpt, True, HYBRID_MLA)
    windows = harness.make_batches()
    (one,) = run_distributed(harness.run_layout, 1, {}, ckpt, True, windows, HYBRID_MLA)
    assert any(".self_attention.kv_b_proj." in key for key, *_ in one["grads"]), "the model has no MLA layer"
    results = run_distributed(harness.run_layout, world, layout, ckpt, True, windows, HYBRID_MLA)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - one["loss"]) < 1e-5 for l in losses), (losses, one["loss"])
    harness.assert_grads_match(one["grads"], results, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_mla_bf16_on_cuda_matches_fp32_cpu(one_rank_megatron):
    """Kimi-Linear-sized heads (keys 128 + 64, values 128: SDPA with a value dim unlike the key's) in bf16."""
    dims = dict(kv_lora_rank=64, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    config = HybridConfig(num_layers=1, hidden_size=256, num_attention_heads=4, attention_pattern="M",
                          params_dtype=torch.float32, use_cpu_initialization=True, **dims)
    torch.manual_seed(0)
    layer = MLAttention(config)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    x = torch.randn(256, 2, 256)
    expected, _ = layer(x)
    gpu, _ = layer.cuda().bfloat16()(x.cuda().bfloat16())
    scale = float(expected.abs().max())
    torch.testing.assert_close(gpu.float().cpu(), expected, rtol=0, atol=3e-2 * scale)
