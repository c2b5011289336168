"""Progress line, TensorBoard tags (Megatron-LM names), metrics.jsonl, histograms and images."""

import json
import random

import numpy as np
import pytest

from megatron_ext.training.metrics_log import MetricsLogger, format_progress_line, mfu


def _random_steps(seed, n):
    rng = random.Random(seed)
    return [dict(consumed_samples=8 * (i + 1), lm_loss=rng.uniform(2, 6), lr=rng.uniform(1e-5, 1e-3),
                 grad_norm=rng.uniform(0.1, 3), batch_size=8, iteration_time_s=rng.uniform(0.01, 1),
                 tokens_per_sec=rng.uniform(1e3, 1e5),
                 extra={"moe/maxvio": rng.uniform(0, 1), "moe/tokens_dropped": rng.randint(0, 9)})
            for i in range(n)]


def test_jsonl_and_tensorboard_record_every_logged_iteration(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = []
    log = MetricsLogger(100, tensorboard_dir=str(tmp_path / "tb"), metrics_dir=str(tmp_path / "m"),
                        print_fn=lines.append)
    steps = _random_steps(0, 4)
    for i, step in enumerate(steps, start=1):
        log.log_iteration(10 * i, flops_per_token=6e6, **step)
        # Flushed line by line: readable before close (as after a crash).
        records = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == i
    log.log_validation(40, 3.0, consumed_samples=32)
    counts = np.random.default_rng(0).integers(0, 100, size=(3, 8))
    log.add_histogram("moe/tokens_per_expert/rank0", counts[0], 40)
    log.add_image("moe/load_heatmap", np.random.default_rng(1).integers(0, 256, (24, 32, 3), dtype=np.uint8), 40)
    log.close()

    records = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    for i, (rec, step) in enumerate(zip(records, steps), start=1):
        assert rec["iteration"] == 10 * i
        for key in ("lm_loss", "lr", "grad_norm", "tokens_per_sec", "consumed_samples"):
            assert rec[key] == step[key]
        assert rec["moe/maxvio"] == step["extra"]["moe/maxvio"]
        assert rec["mfu"] is None and rec["tflops_per_gpu"] == pytest.approx(6e6 * step["tokens_per_sec"] / 1e12)
    assert records[-1] == {"iteration": 40, "split": "valid", "lm_loss": 3.0, "ppl": pytest.approx(np.exp(3.0))}

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "iteration-time", "throughput",
                "lm loss vs samples", "lm loss validation", "lm loss validation ppl", "moe/maxvio"):
        assert tag in tags["scalars"], tag
    assert [e.value for e in acc.Scalars("lm loss")] == pytest.approx([s["lm_loss"] for s in steps])
    assert [e.step for e in acc.Scalars("learning-rate vs samples")] == [s["consumed_samples"] for s in steps]
    assert "moe/tokens_per_expert/rank0" in tags["histograms"]
    assert "moe/load_heatmap" in tags["images"]
    assert len(lines) == 5 and lines[0].startswith(" iteration       10/     100 |")


def test_progress_line_has_megatron_fields():
    line = format_progress_line(7, 50, dict(consumed_samples=56, iteration_time_ms=123.45, lr=3e-4,
                                            batch_size=8, lm_loss=4.5, grad_norm=1.25,
                                            tokens_per_sec=9876.0, mfu=0.42, mem_gb=1.5))
    assert line == (" iteration        7/      50 | consumed samples:           56 |"
                    " elapsed time per iteration (ms): 123.5 | learning rate: 3.000E-04 |"
                    " global batch size:     8 | lm loss: 4.500000E+00 | grad norm: 1.250 |"
                    " tokens/s: 9876 | MFU: 42.0% | mem: 1.50 GB |")
    assert "MFU" not in format_progress_line(1, 2, dict(lm_loss=1.0, mfu=None))


def test_mfu_is_achieved_over_peak():
    rng = random.Random(1)
    flops, peak = rng.uniform(1e8, 1e10), rng.uniform(100, 1000)
    at_peak = peak * 1e12 / flops  # tokens/s that would saturate one GPU
    assert mfu(flops, at_peak, peak) == pytest.approx(1.0)
    assert mfu(flops, at_peak / 4, peak, num_gpus=2) == pytest.approx(0.125)
    with pytest.raises(ValueError):
        mfu(flops, 1.0, 0.0)


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(10, str(tmp_path / "tb"), str(tmp_path / "m"), enabled=False, print_fn=None)
    rec = log.log_iteration(1, **_random_steps(2, 1)[0])
    assert rec["iteration"] == 1 and not (tmp_path / "m").exists() and not (tmp_path / "tb").exists()


def test_bar_histogram_keeps_exact_heights_per_index(tmp_path):
    """Tokens per expert id go to TensorBoard as one histogram bucket per expert (read back exactly)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    heights = np.random.default_rng(3).integers(0, 10**9, size=256)
    log = MetricsLogger(10, tensorboard_dir=str(tmp_path))
    log.add_bar_histogram("moe/expert_load/layer_2", heights, 5)
    log.add_scalar("moe/ep_rank_load/mean", 1.25, 5)
    log.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    (event,) = acc.Histograms("moe/expert_load/layer_2")
    h = event.histogram_value
    assert event.step == 5 and list(h.bucket) == heights.tolist()
    assert list(h.bucket_limit) == [j + 0.5 for j in range(256)] and (h.min, h.max) == (-0.5, 255.5)
    assert h.num == heights.sum() and h.sum == pytest.approx((np.arange(256) * heights).sum())
    assert [(e.step, e.value) for e in acc.Scalars("moe/ep_rank_load/mean")] == [(5, 1.25)]
