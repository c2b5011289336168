"""tools/bench_e2e.py --smoke: every variant's training step on the CPU, the JSON, the profile table; the rows'
configs (launch/train.py's), options and fields."""

import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.e2e_results import format_table, median_rows, write_json
from tools.e2e_rows import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"name", "gpus", "seq", "step_ms", "optimizer_ms", "tokens_per_sec", "tflops", "mfu", "mfu_datasheet",
            "peak_gb"}
CAPACITY_ROWS = {"ours_full", "ours_full_16k"}


def _start(tmp_path, *flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "bench_e2e.py"), "--smoke", *flags],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_smoke_times_every_variant_and_profiles_one(tmp_path):
    out_json, out_md = tmp_path / "e2e.json", tmp_path / "profile.md"
    # The two runs are independent processes: run them side by side to halve the wall time.
    bench = _start(tmp_path, "--out", str(out_json))
    profile = _start(tmp_path, "--profile", "ours_full", "--profile-out", str(out_md))
    stdout = _finish(bench)
    _finish(profile)

    result = json.loads(out_json.read_text())
    assert {"rows", "device", "date", "peak_tflops_measured"} <= set(result) and result["device"] == "cpu"
    assert result["peak_tflops_measured"] > 0 and result["peak_tflops_datasheet"] == 989.0
    assert "datasheet" in result["peak_datasheet"]
    assert not {"qb_host_reads", "qb_cuda_graph", "qb_device_rounds"} & set(result)  # no such flags any more
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS) and list(rows)[:2] == ["stock", "stock_sdpa"]
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert "cleanup_error" not in row, (name, row["cleanup_error"])  # the next row would run beside it
        assert row["left_after_row"] is None  # the device memory a row leaves: CUDA only
        assert ROW_KEYS <= set(row) and row["gpus"] == 1
        assert row["tokens_per_sec"] > 0 and row["tflops"] > 0 and row["mfu"] > 0, name
        assert row["mfu_datasheet"] == pytest.approx(row["tflops"] / 989.0), name
        assert 0 < row["optimizer_ms"] <= row["step_ms"], name
        if name in CAPACITY_ROWS:  # capacity 1.25 suffices at the smoke shape: nothing dropped
            assert type(row["dropped"]) is int and type(row["rerouted"]) is int, name
            assert row["dropped"] == 0 and row["rerouted"] >= 0, name
            assert (row["qb_host_reads"], row["qb_cuda_graph"]) == (True, False)  # training's defaults on the CPU
        else:
            assert "dropped" not in row and "rerouted" not in row, name
    assert (rows["stock"]["attention"], rows["stock_sdpa"]["attention"]) == ("DotProductAttention", "SDPA")
    assert rows["stock_sdpa"]["flops_per_token"] == rows["stock"]["flops_per_token"]
    assert rows["ours_base_16k"]["seq"] == 2 * rows["ours_base"]["seq"]
    # One formula for every row: stock and ours_base have the same layers, so the same FLOPs.
    assert rows["stock"]["flops_per_token"] == rows["ours_base"]["flops_per_token"]
    assert rows["ours_full"]["flops_per_token"] != rows["ours_base"]["flops_per_token"]
    lines = stdout.rstrip().splitlines()
    assert lines[-1].split("|")[0].strip() == "ours_full_16k"  # the table is last
    header = [cell.strip() for cell in lines[-1 - len(rows)].split("|")]
    assert {"optim ms", "MFU meas.", "MFU 989", "dropped", "rerouted"} <= set(header)

    table = out_md.read_text()
    assert "ours_full" in table and "| 1 | `" in table and "| 30 | `" in table
    # the per-operator view names backward nodes
    assert "Top 40 operators" in table and "| bwd: " in table and "host-side entries" in table


