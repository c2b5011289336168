"""Megatron -> Hugging Face -> Megatron is bit-exact: a checkpoint saved under TP2 (SP) x PP2 x EP2 (8
processes), exported, and imported under one rank holds the same global tensors, in fp32 and in bf16;
every expert is present once in the Hugging Face files, under its own id."""

import json
import re

import pytest
import torch

from megatron_ext.convert.dist_reader import DistCheckpointReader, one_rank_group
from megatron_ext.convert.export import export_checkpoint
from megatron_ext.convert.hf_import import import_checkpoint
from tests._dist import run_distributed
from tests.convert import workers

FIELDS = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=257,
              attention_pattern="KKMK", kda_num_heads=2, kda_head_dim=16, kda_gate_rank=16, kda_gate="softplus",
              kda_output_gate_bias=False, kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
              num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32,
              moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.446,
              moe_balancer="qb_bias", max_sequence_length=64, layernorm_epsilon=1e-5)
LAYOUT = dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
              expert_model_parallel_size=2)


def _all_tensors(path):
    with one_rank_group():
        reader = DistCheckpointReader(path)
        return reader.read(sorted(reader.tensors))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_round_trip_is_bit_exact(tmp_path, bf16):
    original, hf, back = tmp_path / "original", tmp_path / "hf", tmp_path / "back"
    run_distributed(workers.save_initial, 8, str(original), FIELDS, LAYOUT, bf16)
    export_checkpoint(str(original), str(hf), max_shard_bytes=64 * 2**10)
    import_checkpoint(str(hf), str(back), bf16=bf16)

    before, after = _all_tensors(str(original)), _all_tensors(str(back))
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype, key
        assert torch.equal(after[key], tensor), key
    assert before["decoder.layers.0.self_attention.A_log"].dtype == torch.float32  # fp32 even in bf16
    assert before["decoder.layers.1.mlp.router.expert_bias"].abs().sum() > 0

    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in (1, 2, 3):
        ids = sorted({int(m.group(1)) for name in weight_map
                      if (m := re.match(rf"model\.layers\.{layer}\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", name))})
        assert ids == [0, 1, 2, 3], (layer, ids)
        w1 = before[f"decoder.layers.{layer}.mlp.experts.w1"]  # [E, h, 2f], both EP ranks' halves
        for a in range(4):
            for b in range(a + 1, 4):
                assert not torch.equal(w1[a], w1[b]), (layer, a, b)
