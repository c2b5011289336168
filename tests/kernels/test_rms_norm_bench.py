"""The RMSNorm benchmark script runs end to end in --smoke mode (CPU Triton interpreter)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_smoke_writes_agreeing_results(tmp_path):
    repo_root = Path(__file__).resolve().parents[2]
    out = tmp_path / "rms-norm-smoke.json"
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    cmd = [sys.executable, str(repo_root / "tools" / "bench_rms_norm.py"), "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert {"device", "date", "timing", "results"} <= report.keys()
    assert [(r["rows"], r["h"], r["gated"]) for r in report["results"]] == [(37, 2048, False), (45, 128, False),
                                                                           (45, 128, True)]
    for row in report["results"]:
        assert row["kernel_fwd_ms"] > 0 and row["reference_fwd_bwd_ms"] > 0
        names = {"y", "dx", "dweight"} | ({"dgate"} if row["gated"] else set())
        assert set(row["max_rel_error"]) == names
        assert max(row["max_rel_error"].values()) < 1e-5
