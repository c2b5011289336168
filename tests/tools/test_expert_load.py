"""tools/expert_load.py and the MoE TensorBoard output on the event files of real training runs.

Two short ``launch/train.py`` jobs (torchrun, 2 CPU ranks, the tiny config), run once per module:
EP2 (the ``make train`` layout) and PP2 (layers on two stages). The expected numbers are recomputed
here from the raw ``metrics.jsonl`` lines with plain Python, not with the tool's reader.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.moe.load_history import event_files, read_jsonl, read_run, read_tensorboard
from tools.expert_load import NUM_EXTREMES, compare, main, rank_table, summarize

ROOT = Path(__file__).resolve().parents[2]
ITERS, LOG_INTERVAL, IMAGES_INTERVAL = 20, 2, 10
MOE_LAYERS = [2, 3, 4]  # tiny.yaml: moe_layer_freq [0, 1, 1, 1]


def _train(out: Path, *flags: str) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--seq-length", "64", "--train-iters", str(ITERS), "--lr-warmup-iters", "2",
           "--log-interval", str(LOG_INTERVAL), "--log-images-interval", str(IMAGES_INTERVAL), "--eval-iters", "0",
           "--tensorboard-dir", str(out / "tensorboard"), "--metrics-dir", str(out), "--save", "", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ep2"))


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("pp2"), "--expert-model-parallel-size", "1",
                  "--pipeline-model-parallel-size", "2")


def _jsonl_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "split" not in r]


def _expected_from_jsonl(run: Path, ep_size: int) -> dict[int, dict]:
    """Per layer, what the report must say, straight from the jsonl lines."""
    records = _jsonl_records(run)
    last_counts = [r for r in records if "moe/tokens_per_expert" in r][-1]
    assert last_counts["iteration"] == ITERS == records[-1]["iteration"]
    expected = {}
    for layer in MOE_LAYERS:
        maxvio = [r[f"moe/maxvio/layer_{layer}"] for r in records]
        counts = last_counts["moe/tokens_per_expert"][str(layer)]
        mean = sum(counts) / len(counts)
        by_load = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        n = min(NUM_EXTREMES, len(counts) // 2)
        blocks = [sum(counts[r * len(counts) // ep_size:(r + 1) * len(counts) // ep_size]) for r in range(ep_size)]
        ranks = [r[f"moe/ep_most_loaded_rank/layer_{layer}"] for r in records]
        streak = len(ranks) - 1
        while streak > 0 and ranks[streak - 1] == ranks[-1]:
            streak -= 1
        expected[layer] = dict(
            maxvio_now=maxvio[-1], maxvio_min=min(maxvio), maxvio_max=max(maxvio),
            hottest=[(e, counts[e] / mean) for e in by_load[:n]],
            coldest=[(e, counts[e] / mean) for e in by_load[::-1][:n]],
            # EP = the whole world here, so the last step's counts give the ranks' loads directly.
            most_loaded_rank=blocks.index(max(blocks)), ep_load_now=max(blocks) / (sum(blocks) / ep_size),
            most_loaded_since=records[streak]["iteration"],
        )
    return expected


def _assert_summaries_match(summaries, expected):
    assert [s.layer for s in summaries] == MOE_LAYERS  # each layer once, also under PP
    for s in summaries:
        want = expected[s.layer]
        # TensorBoard keeps scalars in float32; per-expert counts are exact.
        for key in ("maxvio_now", "maxvio_min", "maxvio_max", "ep_load_now"):
            assert getattr(s, key) == pytest.approx(want[key], rel=1e-6), (s.layer, key)
        for key in ("hottest", "coldest"):
            assert [e for e, _ in getattr(s, key)] == [e for e, _ in want[key]], (s.layer, key)
            assert [x for _, x in getattr(s, key)] == pytest.approx([x for _, x in want[key]], rel=1e-12)
        assert (s.most_loaded_rank, s.most_loaded_since) == (want["most_loaded_rank"], want["most_loaded_since"])


def test_report_from_events_and_from_jsonl_equals_recomputation(ep2_run):
    expected = _expected_from_jsonl(ep2_run, ep_size=2)
    from_events = read_run(ep2_run, source="tensorboard")
    assert from_events.iterations == list(range(LOG_INTERVAL, ITERS + 1, LOG_INTERVAL))
    assert sorted(from_events.expert_load) == [IMAGES_INTERVAL, ITERS] and from_events.ep_size == 2
    _assert_summaries_match(summarize(from_events), expected)
    _assert_summaries_match(summarize(read_run(ep2_run, source="jsonl")), expected)
    # MaxVio of each snapshot equals the one recomputed from its per-expert counts.
    for record in (r for r in _jsonl_records(ep2_run) if "moe/tokens_per_expert" in r):
        for layer, counts in record["moe/tokens_per_expert"].items():
            mean = sum(counts) / len(counts)
            assert record[f"moe/maxvio/layer_{layer}"] == pytest.approx((max(counts) - mean) / mean, rel=1e-12)


def _event_accumulator(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_heatmap_is_a_readable_figure_and_rank_curves_average_to_one(ep2_run):
    from PIL import Image

    main_run = _event_accumulator(ep2_run / "tensorboard")
    images = main_run.Images("moe/load_heatmap")
    assert [i.step for i in images] == [IMAGES_INTERVAL, ITERS]
    for event in images:
        pixels = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        assert (event.width, event.height) == (1000, 560) and pixels.shape == (560, 1000, 3)
        assert pixels.std() > 20 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # drawn, not blank
    ranks = [_event_accumulator(ep2_run / "tensorboard" / f"rank_{r}") for r in (0, 1)]
    for layer in MOE_LAYERS:
        per_rank = [[e.value for e in acc.Scalars(f"moe/ep_rank_load/layer_{layer}")] for acc in ranks]
        factor = [e.value for e in main_run.Scalars(f"moe/ep_load_factor/layer_{layer}")]
        assert len(per_rank[0]) == len(factor) == ITERS // LOG_INTERVAL
        np.testing.assert_allclose(np.mean(per_rank, axis=0), 1.0, rtol=1e-6)  # over the mean of the two ranks
        np.testing.assert_allclose(np.max(per_rank, axis=0), factor, rtol=1e-6)


def test_ranks_table_equals_recomputation_from_jsonl(ep2_run):
    """--ranks reads every rank's own run; at the last step (an image step) each rank's load is its
    block of the jsonl's per-expert counts over the mean block, averaged over the layers."""
    last = _jsonl_records(ep2_run)[-1]["moe/tokens_per_expert"]
    now = {}
    for rank in (0, 1):
        per_layer = []
        for counts in last.values():
            half = len(counts) // 2
            blocks = [sum(counts[:half]), sum(counts[half:])]
            per_layer.append(blocks[rank] / (sum(blocks) / 2))
        now[rank] = sum(per_layer) / len(per_layer)
    rows = [line.split() for line in rank_table(ep2_run / "tensorboard").splitlines()[2:]]
    assert [int(r[0]) for r in rows] == sorted(now, key=lambda r: -now[r])  # most loaded first
    for r in rows:
        assert int(r[1]) == ITERS and float(r[2]) == pytest.approx(now[int(r[0])], abs=5e-4)  # printed to 3 places


