"""A small random KimiLinearForCausalLM built by transformers and saved with save_pretrained imports into
our model: equal logits under one rank and under TP2 (SP) x EP2, then launch/train.py trains on from it.
Bad input fails naming the tensor or key."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.convert.hf_import import import_checkpoint
from megatron_ext.errors import ConfigError
from tests._dist import run_distributed
from tests.convert import workers
from tests.convert.hf import OURS_L2NORM, transformers_logits

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 384  # >= 257: the byte-level training data fits


def hf_config():
    return transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=5, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
        rms_norm_eps=1e-5, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                            "full_attn_layers": [3]})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The random model, every weight perturbed (norms start at 1, the correction bias at 0)."""
    out = tmp_path_factory.mktemp("hf_random")
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(hf_config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    model.save_pretrained(out)
    return out


def test_import_one_rank_and_tp2_ep2_equal_transformers_then_trains(hf_dir, tmp_path):
    tokens = torch.randint(0, VOCAB, (2, 72), generator=torch.Generator().manual_seed(1))
    theirs, _ = transformers_logits(hf_dir, tokens, l2norm=OURS_L2NORM)  # labelled: ours l2norm, see hf.py
    unpatched, _ = transformers_logits(hf_dir, tokens)
    layout = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2)
    ckpt = tmp_path / "ckpt"
    import_checkpoint(str(hf_dir), str(ckpt), layout, moe_balancer="qb_bias")
    (one,) = run_distributed(workers.logits, 1, str(ckpt), {}, tokens)
    scale = float(theirs.abs().max())
    assert float((one - theirs).abs().max()) <= 5e-6 * scale
    # transformers as shipped: the q/k l2norm eps weighs more here than after training (transformers' init
    # leaves |q|, |k| small); measured 3.2e-4 x max |logit|.
    assert float((one - unpatched).abs().max()) <= 1e-3 * scale
    ranks = run_distributed(workers.logits, 4, str(ckpt), layout, tokens)
    torch.testing.assert_close(ranks[0], one, rtol=1e-5, atol=1e-6 * scale)

    # launch/train.py continues from it under the layout written in the YAML (4 processes: TP2 x DP2, EP2).
    train_yaml = ckpt / "train.yaml"
    assert "tensor_model_parallel_size: 2" in train_yaml.read_text()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(ROOT / "launch" / "train.py"), "--config", str(train_yaml), "--train-iters", "2",
           "--lr-warmup-iters", "0", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--log-interval", "1", "--eval-iters", "0", "--metrics-dir", str(tmp_path / "metrics"),
           "--stdlib-max-mb", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    assert "resumed from" in result.stdout
    losses = [json.loads(l)["lm_loss"] for l in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()
              if "lm_loss" in l]
    assert len(losses) == 2 and all(0 < l < 20 for l in losses), losses


def _rewrite(hf_dir, out, edit_tensors=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    config = json.loads(Path(hf_dir, "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    Path(out, "config.json").write_text(json.dumps(config))
    return str(out)


KDA = "model.layers.1.self_attn"


@pytest.mark.parametrize("edit_tensors,edit_config,message", [
    (lambda t: t.pop(f"{KDA}.dt_bias"), None, f"missing tensor(s): {KDA}.dt_bias"),
    (lambda t: t.update({f"{KDA}.g_b_proj.bias": torch.randn(32)}), None, f"unexpected tensor(s) for this "
     f"config.json: {KDA}.g_b_proj.bias"),
    (lambda t: t.update({f"{KDA}.A_log": torch.randn(2)}), None, f"tensor {KDA}.A_log has shape [2]; the config "
     "implies [1, 1, 2, 1]"),
    (None, lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings=True is not supported"),
    (None, lambda c: c.update(num_expert_group=2, topk_group=1), "group-limited routing is not supported"),
    (None, lambda c: c.update(sliding_window=128), "unsupported key(s) ['sliding_window']"),
], ids=["missing", "extra", "shape", "tied", "groups", "unknown-key"])
def test_import_bad_input_names_the_tensor_or_key(hf_dir, tmp_path, edit_tensors, edit_config, message):
    bad = _rewrite(hf_dir, tmp_path / "bad", edit_tensors, edit_config)
    with pytest.raises(ConfigError) as err:
        import_checkpoint(bad, str(tmp_path / "ckpt"))
    assert message in str(err.value)


def test_import_refuses_a_bias_the_balancer_cannot_keep(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match="e_score_correction_bias is non-zero"):
        import_checkpoint(str(hf_dir), str(tmp_path / "ckpt"), moe_balancer="none")


def test_cli_refuses_a_layout_the_model_cannot_take(hf_dir, tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "import", str(hf_dir), str(tmp_path / "c"),
           "--tensor-model-parallel-size", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "num_attention_heads (4) must be a multiple of tensor_model_parallel_size (3)" in result.stderr
