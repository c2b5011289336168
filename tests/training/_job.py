"""The training job as a user runs it: launch/train.py with a small config, under torchrun on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--config", str(ROOT / "configs" / "tiny.yaml"),
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr-warmup-iters", "1", "--lr-decay-iters", "6", "--log-interval", "1",
    "--eval-iters", "0", "--tensorboard-dir", "",
]


def job_command(nproc: int, *flags: str, torchrun_flags: tuple[str, ...] = ()) -> list[str]:
    """launch/train.py with the small config and ``flags`` under torchrun with ``nproc`` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *torchrun_flags, str(ROOT / "launch" / "train.py"), *SMALL, *flags]


def launcher_job(nproc: int, port: int, *flags: str) -> tuple[list[str], dict[str, str]]:
    """The same job through launch/torchrun.sh: its command line and environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "GPUS_PER_NODE": str(nproc),
           "MASTER_PORT": str(port)}
    return ["bash", str(ROOT / "launch" / "torchrun.sh"), *SMALL, *flags], env


def run_job(nproc: int, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(job_command(nproc, *flags), capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)


def losses_of(metrics_dir: Path) -> dict[int, float]:
    """{iteration: lm_loss} from metrics.jsonl (each iteration must appear once)."""
    records = [r for r in map(json.loads, (metrics_dir / "metrics.jsonl").read_text().splitlines())
               if "lm_loss" in r and r.get("split") != "valid"]
    iterations = [r["iteration"] for r in records]
    assert len(iterations) == len(set(iterations)), f"iterations logged twice: {iterations}"
    return {r["iteration"]: r["lm_loss"] for r in records}


def train(tmp: Path, name: str, nproc: int, *flags: str) -> dict[int, float]:
    """Run launch/train.py under torchrun; return {iteration: lm_loss} from metrics.jsonl."""
    out = tmp / name
    result = run_job(nproc, "--metrics-dir", str(out), *flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return losses_of(out)
