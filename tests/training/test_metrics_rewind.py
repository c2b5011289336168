"""A resumed run's logs: what was logged after the checkpoint goes, so every iteration appears once."""

import json

import pytest

from megatron_ext.training.metrics_log import MetricsLogger
from tests.training.test_metrics_log import _random_steps


def _log(logger, steps, first_iteration):
    for iteration, step in enumerate(steps, start=first_iteration):
        logger.log_iteration(iteration, **{**step, "consumed_samples": 8 * iteration})
        if iteration % 2 == 0:
            logger.log_validation(iteration, step["lm_loss"], 8 * iteration)


def test_a_resumed_logger_rewrites_jsonl_and_tensorboard_from_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "m")
    first, again = _random_steps(1, 6), _random_steps(2, 4)
    crashed = MetricsLogger(100, tensorboard_dir=tb, metrics_dir=metrics, print_fn=lambda _: None)
    _log(crashed, first, 1)
    crashed.close()
    with open(tmp_path / "m" / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 7, "lm_lo')  # torn by the crash
    # The checkpoint was of iteration 2: iterations 3..6 run again (with other values: other data order).
    resumed = MetricsLogger(100, tensorboard_dir=tb, metrics_dir=metrics, print_fn=lambda _: None,
                            resumed_iteration=2, resumed_samples=16)
    _log(resumed, again, 3)
    resumed.close()

    expected = {1: first[0]["lm_loss"], 2: first[1]["lm_loss"], **{i: s["lm_loss"] for i, s in enumerate(again, 3)}}
    records = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    train = [(r["iteration"], r["lm_loss"]) for r in records if r.get("split") != "valid"]
    assert train == sorted(expected.items())
    assert [r["iteration"] for r in records if r.get("split") == "valid"] == [2, 4, 6]

    events = EventAccumulator(tb)
    events.Reload()
    for tag, step_of in (("lm loss", lambda i: i), ("lm loss vs samples", lambda i: 8 * i)):
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == [step_of(i) for i in range(1, 7)], tag
        assert [e.value for e in scalars] == pytest.approx([expected[i] for i in range(1, 7)], rel=1e-6)
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4, 6]
