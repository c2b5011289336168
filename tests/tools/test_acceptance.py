"""tools/gpu/acceptance.py's judgement of a resume (it runs on the GPU; its rules are checked here on made-up losses)."""

import json
import statistics

import pytest

from tools.gpu import acceptance, acceptance_runs

ITERS = acceptance.RESUME_ITERS


def _losses(seed: float) -> dict[int, dict]:
    return {i: {"lm_loss": 5.0 - 0.05 * i + seed * 1e-3 * ((i * 7919) % 13)} for i in range(1, ITERS + 1)}


def _scaled(losses: dict[int, dict], factor: float, at=None) -> dict[int, dict]:
    return {i: {"lm_loss": r["lm_loss"] * (factor if at is None or i in at else 1.0)} for i, r in losses.items()}


def test_the_first_resumed_iteration_is_held_tighter_than_the_rest():
    reference, post = _losses(0.3), list(range(11, 17))
    assert acceptance.judge_losses(reference, reference, post, 1e-3)["passed"]
    assert acceptance.judge_losses(reference, _scaled(reference, 1 + 5e-3, at=post[1:]), post, 1e-3)["passed"]
    judged = acceptance.judge_losses(reference, _scaled(reference, 1 + 5e-3, at=post[:1]), post, 1e-3)
    assert not judged["passed"] and judged["first_rel_diff"] == pytest.approx(5e-3)


def test_a_resume_off_by_more_than_bf16_noise_fails():
    reference, post = _losses(0.3), list(range(14, 17))
    assert not acceptance.judge_losses(reference, _scaled(reference, 1 + 2e-2, at=post[-1:]), post)["passed"]
    # a wrong data position: each iteration scored on the batch before it
    shifted = {i: reference[i - 1] for i in post}
    assert not acceptance.judge_losses(reference, shifted, post)["passed"]


def test_only_the_first_updates_after_a_resume_are_judged():
    """bf16 noise grows step by step on the GPU: past the first JUDGED_UPDATES updates it is recorded, not judged;
    a lost optimizer state shows in the first updates and fails."""
    reference, post = _losses(0.3), list(range(11, 17))
    judged_end = post[acceptance.JUDGED_UPDATES]  # the last judged iteration
    late = acceptance.judge_losses(reference, _scaled(reference, 1 + 2e-2, at=[i for i in post if i > judged_end]),
                                   post, 1e-3)
    assert late["passed"] and late["unjudged_max_rel_diff"] == pytest.approx(2e-2)
    assert late["judged_iterations"] == post[:1 + acceptance.JUDGED_UPDATES]
    early = acceptance.judge_losses(reference, _scaled(reference, 1 + 2e-2, at=[judged_end]), post, 1e-3)
    assert not early["passed"] and early["later_max_rel_diff"] == pytest.approx(2e-2)


def test_a_missing_iteration_fails():
    reference = _losses(0.3)
    resumed = {i: reference[i] for i in range(11, 16)}  # 16 missing
    judged = acceptance.judge_losses(reference, resumed, list(range(11, 17)))
    assert not judged["passed"] and "16" in judged["why"]
    assert not acceptance.judge_losses(reference, reference, [])["passed"]


def test_merge_joins_the_calls_of_one_commit(tmp_path):
    first = {"commit": "abc", "date": "d1", "device": "x", "steps": [{"name": "resume", "passed": True},
                                                                     {"name": "gpu-tests", "passed": False}]}
    second = {"commit": "abc", "date": "d2", "device": "x", "steps": [{"name": "gpu-tests", "passed": True}]}
    paths = []
    for i, report in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(report))
    acceptance.merge([str(p) for p in paths], str(tmp_path / "out.json"))
    merged = json.loads((tmp_path / "out.json").read_text())
    assert {s["name"]: s["passed"] for s in merged["steps"]} == {"resume": True, "gpu-tests": True}
    second["commit"] = "def"
    paths[1].write_text(json.dumps(second))
    with pytest.raises(SystemExit, match="different commits"):
        acceptance.merge([str(p) for p in paths], str(tmp_path / "out2.json"))
    acceptance.merge([str(p) for p in paths], str(tmp_path / "out3.json"), mixed_commits=True)
    mixed = json.loads((tmp_path / "out3.json").read_text())
    assert {s["name"]: (s["passed"], s["commit"]) for s in mixed["steps"]} == {"resume": (True, "abc"),
                                                                              "gpu-tests": (True, "def")}
    assert mixed["commit"] == "def" and [c["commit"] for c in mixed["calls"]] == ["abc", "def"]