def test_failed_row_is_shown_and_other_gpu_counts_are_kept(tmp_path):
    path = tmp_path / "e2e.json"
    ep2 = {"name": "stock", "gpus": 2, "seq": 64, "micro_batch": 2, "step_ms": 1.0, "tokens_per_sec": 1.0,
           "tflops": 1.0, "mfu": 0.1, "peak_gb": 1.0}
    failed = {"name": "stock", "gpus": 1, "seq": 64, "micro_batch": 2, "step_ms": None, "tokens_per_sec": None,
              "tflops": None, "mfu": None, "peak_gb": None, "error": "OutOfMemoryError: CUDA out of memory"}
    write_json(str(path), {"rows": [ep2], "date": "old"})
    write_json(str(path), {"rows": [failed], "date": "new"})
    merged = json.loads(path.read_text())
    assert merged["date"] == "new" and [r["gpus"] for r in merged["rows"]] == [2, 1]
    write_json(str(path), {"rows": [failed], "date": "newer"})  # same GPU count: replaced, not appended
    assert [r["gpus"] for r in json.loads(path.read_text())["rows"]] == [2, 1]
    assert "failed: OutOfMemoryError" in format_table([failed])


def test_median_rows_take_each_names_middle_run():
    def run(name, ms, round_, **extra):
        return dict(name=name, step_ms=ms, tokens_per_sec=None if ms is None else 1e3 / ms, round=round_, **extra)

    runs = [run("a", 10.0, 0), run("b", 5.0, 0), run("a", 12.0, 1), run("b", None, 1, error="OOM"),
            run("a", 11.0, 2), run("b", 7.0, 2), run("c", None, 0, error="boom")]
    rows = {r["name"]: r for r in median_rows(runs)}
    assert list(rows) == ["a", "b", "c"]
    assert rows["a"]["step_ms"] == 11.0 and rows["a"]["tokens_per_sec"] == 1e3 / 11.0  # the middle run, whole
    assert rows["a"]["step_ms_runs"] == [10.0, 12.0, 11.0] and "round" not in rows["a"]
    assert rows["b"]["step_ms"] == 5.0 and rows["b"]["step_ms_runs"] == [5.0, None, 7.0]  # lower middle of two
    assert rows["c"]["error"] == "boom" and rows["c"]["step_ms_runs"] == [None]


def test_smoke_repeat_reports_the_median_and_every_run(tmp_path):
    out_json = tmp_path / "e2e.json"
    stdout = _finish(_start(tmp_path, "--variants", "ours_base,stock", "--repeat", "3", "--commit", "abc1234",
                            "--out", str(out_json)))
    result = json.loads(out_json.read_text())
    assert (result["repeat"], result["commit"]) == (3, "abc1234")
    assert [r["name"] for r in result["rows"]] == ["ours_base", "stock"]
    assert [(r["name"], r["round"]) for r in result["runs"]] == [
        ("ours_base", 0), ("stock", 0), ("ours_base", 1), ("stock", 1), ("ours_base", 2), ("stock", 2)]
    for row in result["rows"]:
        times = [r["step_ms"] for r in result["runs"] if r["name"] == row["name"]]
        assert row["step_ms_runs"] == times and row["step_ms"] == sorted(times)[1]
    assert "ours_base: median of 3 rounds" in stdout


def test_rounds_done_survive_a_kill(tmp_path):
    """The JSON holds every finished round as soon as it is done: a time limit's kill loses only the round under way."""
    out_json = tmp_path / "e2e.json"
    proc = _start(tmp_path, "--variants", "ours_base", "--repeat", "50", "--out", str(out_json))
    deadline = time.monotonic() + 240
    while not out_json.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.kill()
    proc.communicate()
    result = json.loads(out_json.read_text())
    rounds = result["repeat"]
    assert 1 <= rounds < 50 and len(result["runs"]) == rounds
    assert [r["round"] for r in result["runs"]] == list(range(rounds))
    (row,) = result["rows"]
    assert row["step_ms_runs"] == [r["step_ms"] for r in result["runs"]] and row["step_ms"] > 0


