"""A resumed job takes the checkpoint's LR schedule or the config's as the flags say, never one silently
(megatron_ext/training/schedule.py)."""

import json

import pytest
import torch

from megatron_ext.errors import ConfigError
from megatron_ext.training.schedule import build_scheduler, load_optimizer_and_schedule, schedule_differences
from megatron_ext.training.sections import CheckpointConfig, TrainingConfig
from tests.training._job import run_job


def _scheduler(**train):
    """A scheduler over an optimizer whose param group carries max_lr / min_lr, as Megatron's groups do."""
    values = {**dict(lr=1e-3, min_lr=1e-5, lr_warmup_iters=2, train_iters=20), **train}
    group = dict(params=[torch.nn.Parameter(torch.randn(3))], max_lr=values["lr"], min_lr=values["min_lr"])
    return build_scheduler(torch.optim.SGD([group], lr=0.0), TrainingConfig(**values))


def _saved_after(steps: int, **train) -> tuple[dict, dict]:
    """(optimizer state, scheduler state) of a job saved after ``steps`` steps."""
    scheduler = _scheduler(**train)
    scheduler.step(increment=steps)
    return scheduler.optimizer.state_dict(), scheduler.state_dict()


def _lr(scheduler) -> float:
    return scheduler.optimizer.param_groups[0]["lr"]


def test_a_changed_schedule_is_refused_naming_the_keys():
    optimizer_state, saved = _saved_after(5)
    scheduler = _scheduler(lr=3e-3, train_iters=40)
    with pytest.raises(ConfigError) as error:
        load_optimizer_and_schedule(scheduler.optimizer, scheduler, optimizer_state, saved, CheckpointConfig(),
                                    "ckpt/")
    message = str(error.value)
    assert "lr: config 0.003, checkpoint 0.001" in message
    assert "lr_decay_iters (null: train_iters): config 40, checkpoint 20" in message
    assert "--override-opt-param-scheduler" in message and "--use-checkpoint-opt-param-scheduler" in message
    assert scheduler.num_steps == 0  # refused before loading


@pytest.mark.parametrize("flag,wins", [("override_opt_param_scheduler", "config"),
                                       ("use_checkpoint_opt_param_scheduler", "checkpoint")])
def test_the_flag_picks_the_schedule_and_the_step_count_comes_from_the_checkpoint(flag, wins):
    optimizer_state, saved = _saved_after(10)
    lines = []
    scheduler = _scheduler(lr=3e-3, train_iters=40)
    load_optimizer_and_schedule(scheduler.optimizer, scheduler, optimizer_state, saved,
                                CheckpointConfig(**{flag: True}), "ckpt/", log=lines.append)
    assert scheduler.num_steps == 10
    config_run, checkpoint_run = _scheduler(lr=3e-3, train_iters=40), _scheduler()
    for run in (config_run, checkpoint_run):
        run.step(increment=10)
    assert _lr(config_run) != _lr(checkpoint_run)
    assert _lr(scheduler) == _lr(config_run if wins == "config" else checkpoint_run)
    scheduler.step(increment=5)  # and it stays on that schedule (the group's max_lr / min_lr)
    for run in (config_run, checkpoint_run):
        run.step(increment=5)
    assert _lr(scheduler) == _lr(config_run if wins == "config" else checkpoint_run)
    assert len(lines) == 1 and f"the {wins}'s" in lines[0], lines


def test_a_longer_run_with_a_fixed_decay_resumes_without_a_flag():
    """train_iters only sets the (constant) weight decay's steps once lr_decay_iters is given: not a difference."""
    optimizer_state, saved = _saved_after(5, lr_decay_iters=20)
    scheduler = _scheduler(lr_decay_iters=20, train_iters=40)
    assert schedule_differences(scheduler, saved) == []
    load_optimizer_and_schedule(scheduler.optimizer, scheduler, optimizer_state, saved, CheckpointConfig(), "ckpt/")
    assert scheduler.num_steps == 5


def test_both_flags_are_refused():
    with pytest.raises(ConfigError, match="override_opt_param_scheduler"):
        CheckpointConfig(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)


def test_the_training_job_stops_on_a_changed_lr_and_resumes_with_override(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "resumed"
    one_rank = ("--expert-model-parallel-size", "1")
    saved = run_job(1, *one_rank, "--train-iters", "2", "--save", str(ckpt))
    assert saved.returncode == 0, saved.stderr[-4000:]
    refused = run_job(1, *one_rank, "--train-iters", "3", "--load", str(ckpt), "--lr", "0.0123")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-4000:]
    assert "lr: config 0.0123" in errors[0] and "--override-opt-param-scheduler" in errors[0], errors[0]
    resumed = run_job(1, *one_rank, "--train-iters", "3", "--load", str(ckpt), "--lr", "0.0123",
                      "--override-opt-param-scheduler", "--metrics-dir", str(metrics))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    records = [json.loads(line) for line in (metrics / "metrics.jsonl").read_text().splitlines()]
    # warm-up 1, decay to step 6 (tests/training/_job.py): step 3 runs at the cosine of the new peak
    lr_3 = [r["lr"] for r in records if r.get("iteration") == 3 and "lr" in r]
    assert lr_3 and 1e-3 < lr_3[0] <= 0.0123, records
