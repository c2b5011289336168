"""The training job under faults (torchrun, gloo, CPU): what a cluster job meets, and what it must do.

Self-resuming directories, diverging steps, SIGTERM, damaged checkpoints, a checkpoint of another model,
an unwritable --save, a missing data file, and a killed rank (launch/torchrun.sh restarts the job). Metrics must
hold every iteration once after a resume (``losses_of`` checks it).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._dist import free_port
from tests.training._job import ROOT, SMALL, job_command, launcher_job, losses_of, run_job, train


def _output(result) -> str:
    return result.stdout + result.stderr


def test_a_fresh_or_empty_load_dir_starts_from_scratch_and_resumes_itself(tmp_path):
    ckpt = tmp_path / "ckpt"  # does not exist yet: --load = --save, the self-resuming job
    first = run_job(2, "--train-iters", "2", "--save", str(ckpt), "--load", str(ckpt))
    assert first.returncode == 0, _output(first)[-4000:]
    assert f"no checkpoint in {ckpt}; starting from scratch" in first.stdout
    again = run_job(2, "--train-iters", "3", "--save", str(ckpt), "--load", str(ckpt))
    assert again.returncode == 0 and f"resumed from {ckpt} at iteration 2" in again.stdout, _output(again)[-4000:]
    (tmp_path / "empty").mkdir()
    empty = run_job(1, "--expert-model-parallel-size", "1", "--train-iters", "1", "--load", str(tmp_path / "empty"))
    assert empty.returncode == 0, _output(empty)[-4000:]


def _checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a dist checkpoint, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path.parent / f"{path.name}.pt"))
    state = torch.load(path.parent / f"{path.name}.pt", weights_only=False)

    def tensors(value, prefix=""):
        if isinstance(value, torch.Tensor):
            yield prefix, value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from tensors(v, f"{prefix}/{k}")

    return dict(tensors(state))


def test_a_nonfinite_step_is_not_applied_and_the_run_stops_before_saving_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Two pipeline stages: rank 0, which says it, holds no loss; the last stage shares it.
    result = run_job(2, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "1",
                     "--train-iters", "6", "--lr", "1e4", "--min-lr", "0", "--save", str(ckpt), "--save-interval", "3",
                     "--max-skipped-nonfinite-steps", "2")
    out = _output(result)
    assert result.returncode != 0, out[-4000:]
    # Searched in the whole output, not line by line: the two ranks share stdout, and an unbuffered print writes
    # its text and its newline apart, so the other rank's log line can end up in front of this message.
    skipped = re.findall(r"> iteration (\d+): lm loss ([^,]+),[^\n]*?the update was not applied", result.stdout)
    assert [int(iteration) for iteration, _ in skipped] == [3, 4], out[-4000:]
    losses = [float(loss) for _, loss in skipped]
    assert all(loss > 1e3 or not np.isfinite(loss) for loss in losses), skipped
    assert "error: iteration 5: lm loss" in result.stderr, out[-4000:]
    assert "stopping after 3 skipped step(s) (max_skipped_nonfinite_steps 2)" in result.stderr, out[-4000:]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000003"]  # after a skipped step: no NaN
    tensors = _checkpoint_tensors(ckpt / "iter_0000003")
    weights = {k: v for k, v in tensors.items() if v.is_floating_point()}
    assert any("expert_bias" in k for k in weights) and any("exp_avg" in k for k in weights)
    bad = [k for k, v in weights.items() if not v.isfinite().all()]
    assert not bad, bad  # weights, Adam moments and router biases: as after the one applied step


def _wait_for(condition, proc, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended early ({proc.returncode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _logged_iterations(metrics_dir: Path) -> int:
    path = metrics_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _start(cmd, env, log: Path) -> subprocess.Popen:
    # Own session, so the job's processes can all be cleaned up afterwards.
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout=400) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_finishes_the_step_saves_and_the_resume_continues_exactly(tmp_path, straight_run):
    ckpt, metrics, log = tmp_path / "ckpt", tmp_path / "signalled", tmp_path / "job.log"
    cmd, env = launcher_job(2, free_port(), "--train-iters", "50", "--save", str(ckpt), "--save-interval", "100",
                            "--metrics-dir", str(metrics))
    proc = _start(cmd, env, log)
    _wait_for(lambda: _logged_iterations(metrics) >= 2, proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher: what SLURM's --signal reaches through srun
    status = _finish(proc)
    text = log.read_text()
    assert status == 0, text[-4000:]
    stopped = [line for line in text.splitlines() if line.startswith("> SIGTERM: stopped after iteration")]
    assert len(stopped) == 1, text[-4000:]
    at = int(stopped[0].split()[5])
    assert stopped[0] == f"> SIGTERM: stopped after iteration {at} of 50; saved to {ckpt} at iteration {at}"
    assert 2 <= at < 50 and (ckpt / f"iter_{at:07d}" / "checksums.json").exists()
    logged = losses_of(metrics)
    assert sorted(logged) == list(range(1, at + 1))
    assert all(logged[it] == straight_run[it] for it in logged if it in straight_run)
    if at < 6:  # the resume continues with the uninterrupted run's losses
        resumed = train(tmp_path, "resumed", 2, "--train-iters", "6", "--load", str(ckpt))
        assert resumed == {it: straight_run[it] for it in range(at + 1, 7)}


def _damage(shard: Path) -> None:
    """Overwrite 4 KiB in the middle of ``shard`` with finite float32 values."""
    noise = np.random.default_rng(0).standard_normal(1024).astype(np.float32).tobytes()
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(noise)


def test_a_damaged_checkpoint_is_refused_for_the_previous_intact_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    one_rank = ("--expert-model-parallel-size", "1")
    first = train(tmp_path, "first", 1, *one_rank, "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2")
    _damage(ckpt / "iter_0000004" / "__0_0.distcp")
    result = run_job(1, *one_rank, "--train-iters", "4", "--load", str(ckpt), "--metrics-dir", str(tmp_path / "re"))
    assert result.returncode == 0, _output(result)[-4000:]
    assert (f"> refusing damaged checkpoint {ckpt}/iter_0000004 ({ckpt}/iter_0000004/__0_0.distcp: contents "
            "changed since the save (CRC-32 mismatch)); falling back to the previous one") in result.stdout
    assert f"resumed from {ckpt} at iteration 2" in result.stdout
    assert losses_of(tmp_path / "re") == {3: first[3], 4: first[4]}

    os.truncate(ckpt / "iter_0000002" / "__0_0.distcp", 1000)
    (ckpt / "iter_0000004" / "__0_0.distcp").unlink()
    none_left = run_job(1, *one_rank, "--train-iters", "5", "--load", str(ckpt))
    assert none_left.returncode != 0
    assert "error: no intact checkpoint to load" in none_left.stderr, _output(none_left)[-4000:]
    assert "iter_0000004/__0_0.distcp: missing" in none_left.stderr
    assert "iter_0000002/__0_0.distcp: 1000 bytes" in none_left.stderr


@pytest.mark.parametrize("changed,named", [
    (["--num-layers", "2", "--attention-pattern", "KK", "--moe-layer-freq", "0", "1", "--attn-res-num-blocks", "2"],
     ["num_layers: 4 in the checkpoint, 2 now", "attention_pattern: 'KKKA' in the checkpoint, 'KK' now",
      "moe_layer_freq: [0, 1, 1, 1] in the checkpoint, [0, 1] now", "attn_res_num_blocks: 4 in the checkpoint"]),
    (["--hidden-size", "128"], ["hidden_size: 64 in the checkpoint, 128 now"]),
])
def test_a_checkpoint_of_another_model_is_refused_naming_each_key(tmp_path_factory, changed, named):
    ckpt = tmp_path_factory.getbasetemp() / "other_model_ckpt"
    one_rank = ("--expert-model-parallel-size", "1")
    if not ckpt.exists():
        saved = run_job(1, *one_rank, "--train-iters", "1", "--save", str(ckpt))
        assert saved.returncode == 0, _output(saved)[-4000:]
    result = run_job(1, *one_rank, "--train-iters", "2", "--load", str(ckpt), *changed)
    assert result.returncode != 0
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "holds a different model" in error[0], _output(result)[-4000:]
    for text in named:
        assert text in error[0], error[0]


def test_an_unwritable_save_dir_fails_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *SMALL, "--expert-model-parallel-size", "1",
           "--train-iters", "2", "--save", str(blocker / "ckpt")]
    started = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, _output(result)[-3000:]
    assert f"error: save: cannot write checkpoints to {blocker / 'ckpt'}: Not a directory" in result.stderr
    assert "training from iteration" not in result.stdout and time.monotonic() - started < 120


@pytest.mark.parametrize("flags,named", [
    (["--data-path", "{tmp}/nope"], "error: {tmp}/nope.idx: missing (data_path entries are prefixes"),
    (["--tokenizer-json", "{tmp}/nope.json"], "error: tokenizer_json: tokenizer file {tmp}/nope.json does not exist"),
])
def test_a_missing_data_file_fails_in_one_line_naming_it(tmp_path, flags, named):
    flags = [f.format(tmp=tmp_path) for f in flags]
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *SMALL, "--expert-model-parallel-size", "1",
           "--train-iters", "2", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, _output(result)[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(named.format(tmp=tmp_path)), errors
    assert "Traceback" not in result.stderr, result.stderr[-3000:]

def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("restarter", ["torchrun.sh", "torchrun"])
def test_a_killed_rank_brings_the_job_back(tmp_path, straight_run, restarter):
    """torchrun.sh runs torchrun again (MAX_RESTARTS); torchrun's own --max-restarts restarts the workers,
    whose process groups then need a key space of their own (megatron_ext.training.rendezvous)."""
    ckpt, metrics, log = tmp_path / "ckpt", tmp_path / "metrics", tmp_path / "job.log"
    flags = ("--train-iters", "6", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
             "--metrics-dir", str(metrics))
    if restarter == "torchrun.sh":
        cmd, env = launcher_job(2, free_port(), *flags)
        proc = _start(cmd, {**env, "MAX_RESTARTS": "1"}, log)
    else:
        cmd = job_command(2, *flags, torchrun_flags=("--max-restarts=1",))
        proc = _start(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, log)
    _wait_for(lambda: _logged_iterations(metrics) >= 3 and (ckpt / "iter_0000002").exists(), proc)
    (torchrun,) = _children(proc.pid) if restarter == "torchrun.sh" else (proc.pid,)
    workers = _children(torchrun)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    status = _finish(proc)
    text = log.read_text()
    assert status == 0, text[-4000:]
    if restarter == "torchrun.sh":
        assert "torchrun.sh: torchrun failed (status 1); restart 1 of 1" in text, text[-4000:]
    assert text.count("> training from iteration") == 2 and f"> resumed from {ckpt} at iteration" in text
    assert losses_of(metrics) == straight_run  # 1..6, each once, as if nothing happened
