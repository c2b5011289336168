"""The AttnRes kernel benchmark script runs end to end in --smoke mode (CPU Triton interpreter)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_smoke_writes_agreeing_results(tmp_path):
    repo_root = Path(__file__).resolve().parents[2]
    out = tmp_path / "attnres-smoke.json"
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    cmd = [sys.executable, str(repo_root / "tools" / "bench_attnres_kernel.py"), "--smoke", "--sweep", "--out", str(out)]
    result = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert {"device", "date", "results"} <= report.keys()
    assert [s["n"] for s in report["sweep"]] == [2, 5, 9]
    assert [row["n"] for row in report["results"]] == [2, 5, 9]
    for row in report["results"]:
        assert {"T", "h", "kernel_ms", "reference_ms", "kernel_fwd_ms", "reference_fwd_ms"} <= row.keys()
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0
        assert max(row["max_rel_error"].values()) < 1e-5
