"""The short-conv benchmark script runs end to end in --smoke mode (CPU Triton interpreter)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_smoke_writes_agreeing_results(tmp_path):
    repo_root = Path(__file__).resolve().parents[2]
    out = tmp_path / "short-conv-smoke.json"
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    cmd = [sys.executable, str(repo_root / "tools" / "bench_short_conv.py"), "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert {"device", "date", "timing", "results"} <= report.keys()
    assert [(row["s"], row["b"], row["C"]) for row in report["results"]] == [(21, 2, 48), (13, 1, 130)]
    for row in report["results"]:
        assert row["kernel_fwd_ms"] > 0 and row["reference_fwd_bwd_ms"] > 0 and row["K"] == 4
        assert max(row["max_rel_error"].values()) < 1e-5