def test_steps_are_checked_and_groups_expand_before_anything_runs():
    names = acceptance.step_names("resume,balancers,gpu-tests")
    assert names == ["resume", *(f"balancer-{b}" for b in acceptance.BALANCERS), "gpu-tests"]
    with pytest.raises(SystemExit, match="unknown step.*bogus"):
        acceptance.step_names("resume,bogus")


def test_checkpoints_stay_in_the_tmpfs_folder_an_earlier_call_left(tmp_path, monkeypatch):
    """sigterm in a later call finds resume's checkpoint although that checkpoint leaves the tmpfs short of room."""

    tmpfs, work = tmp_path / "shm", tmp_path / "work"
    tmpfs.mkdir()
    monkeypatch.setattr(acceptance_runs, "TMPFS", tmpfs)
    monkeypatch.setattr(acceptance_runs, "TMPFS_MIN_FREE_GB", 1e9)  # never room for a new one
    assert acceptance_runs.checkpoint_root(work) == work / "checkpoints"
    (tmpfs / "acceptance-checkpoints" / "B").mkdir(parents=True)
    assert acceptance_runs.checkpoint_root(work) == tmpfs / "acceptance-checkpoints"
    monkeypatch.setattr(acceptance_runs, "TMPFS_MIN_FREE_GB", 0.0)
    (tmpfs / "acceptance-checkpoints" / "B").rmdir()
    (tmpfs / "acceptance-checkpoints").rmdir()
    assert acceptance_runs.checkpoint_root(work) == tmpfs / "acceptance-checkpoints"  # room: the tmpfs