def test_two_gpu_rows_get_their_scaling_efficiency(tmp_path):
    path = tmp_path / "e2e.json"
    one = {"name": "ours_base", "gpus": 1, "seq": 64, "tokens_per_sec": 1000.0}
    two = {"name": "ours_base", "gpus": 2, "seq": 64, "tokens_per_sec": 1800.0}
    two_stock = {"name": "stock", "gpus": 2, "seq": 64, "tokens_per_sec": 900.0}  # no one-GPU row: none
    write_json(str(path), {"rows": [one]})
    write_json(str(path), {"rows": [two, two_stock]})
    rows = {(r["name"], r["gpus"]): r for r in json.loads(path.read_text())["rows"]}
    assert rows[("ours_base", 2)]["scaling_efficiency"] == 0.9
    assert "scaling_efficiency" not in rows[("stock", 2)] and "scaling_efficiency" not in rows[("ours_base", 1)]


def test_option_rows_parse_with_repeats(capsys):
    from tools.bench_e2e import parse_args
    from tools.e2e_rows import GPU_SIZES, variant_shape

    args = parse_args(["--variants", "ours_full_16k,ours_full_16k+host-reads,ours_full_16k,ours_full_16k+host-reads"])
    assert args.variants == ["ours_full_16k", "ours_full_16k+host-reads"] * 2  # ABAB stays in order
    assert variant_shape("ours_full_16k+host-reads", GPU_SIZES) == variant_shape("ours_full_16k", GPU_SIZES)
    assert variant_shape("ours_full+host-reads", GPU_SIZES) == (GPU_SIZES["seq"], GPU_SIZES["micro_batch"])
    assert parse_args(["--smoke", "--variants", "ours_full+host-reads"]).variants == ["ours_full+host-reads"]
    assert parse_args(["--variants", "ours_base+step-graph,ours_full+step-graph"]).variants == [
        "ours_base+step-graph", "ours_full+step-graph"]
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--repeat", "0"])
    assert "--repeat must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--variants", "ours_base+step-graph"])
    assert "+step-graph replays the step from a CUDA graph: it needs a CUDA GPU" in capsys.readouterr().err
    for removed in (["--qb-cuda-graph", "on"], ["--qb-host-reads", "off"], ["--qb-device-rounds", "2"],
                    ["--stock-attention", "sdpa"]):
        with pytest.raises(SystemExit):
            parse_args(removed)
        assert "unrecognized arguments" in capsys.readouterr().err


def _config(name, monkeypatch):
    import torch.distributed as dist

    from tools.e2e_rows import SMOKE_SIZES, ours_config

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    return ours_config(name, SMOKE_SIZES, cuda=False)


def test_ours_rows_are_what_launch_train_builds_from_their_keys(tmp_path, monkeypatch):
    """The row's HybridConfig equals launch/train.py's from a YAML file of the row's keys: training's defaults."""
    import dataclasses

    import yaml

    from launch.train import model_section
    from megatron_ext.config import HybridConfig
    from megatron_ext.training.arguments import TRAINING_SECTIONS, load_config
    from tools.e2e_rows import SMOKE_SIZES, capacity_layout, row_config_keys

    for name in ("ours_base", "ours_full_16k"):
        row = _config(name, monkeypatch)
        seq = SMOKE_SIZES["long_seq" if name.endswith("_16k") else "seq"]
        yaml_file = tmp_path / f"{name}.yaml"
        yaml_file.write_text(yaml.safe_dump({**row_config_keys(name, SMOKE_SIZES), "seq_length": seq}))
        trained = load_config([*TRAINING_SECTIONS, model_section()], ["--config", str(yaml_file)],
                              world_size=1)[HybridConfig]
        differing = {f.name for f in dataclasses.fields(HybridConfig)
                     if not callable(getattr(row, f.name)) and getattr(row, f.name) != getattr(trained, f.name)}
        assert differing == set(), (name, differing)
    full = _config("ours_full", monkeypatch)
    defaults = HybridConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    assert (full.moe_qb_host_reads, full.moe_qb_cuda_graph) == (defaults.moe_qb_host_reads, defaults.moe_qb_cuda_graph)
    assert capacity_layout(full, True, None) == {"qb_host_reads": False, "qb_cuda_graph": True}  # one GPU
    assert full.moe_qb_device_rounds == defaults.moe_qb_device_rounds


