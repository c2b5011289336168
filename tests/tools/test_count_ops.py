"""tools/dev/count_ops.py: one ours_full step on the CPU is counted and attributed to known sources."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_count_ops_ours_full(tmp_path):
    out = tmp_path / "ops.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "dev" / "count_ops.py"), "--variant", "ours_full",
                           "--warmup", "1", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "total:" in proc.stdout and "[CPU ref]" in proc.stdout
    result = json.loads(out.read_text())
    total = result["total"]
    assert total["ops"] > 0 and 0 < total["cpu_ref_ops"] < total["ops"]
    assert all(total["phases"][p] > 0 for p in ("forward", "backward", "optimizer", "after_step"))
    sources = " ".join(r["source"] for r in result["rows"])
    for known in ("[TopKRouter]", "[KDAAttention]", "[DepthMixer]", "[MoELayer]", "<after_step>",
                  "megatron_ext/moe/router.py"):
        assert known in sources, known
    assert sum(r["ops"] for r in result["rows"]) == total["ops"]
