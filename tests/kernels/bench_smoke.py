"""Run a kernel benchmark script (``tools/dev/bench_*.py``) in its ``--smoke`` mode, in a subprocess (the script
turns Triton's CPU interpreter on before importing triton), and return the JSON report it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, out: Path, *flags: str, timeout: int = 300) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, str(REPO_ROOT / "tools" / "dev" / script), "--smoke", *flags, "--out", str(out)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(Path(out).read_text())