def test_row_options_set_their_config_keys(monkeypatch):
    """Each ``+option`` changes exactly its keys of the ours_full row's config."""
    import dataclasses

    from tools.e2e_rows import OPTION_KEYS, SMOKE_SIZES, row_config_keys, split_variant

    name = "ours_full_16k+host-reads+torch-rounds"
    assert split_variant(name) == ("ours_full_16k", {"host-reads", "torch-rounds"})
    assert row_config_keys(name, SMOKE_SIZES)["moe_qb_host_reads"] is True
    plain = _config("ours_full", monkeypatch)
    for option, keys in OPTION_KEYS.items():
        if option == "step-graph":  # a training key (TrainingConfig), refused on the CPU: keys only
            assert keys == {"cuda_graph_step": True}
            continue
        config = _config(f"ours_full+{option}", monkeypatch)
        differing = {f.name for f in dataclasses.fields(config)
                     if not callable(getattr(config, f.name))  # init functions: a new closure per config
                     and getattr(config, f.name) != getattr(plain, f.name)}
        assert differing == set(keys), option
        assert all(getattr(config, key) == value for key, value in keys.items()), option


def test_capacity_counters_sum_the_timed_steps(monkeypatch, leaves_no_process_group):
    """With too little capacity pairs are dropped, and the count grows with the timed steps (warm-up excluded)."""
    from tools import bench_e2e, e2e_rows

    monkeypatch.setattr(e2e_rows, "CAPACITY_FACTOR", 0.5)
    dropped = {}
    for steps in (1, 2):
        args = bench_e2e.parse_args(["--smoke", "--variants", "ours_full", "--steps", str(steps), "--warmup", "1"])
        row = bench_e2e.run(args, log=lambda *a: None)["rows"][0]
        assert "error" not in row, row["error"]
        dropped[steps] = row["dropped"]
    assert dropped[1] > 0 and dropped[2] == 2 * dropped[1]


@pytest.fixture
def leaves_no_process_group():
    """bench_e2e.run joins a one-process gloo group in this process (and sets MASTER_PORT for it): leave the group
    and the environment as they were found, so later subprocesses pick their own port."""
    import torch.distributed as dist

    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.mark.parametrize("name,message", [("ours_full+fast", "unknown option '\\+fast'"),
                                          ("ours_base+host-reads", "applies to the ours_full\\* rows"),
                                          ("stock+step-graph", "applies to the ours\\* rows"),
                                          ("ours_full+graphed", "unknown option '\\+graphed'"),
                                          ("stock_sdpa+no-attnres", "applies to the ours_full\\* rows"),
                                          ("ours_full+eager", "unknown option '\\+eager'"),
                                          ("ours_full_16k@state-bv32", "unknown row")])
def test_unknown_or_misplaced_row_options_are_refused(name, message, capsys):
    from tools.bench_e2e import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--variants", name])
    assert re.search(message, capsys.readouterr().err)


def test_ours_rows_step_through_trainings_nan_guard(monkeypatch, leaves_no_process_group):
    """The ours rows update through training's NonFiniteGuard (its host read is part of their step): a model whose
    weights are NaN stops at the guard, before the update; the stock row has no guard and steps on."""
    import torch

    from tools import bench_e2e, e2e_rows

    real_setup = e2e_rows.variant_setup

    def poisoned_setup(name, args, cuda):
        setup = real_setup(name, args, cuda)

        def build():
            chunks = setup.build()
            with torch.no_grad():
                next(chunks[0].parameters()).fill_(float("nan"))
            return chunks

        return setup._replace(build=build)

    monkeypatch.setattr(bench_e2e, "variant_setup", poisoned_setup)
    args = bench_e2e.parse_args(["--smoke", "--variants", "ours_base,stock", "--steps", "1", "--warmup", "0"])
    rows = {row["name"]: row for row in bench_e2e.run(args, log=lambda *a: None)["rows"]}
    assert "non-finite loss or grad norm in a benchmark step" in rows["ours_base"]["error"]
    assert "error" not in rows["stock"], rows["stock"].get("error")


