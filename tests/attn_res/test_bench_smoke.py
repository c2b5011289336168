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
        [sys.executable, str(root / "tools" / "bench_attnres.py"), "--smoke", "--ab-backward", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert KEYS <= set(result)
    for key in ("standard_step_ms", "attnres_step_ms", "attnres_main_backward_step_ms", "kernel_ms", "reference_ms"):
        assert result[key] > 0, key
    assert "Block AttnRes" in proc.stdout
