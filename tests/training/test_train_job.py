"""The training job end to end (torchrun, gloo, CPU): exact resume and resharded loading."""

import os
import subprocess
import sys

import pytest

from tests.training._job import ROOT, SMALL, train


def test_resume_is_exact(tmp_path, straight_run):
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "first_half", 2, "--train-iters", "3", "--save", ckpt, "--save-interval", "3")
    resumed = train(tmp_path, "resumed", 2, "--train-iters", "6", "--load", ckpt)
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed[it] == straight_run[it], (it, resumed[it], straight_run[it])


def test_one_rank_checkpoint_loads_into_tp2_pp2_ep2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    one_rank = ["--expert-model-parallel-size", "1"]
    train(tmp_path, "save", 1, *one_rank, "--train-iters", "2", "--save", ckpt)
    same = train(tmp_path, "same", 1, *one_rank, "--train-iters", "3", "--load", ckpt)
    resharded = train(
        tmp_path, "resharded", 4, "--train-iters", "3", "--load", ckpt,
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
    )
    assert resharded[3] == pytest.approx(same[3], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--hiden-size", "8"], "unknown config key 'hiden_size'"),
        (["--num-layers", "3", "--attn-res-num-blocks", "3", "--expert-model-parallel-size", "1",
          "--pipeline-model-parallel-size", "2"], "num_layers=3 is not divisible by pipeline"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(flags, message):
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *SMALL, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "WORLD_SIZE": "2"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]


def test_distributed_optimizer_trains_like_ddp(tmp_path):
    """DP2 with Megatron's distributed optimizer (sharded Adam state, reduce-scatter/all-gather)
    follows plain DDP + Adam step for step."""
    plain = train(tmp_path, "ddp", 2, "--train-iters", "3")
    sharded = train(tmp_path, "distopt", 2, "--train-iters", "3", "--use-distributed-optimizer")
    for it in (1, 2, 3):
        assert sharded[it] == pytest.approx(plain[it], rel=1e-5), (it, sharded[it], plain[it])