def test_merge_takes_each_rows_median_over_the_calls_of_one_commit(tmp_path):
    import random

    from tools.bench_e2e import main

    rng = random.Random(7)

    def row(name, gpus=1):
        ms = rng.uniform(90.0, 130.0)
        return dict(name=name, gpus=gpus, seq=64, micro_batch=2, step_ms=ms, optimizer_ms=1.0, tokens_per_sec=1e3 / ms,
                    tflops=1.0, mfu=0.1, mfu_datasheet=0.08, peak_gb=1.0)

    one_round = [{"commit": "abc", "date": f"d{i}", "rows": [row("ours_base"), row("ours_base", gpus=2)]}
                 for i in range(2)]
    repeated_runs = [dict(row("ours_base"), round=r) for r in range(3)] + [row("stock")]
    unrecorded = {"commit": None, "date": "d2", "repeat": 3, "rows": [], "runs": repeated_runs}  # an A/B's tree
    paths = []
    for i, result in enumerate([*one_round, unrecorded]):
        paths.append(tmp_path / f"call{i}.json")
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "merged.json"
    main(["merge", *map(str, paths), "--commit", "abc", "--out", str(out)])
    merged = json.loads(out.read_text())

    one_gpu = [r["rows"][0]["step_ms"] for r in one_round] + [r["step_ms"] for r in repeated_runs[:3]]
    rows = {(r["name"], r["gpus"]): r for r in merged["rows"]}
    assert rows["ours_base", 1]["step_ms"] == sorted(one_gpu)[2] and rows["ours_base", 1]["step_ms_runs"] == one_gpu
    assert rows["ours_base", 2]["step_ms_runs"] == [r["rows"][1]["step_ms"] for r in one_round]
    assert rows["stock", 1]["step_ms"] == repeated_runs[3]["step_ms"]
    assert merged["commit"] == "abc" and [c["date"] for c in merged["calls"]] == ["d0", "d1", "d2"]
    assert [r["call"] for r in merged["runs"]] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert rows["ours_base", 2]["scaling_efficiency"] > 0

    paths[0].write_text(json.dumps(dict(one_round[0], commit="def")))
    with pytest.raises(SystemExit, match="def"):
        main(["merge", *map(str, paths), "--commit", "abc", "--out", str(out)])


_CONTEXT_FAILURE_DRIVER = """
import sys
import tools.bench_e2e as bench

probes = []

def run_variant(name, args, cuda, profiler=None):  # ours_full's capture fails; the others time fine
    failed = name.startswith("ours_full")
    return {**bench.row_head(name, args), **{key: None if failed else 1.0 for key in bench.MEASURED_KEYS},
            **({"error": "capture failed"} if failed else {})}

def cuda_context_error():
    probes.append(1)
    return "AcceleratorError: an illegal memory access was encountered" if sys.argv[1] == "broken" else None

bench.run_variant, bench.cuda_context_error = run_variant, cuda_context_error
bench.main(["--smoke", "--variants", "ours_base,ours_full,stock", "--repeat", "2", "--out", sys.argv[2]])
print("probes", len(probes))
"""


@pytest.mark.parametrize("context", ["broken", "usable"])
def test_rows_after_a_failed_cuda_context_are_recorded_as_not_run(tmp_path, context):
    out = tmp_path / "e2e.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CONTEXT_FAILURE_DRIVER, context, str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    errors = [(r["name"], r.get("error")) for r in runs]
    if context == "broken":  # probed once, after ours_full; stock and round 2 not run, and say why
        assert "probes 1" in proc.stdout
        assert errors[:2] == [("ours_base", None), ("ours_full", "capture failed")]
        assert all(e.startswith("not run: the CUDA context failed after row ours_full (AcceleratorError")
                   for _, e in errors[2:]) and [n for n, _ in errors[2:]] == ["stock", "ours_base", "ours_full", "stock"]
        assert all(r["step_ms"] is None for r in runs[2:])
    else:  # a row's own failure: the next rows run
        assert "probes 2" in proc.stdout
        assert errors == [("ours_base", None), ("ours_full", "capture failed"), ("stock", None)] * 2
