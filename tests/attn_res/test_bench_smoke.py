"""tools/bench_attnres.py --smoke runs the benchmark's code path on the CPU and writes its JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

KEYS = {
    "standard_step_ms", "attnres_step_ms", "standard_peak_mem_gb", "attnres_peak_mem_gb",
    "kernel_ms", "reference_ms", "device", "date",
}


def test_bench_smoke_writes_json(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "attnres.json"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "bench_attnres.py"), "--smoke", "--ab-pair", "--rounds", "3",
         "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert KEYS <= set(result)
    for key in ("standard_step_ms", "attnres_step_ms", "kernel_ms", "reference_ms"):
        assert result[key] > 0, key
    # Interleaved timing: one median per round and model, headline = medians of all interleaved steps.
    rounds = result["round_ms"]
    assert len(rounds["standard"]) == len(rounds["attnres"]) == result["settings"]["rounds"] == 3
    assert min(rounds["standard"]) <= result["standard_step_ms"] <= max(rounds["standard"])
    ratios = sorted(a / s for a, s in zip(rounds["attnres"], rounds["standard"]))
    assert abs(result["overhead_round_median"] - (ratios[1] - 1)) < 1e-9
    assert len(rounds["attnres_unpaired"]) == 3 and result["attnres_unpaired_step_ms"] > 0
    assert set(result["host_ms"]) >= {"standard", "attnres"} and result["host_ms"]["attnres"] > 0
    assert result["settings"]["attn_res_pair_backward"] is True  # HybridConfig's default
    assert result["sequential"]["standard_step_ms"] > 0 and result["sequential"]["attnres_step_ms"] > 0
    assert "Block AttnRes" in proc.stdout


def test_config_bench_smoke_alternates_builds_and_writes_json(tmp_path):
    # tools/dev/bench_attnres_config.py --smoke: configs/tiny.yaml (AttnRes on) against attn_res: false, two
    # rounds of fresh builds; the headline is the median of each model's runs.
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "attnres-config.json"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(root / "tools" / "dev" / "bench_attnres_config.py"), "--smoke", "--rounds", "2",
         "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert KEYS - {"kernel_ms", "reference_ms"} <= set(result)
    runs = result["round_ms"]
    assert len(runs["standard"]) == len(runs["attnres"]) == result["settings"]["rounds"] == 2
    assert result["standard_step_ms"] == sum(runs["standard"]) / 2  # the median of two runs
    ratios = [a / s for a, s in zip(runs["attnres"], runs["standard"])]
    assert abs(result["overhead_round_median"] - (sum(ratios) / 2 - 1)) < 1e-9
    assert "configs/tiny.yaml" in result["settings"]["config_flags"]
    assert proc.stdout.count("> round") == 4
