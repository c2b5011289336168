"""The hybrid MoE model (KDA 3:1, quantile balancing, Block AttnRes) trains in bf16 on the GPU:
one H200 with configs/h200.yaml, and EP2 over two GPUs with configs/h200x2.yaml."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp: Path, config: str, nproc: int, iters: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs" / config),
        "--train-iters", str(iters), "--lr-warmup-iters", "2", "--log-interval", "1",
        "--eval-iters", "0", "--save", "", "--tensorboard-dir", str(tmp / "tb"),
        "--metrics-dir", str(tmp),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=dict(os.environ))
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stderr[-6000:]
    return [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def _check(records: list[dict], iters: int):
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == iters and all(math.isfinite(l) for l in losses)
    assert losses[-1] < losses[0], losses  # it learns
    assert records[-1]["tflops_per_gpu"] > 0


@pytest.mark.gpu
def test_bf16_training_on_one_gpu(tmp_path):
    _check(_train(tmp_path, "h200.yaml", 1, 12), 12)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ep2_training_on_two_gpus(tmp_path):
    _check(_train(tmp_path, "h200x2.yaml", 2, 8), 8)


@pytest.mark.gpu
def test_kimi_linear_config_trains_in_bf16_and_exports(tmp_path):
    """configs/kimi-linear-tiny.yaml (KDA softplus + MLA) on one GPU in bf16, then exported."""
    flags = ["--bf16", "--expert-model-parallel-size", "1", "--save", str(tmp_path / "ckpt")]
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs" / "kimi-linear-tiny.yaml"),
           "--train-iters", "12", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0",
           "--tensorboard-dir", "", "--metrics-dir", str(tmp_path), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == 12 and all(math.isfinite(l) for l in losses) and losses[-1] < losses[0], losses
    export = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "export",
                             str(tmp_path / "ckpt"), str(tmp_path / "hf")], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert export.returncode == 0, export.stderr[-4000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["linear_attn_config"]["full_attn_layers"] == [4]
