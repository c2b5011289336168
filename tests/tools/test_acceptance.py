"""tools/gpu/acceptance.py's judgement of a resume (it runs on the GPU; its rules are checked here on made-up losses)."""

import json

import pytest

from tools.gpu import acceptance

ITERS = acceptance.RESUME_ITERS


def _losses(seed: float, drift: float = 0.0) -> dict[int, dict]:
    return {i: {"lm_loss": 5.0 - 0.05 * i + seed * 1e-3 * ((i * 7919) % 13) + drift * i} for i in range(1, ITERS + 1)}


def test_a_bitwise_training_needs_a_bitwise_resume():
    reference = _losses(0.3)
    before = {i: reference[i] for i in range(1, 16)}
    assert acceptance.compare_resume(reference, before, reference, 10)["bitwise"]
    off = {**reference, 20: {"lm_loss": reference[20]["lm_loss"] * (1 + 1e-7)}}
    assert not acceptance.compare_resume(reference, before, off, 10)["passed"]


def test_a_nondeterministic_training_allows_its_own_spread_only():
    reference = _losses(0.3)
    before = {i: {"lm_loss": reference[i]["lm_loss"] * (1 + 1e-4)} for i in range(1, 16)}
    close = {i: {"lm_loss": reference[i]["lm_loss"] * (1 + 2e-4)} for i in range(1, ITERS + 1)}
    far = {i: {"lm_loss": reference[i]["lm_loss"] * (1 + 1e-2)} for i in range(1, ITERS + 1)}
    assert acceptance.compare_resume(reference, before, close, 10)["passed"]
    assert not acceptance.compare_resume(reference, before, far, 10)["passed"]


def test_a_missing_iteration_fails():
    reference = _losses(0.3)
    resumed = {i: reference[i] for i in range(11, ITERS)}  # the last one missing
    assert not acceptance.compare_resume(reference, reference, resumed, 10)["passed"]


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


def test_steps_are_checked_and_groups_expand_before_anything_runs():
    names = acceptance.step_names("resume,balancers,gpu-tests")
    assert names == ["resume", *(f"balancer-{b}" for b in acceptance.BALANCERS), "gpu-tests"]
    with pytest.raises(SystemExit, match="unknown step.*bogus"):
        acceptance.step_names("resume,bogus")