def test_pipeline_parallel_layers_appear_once(pp2_run):
    history = read_run(pp2_run, source="tensorboard")
    assert history.layers == MOE_LAYERS and history.ep_size == 1
    assert all(sorted(load) == MOE_LAYERS for load in history.expert_load.values())
    _assert_summaries_match(summarize(history), _expected_from_jsonl(pp2_run, ep_size=1))
    # Each stage's rank run has its own layers only: stage 0 holds layers 1-2, stage 1 layers 3-4.
    own = [sorted(t for t in _event_accumulator(pp2_run / "tensorboard" / f"rank_{r}").Tags()["scalars"]
                  if t.startswith("moe/ep_rank_load/layer_")) for r in (0, 1)]
    assert own == [["moe/ep_rank_load/layer_2"], ["moe/ep_rank_load/layer_3", "moe/ep_rank_load/layer_4"]]


def test_a_growing_event_file_reads_up_to_its_last_whole_record(ep2_run, tmp_path):
    """A running job's files end in a partial record / line: the tool reads what is complete."""
    full = read_tensorboard(ep2_run / "tensorboard")
    (source,) = event_files(ep2_run / "tensorboard")
    data = source.read_bytes()
    shutil.copy(ep2_run / "metrics.jsonl", tmp_path / "metrics.jsonl")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 22, "moe/maxvio/lay')
    seen = set()
    for cut in (5, len(data) // 50, len(data) // 10, len(data) // 2, len(data) - 3):  # in a header, data or crc
        (tmp_path / source.name).write_bytes(data[:cut])
        partial = read_tensorboard(tmp_path)
        assert partial.iterations == full.iterations[:len(partial.iterations)]
        for tag, values in partial.scalars.items():
            assert all(full.scalars[tag][it] == v for it, v in values.items()), tag
        seen.add(len(partial.iterations))
    assert 0 in seen and any(0 < n < len(full.iterations) for n in seen), seen
    assert read_jsonl(tmp_path / "metrics.jsonl").iterations[-1] == ITERS


def test_progress_is_shown_for_large_event_files(ep2_run):
    out = io.StringIO()
    read_tensorboard(ep2_run / "tensorboard", progress_min_bytes=0, out=out)
    lines = out.getvalue().splitlines()
    assert lines and lines[-1].startswith("reading events.out.tfevents.") and "100% of" in lines[-1]
    quiet = io.StringIO()
    read_tensorboard(ep2_run / "tensorboard", out=quiet)  # a small file: no progress lines
    assert quiet.getvalue() == ""


def test_cli_report_compare_and_plot(ep2_run, pp2_run, tmp_path, capsys):
    from PIL import Image

    png = tmp_path / "load.png"
    main([str(ep2_run), "--plot", str(png)])
    text = capsys.readouterr().out
    for s in summarize(read_jsonl(ep2_run / "metrics.jsonl")):
        assert f"{s.layer:5d} | {s.maxvio_now:10.4f} {s.maxvio_min:7.4f} {s.maxvio_max:7.4f}" in text
    pixels = np.asarray(Image.open(png).convert("RGB"))
    assert pixels.shape == (900, 1000, 3) and pixels.std() > 20
    a, b = read_jsonl(ep2_run / "metrics.jsonl"), read_jsonl(pp2_run / "metrics.jsonl")
    table = compare(a, b, ("ep2", "pp2"))
    for sa, sb in zip(summarize(a), summarize(b)):
        assert f"{sa.layer:5d} |       {sa.maxvio_now:8.4f} {sa.maxvio_mean:7.4f} {sa.maxvio_max:7.4f} |" \
               f"       {sb.maxvio_now:8.4f}" in table
    main(["--compare", str(ep2_run), str(pp2_run), "--plot", str(tmp_path / "cmp.png")])
    assert capsys.readouterr().out.startswith(f"A = {ep2_run.name}: {ep2_run / 'metrics.jsonl'}\n")
    assert np.asarray(Image.open(tmp_path / "cmp.png")).shape[:2] == (900, 2000)


def _synthetic_step(rng, num_layers, num_experts, ep_size):
    """What collect_moe_metrics returns on the logging rank for random global counts (EP = all ranks)."""
    import torch

    from megatron_ext.moe.metrics import MoELayerMetrics, MoEStepMetrics, ep_rank_loads, max_violation

    layers = []
    for layer in range(1, num_layers + 1):
        counts = torch.from_numpy(rng.integers(0, 5000, size=num_experts))
        loads = ep_rank_loads(counts, ep_size)
        layers.append(MoELayerMetrics(
            layer=layer, maxvio=max_violation(counts), ep_load_factor=float(loads.max()),
            ep_most_loaded_rank=int(loads.argmax()), dropped=0, rerouted=int(rng.integers(0, 9)), bias_mean=None,
            bias_std=None, bias_min=None, bias_max=None, global_tokens_per_expert=counts.tolist()))
    return MoEStepMetrics(layers, ep_size=ep_size)


def test_ep64_with_256_experts_and_48_layers_reads_back_from_both_sources(tmp_path):
    """The largest layout the issue names, through MetricsLogger as the training loop calls it."""
    from megatron_ext.training.metrics_log import MetricsLogger

    rng = np.random.default_rng(0)
    logger = MetricsLogger(30, tensorboard_dir=str(tmp_path / "tensorboard"), metrics_dir=str(tmp_path),
                           print_fn=lambda *_: None)
    steps = {}
    for it in (10, 20, 30):
        steps[it] = moe = _synthetic_step(rng, num_layers=48, num_experts=256, ep_size=64)
        images = it != 20
        logger.log_iteration(it, consumed_samples=it, lm_loss=1.0, lr=1e-3, grad_norm=1.0, batch_size=1,
                             iteration_time_s=1.0, tokens_per_sec=1.0,
                             extra={**moe.scalars(), **(moe.expert_load_record() if images else {})})
        moe.log_tensorboard(logger, it, rank=0, global_logger=logger if images else None)
    logger.close()
    from_events, from_jsonl = read_run(tmp_path, "tensorboard"), read_run(tmp_path, "jsonl")
    assert from_events.ep_size == from_jsonl.ep_size == 64 and sorted(from_events.expert_load) == [10, 30]
    last = steps[30].layers
    for history in (from_events, from_jsonl):
        summaries = summarize(history)
        assert [s.layer for s in summaries] == list(range(1, 49))
        for s, m in zip(summaries, last):
            assert s.maxvio_now == pytest.approx(m.maxvio, rel=1e-6)
            assert s.most_loaded_rank == m.ep_most_loaded_rank and s.ep_load_now == pytest.approx(m.ep_load_factor)
            counts = np.asarray(m.global_tokens_per_expert, dtype=np.float64)
            assert s.hottest[0] == (int(counts.argmax()), pytest.approx(counts.max() / counts.mean()))
            assert s.rerouted == sum(step.layers[m.layer - 1].rerouted for step in steps.values())
    main([str(tmp_path), "--plot", str(tmp_path / "large.png")])
    from PIL import Image

    assert np.asarray(Image.open(tmp_path / "large.png")).shape[:2] == (900, 1000)
