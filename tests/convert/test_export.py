"""A model trained by launch/train.py in the Kimi-Linear-compatible configuration exports to a directory
that transformers' own KimiLinearForCausalLM loads with no missing or unexpected keys, and whose logits
on random tokens equal ours (fp32, CPU).

Tolerance: max |ours - transformers| <= 5e-5 x max |logit|. The gap is the q/k L2 norm: transformers (as
fla) divides by sqrt(|x|^2 + 1e-6), ours by max(|x|, eps); with transformers' l2norm replaced by ours
(labelled below) the rest of the model agrees to 5e-6 (measured 1.7e-5 and 2.3e-6).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.config import HybridConfig
from megatron_ext.convert.kimi_config import to_kimi_config
from megatron_ext.errors import ConfigError
from tests._dist import run_distributed
from tests.convert import workers
from tests.convert.hf import OURS_L2NORM, transformers_logits

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--expert-model-parallel-size", "1", "--train-iters", "3", "--lr-warmup-iters", "1", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0",
         "--tensorboard-dir", ""]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """configs/kimi-linear-tiny.yaml trained 3 steps by launch/train.py (1 process), then exported."""
    tmp = tmp_path_factory.mktemp("kimi_tiny")
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs" / "kimi-linear-tiny.yaml"),
           *TRAIN, "--metrics-dir", str(tmp / "metrics"), "--save", str(tmp / "ckpt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    exported = run_tool("export", str(tmp / "ckpt"), str(tmp / "hf"), "--max-shard-size", "200KB")
    assert exported.returncode == 0, exported.stderr[-4000:]
    return tmp


def test_exported_files_are_the_released_layout(trained):
    hf = trained / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    config = json.loads((hf / "config.json").read_text())
    assert config["linear_attn_config"]["kda_layers"] == [1, 2, 3]  # 1-indexed
    assert config["linear_attn_config"]["full_attn_layers"] == [4]
    names = set(index["weight_map"])
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_conv1d.weight",
                 "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "model.layers.2.block_sparse_moe.shared_experts.down_proj.weight", "lm_head.weight"):
        assert name in names, name
    from safetensors import safe_open

    with safe_open(hf / index["weight_map"]["model.layers.0.self_attn.A_log"], "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.A_log").shape == (1, 1, 2, 1)
    bias_file = index["weight_map"]["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    with safe_open(hf / bias_file, "pt") as f:
        bias = f.get_tensor("model.layers.1.block_sparse_moe.gate.e_score_correction_bias")
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # qb_bias moved it in training


def test_transformers_loads_export_with_equal_logits(trained):
    tokens = torch.randint(0, 257, (2, 80), generator=torch.Generator().manual_seed(0))  # crosses a 64-chunk
    (ours,) = run_distributed(workers.logits, 1, str(trained / "ckpt"), {}, tokens)
    theirs, info = transformers_logits(str(trained / "hf"), tokens)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    scale = float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) <= 5e-5 * scale
    # Labelled: transformers with its q/k l2norm replaced by ours (x / max(|x|, 1e-12)): the rest agrees to 5e-6.
    patched, _ = transformers_logits(str(trained / "hf"), tokens, l2norm=OURS_L2NORM)
    assert float((ours - patched).abs().max()) <= 5e-6 * scale
    # And the comparison is sensitive: another token sequence gives other logits.
    assert float((ours - ours.roll(1, dims=1)).abs().max()) > 1e-2 * scale


TINY_KIMI = dict(num_layers=4, hidden_size=32, num_attention_heads=4, attention_pattern="KKKM", kda_num_heads=2,
                 kda_head_dim=16, kda_gate_rank=16, kda_gate="softplus", kda_output_gate_bias=False, kv_lora_rank=8,
                 qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, num_moe_experts=4, moe_router_topk=2,
                 moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1, 1, 1],
                 moe_router_score_function="sigmoid")


@pytest.mark.parametrize("override,message", [
    (dict(kda_gate="lower_bound"), "kda_gate='lower_bound'"),
    (dict(kda_output_gate_bias=True), "kda_output_gate_bias: true"),
    (dict(attention_pattern="KKKA"), "layer kind(s) ['A']"),
    (dict(moe_shared_expert_intermediate_size=None), "moe_shared_expert_intermediate_size=None"),
    (dict(attn_res=True, attn_res_num_blocks=4), "attn_res: true"),
])
def test_export_refuses_settings_the_format_cannot_hold(override, message):
    cfg = HybridConfig(use_cpu_initialization=True, **{**TINY_KIMI, **override})
    with pytest.raises(ConfigError, match=re.escape(message)):
        to_kimi_config(cfg, "float32")


def test_export_checks_the_checksums_and_skips_a_damaged_checkpoint(trained, tmp_path):
    """From a save directory a damaged newest checkpoint is named and the older intact one exported (the same
    bytes as the first export: it is a copy); a damaged checkpoint named directly stops the export."""
    import shutil

    save = tmp_path / "ckpt"
    shutil.copytree(trained / "ckpt", save)
    (newest,) = sorted(save.glob("iter_*"))
    older = save / "iter_0000001"
    shutil.copytree(newest, older)
    shard = max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)
    with open(shard, "r+b") as f:  # changed in place, same size: only the checksum sees it
        f.seek(shard.stat().st_size // 2)
        f.write(torch.randn(64).numpy().tobytes())

    exported = run_tool("export", str(save), str(tmp_path / "hf"), "--max-shard-size", "200KB")
    assert exported.returncode == 0, exported.stderr[-4000:]
    assert f"refusing damaged checkpoint {newest}" in exported.stdout
    assert f"{shard}: contents changed since the save (CRC-32 mismatch)" in exported.stdout
    assert f"exported {older} ->" in exported.stdout
    first = sorted(p.name for p in (trained / "hf").iterdir())
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == first
    for name in first:
        assert (tmp_path / "hf" / name).read_bytes() == (trained / "hf" / name).read_bytes(), name

    refused = run_tool("export", str(newest), str(tmp_path / "hf2"))
    assert refused.returncode == 2 and "no intact checkpoint to load" in refused.stderr
    assert f"{shard}: contents changed since the save (CRC-32 mismatch)" in refused.stderr
    assert not (tmp_path / "hf2" / "config.json").exists()