def test_step_graph_judges_the_graphed_run_against_the_eager_one(tmp_path, monkeypatch):
    """The step's wiring on made-up runs: the flag reaches run G only, G's losses are judged against E's from
    iteration 2, the speeds are the medians of the second half."""
    iters = acceptance.GRAPH_ITERS
    eager = {i: {"lm_loss": r["lm_loss"], "tokens_per_sec": 100.0 + i} for i, r in _losses(0.3).items() if i <= iters}
    calls = []

    def fake_train(job, name, *flags, **kwargs):
        calls.append((name, flags))
        graphed = "--cuda-graph-step" in flags
        recs = {i: dict(r, lm_loss=r["lm_loss"] * (1 + off if graphed and i == 3 else 1),
                        tokens_per_sec=r["tokens_per_sec"] * (1.25 if graphed else 1)) for i, r in eager.items()}
        return {"rc": 0, "records": recs, "tail": "", "seconds": 1.0, "first_logged_s": 0.5, "last_logged_s": 0.9}

    monkeypatch.setattr(acceptance, "train", fake_train)
    job = acceptance.Job(work=tmp_path, checkpoints=tmp_path / "ckpt")
    off = 5e-3
    result = acceptance.step_step_graph(job)
    assert [(name, flags[0]) for name, flags in calls] == [("graph-E", "--no-cuda-graph-step"),
                                                           ("graph-G", "--cuda-graph-step")]
    second_half = [100.0 + i for i in range(iters // 2 + 1, iters + 1)]
    assert result["passed"] and result["judged_iterations"] == [2, 3, 4]
    assert result["tokens_per_sec_eager"] == pytest.approx(statistics.median(second_half))
    assert result["graph_vs_eager"] == pytest.approx(1.25)
    off = 2e-2  # the first replay off by more than bf16 noise
    assert not acceptance.step_step_graph(job)["passed"]


@pytest.mark.parametrize("name", ["RESUME_ITERS", "BALANCER_ITERS", "GRAPH_ITERS"])
def test_every_run_trains_past_the_shared_warm_up(name):
    """launch/train.py refuses a warm-up as long as the run: each step's --train-iters must exceed COMMON's."""
    common = acceptance_runs.COMMON
    warm_up = int(common[common.index("--lr-warmup-iters") + 1])
    assert getattr(acceptance, name) > warm_up


def _sigterm_job(tmp_path, monkeypatch, t2_losses):
    """A made-up sigterm step: C ran from B's checkpoint at 10; T stops at 19; T2 logs ``t2_losses``."""
    job = acceptance.Job(work=tmp_path, checkpoints=tmp_path / "ckpt")
    reference = _losses(0.3)
    (tmp_path / "C").mkdir(parents=True)
    (tmp_path / "C" / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": i, **r}) + "\n" for i, r in reference.items() if i > 10))
    (job.checkpoints / "B").mkdir(parents=True)
    (job.checkpoints / "B" / "latest_checkpointed_iteration.txt").write_text("10")

    def fake_train(job, name, *flags, **kwargs):
        if name == "T":
            (job.checkpoints / "T").mkdir(parents=True)
            (job.checkpoints / "T" / "latest_checkpointed_iteration.txt").write_text("19")
            recs = {i: reference[i] for i in range(11, 20)}
        else:
            recs = t2_losses
        return {"rc": 0, "records": recs, "tail": "", "seconds": 1.0, "first_logged_s": 0.5, "last_logged_s": 0.9,
                "signal_to_exit_s": 3.0}

    monkeypatch.setattr(acceptance, "train", fake_train)
    return acceptance.step_sigterm(job)


def test_sigterm_judges_the_signalled_run_and_that_the_resumed_one_goes_on(tmp_path, monkeypatch):
    """T2 continues T, which has drifted from C by then: its distance to C is recorded, not judged; an iteration
    missing after the resume or a non-finite loss fails the step."""
    drifted = {i: r for i, r in _scaled(_losses(0.3), 1.08).items() if i >= 20}
    result = _sigterm_job(tmp_path / "a", monkeypatch, drifted)
    assert result["passed"] and result["saved_at_iteration"] == 19
    after = result["after_resume"]
    assert after["max_rel_diff_to_C"] == pytest.approx(0.08)
    assert after["iterations"] == sorted(drifted)  # each shared iteration's two losses, for reading the distance
    assert after["losses_T2"] == [drifted[i]["lm_loss"] for i in after["iterations"]]
    assert after["losses_C"] == pytest.approx([v / 1.08 for v in after["losses_T2"]])
    gap = {i: r for i, r in drifted.items() if i != 21}
    assert not _sigterm_job(tmp_path / "b", monkeypatch, gap)["passed"]
    nonfinite = {**drifted, 25: {"lm_loss": float("nan")}}
    assert not _sigterm_job(tmp_path / "c", monkeypatch, nonfinite)["passed"]


def test_a_sigterm_records_the_running_step_as_interrupted_and_runs_no_more(tmp_path, monkeypatch):
    """The device call's time limit SIGTERMs the steps: the report keeps the finished step and the interrupted
    one (nothing lost), the rest do not start, the exit status says SIGTERM, and the handler is put back."""
    import argparse
    import os
    import signal
    import time

    ran = []

    def finished(job):
        ran.append("finished")
        return {"passed": True}

    def cut(job):
        ran.append("cut")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler's exception ends the sleep
        return {"passed": True}

    def never(job):
        ran.append("never")
        return {"passed": True}

    monkeypatch.setattr(acceptance, "STEPS", {"finished": finished, "cut": cut, "never": never})
    out = tmp_path / "acceptance.json"
    args = argparse.Namespace(out=str(out), work=str(tmp_path / "work"), config=str(acceptance.DEFAULT_CONFIG),
                              extra="", steps="finished,cut,never", commit="abc1234")
    before = signal.getsignal(signal.SIGTERM)
    assert acceptance.run_steps(args) == 128 + signal.SIGTERM
    assert ran == ["finished", "cut"] and signal.getsignal(signal.SIGTERM) is before
    steps = json.loads(out.read_text())["steps"]
    assert [(s["name"], s["passed"]) for s in steps] == [("finished", True), ("cut", False)]
    assert "interrupted by SIGTERM" in steps[1]["why"] and steps[1]["step_seconds"] < 20


def test_a_training_run_is_killed_when_its_step_is_interrupted(tmp_path, monkeypatch):
    """A run has its own session (a signal to the steps does not reach it): an exception in the loop that watches
    it (the SIGTERM handler's) kills it before going on, instead of leaving it training beside the next call."""
    import subprocess
    import sys

    import psutil

    started, popen = [], subprocess.Popen

    def sleeper(cmd, **kwargs):  # the run: a process that would outlive the step
        started.append(popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs))
        return started[-1]

    def interrupted(run_dir):
        raise acceptance.Interrupted("SIGTERM")

    monkeypatch.setattr(acceptance_runs.subprocess, "Popen", sleeper)
    monkeypatch.setattr(acceptance_runs, "records", interrupted)
    job = acceptance_runs.Job(work=tmp_path, checkpoints=tmp_path / "ckpt", config=acceptance.DEFAULT_CONFIG,
                              extra=())
    with pytest.raises(acceptance.Interrupted):
        acceptance_runs.train(job, "B", timeout=60)
    (run,) = started
    assert run.returncode == -9 and not psutil.pid_exists(run.pid)
