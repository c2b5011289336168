"""How the acceptance steps (tools/gpu/acceptance.py) run ``launch/train.py``: one run with its logs, the signal it
gets and when, and the train records it logged. Standard library (and psutil) only, like the steps."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "h200.yaml"
TMPFS, TMPFS_MIN_FREE_GB = Path("/dev/shm"), 60
# A 10-iteration warm-up spiked the loss (4.9 -> 8.0 at iteration 13 on the H200), where run-to-run noise grows by
# orders of magnitude and no resume can be judged against it; the config's own 30 must stay below train_iters.
COMMON = ["--eval-iters", "0", "--lr-warmup-iters", "20"]


@dataclasses.dataclass(frozen=True)
class Job:
    """Where the steps run and what they train: ``work`` holds the runs' logs, ``checkpoints`` their checkpoints."""
    work: Path
    checkpoints: Path
    config: Path = DEFAULT_CONFIG
    extra: tuple[str, ...] = ()


def checkpoint_root(work: Path) -> Path:
    """The tmpfs when it has room for a checkpoint of the H200 model, else beside the logs. A tmpfs folder left by an
    earlier call on this machine is kept: the checkpoint in it (``sigterm`` starts from ``resume``'s) is what
    takes the room, and the steps remove what they no longer need before they save."""
    tmpfs_root = TMPFS / "acceptance-checkpoints"
    if tmpfs_root.is_dir() or (TMPFS.is_dir() and shutil.disk_usage(TMPFS).free / 1e9 >= TMPFS_MIN_FREE_GB):
        return tmpfs_root
    return work / "checkpoints"


def train(job: Job, name: str, *flags: str, nproc: int = 1, kill_after: int | None = None, sig=signal.SIGKILL,
          timeout: float = 300, on_first_log=None) -> dict:
    """launch/train.py, logging to ``job.work/name``. With ``kill_after``, ``sig`` goes to the job once
    metrics.jsonl holds that iteration: SIGKILL to every process under plain torchrun, as a node failure would;
    SIGTERM to ``launch/torchrun.sh`` alone, as SLURM's ``--signal`` reaches the batch script (torchrun.sh passes
    it to the workers; torchrun signalled itself would exit 1 and give them only its 30 s shutdown timeout).
    ``on_first_log()`` runs once the first iteration is logged. Returns the exit code, the wall time, the seconds at which the first and the last iteration were logged, the
    log's tail and {iteration: record} of the train records."""
    run_dir = job.work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier call on this machine
    run_dir.mkdir(parents=True)
    args = ["--config", str(job.config), *COMMON, *job.extra,
            "--metrics-dir", str(run_dir), "--tensorboard-dir", str(run_dir / "tb"), *flags]
    env = dict(os.environ)
    if sig == signal.SIGTERM:
        cmd = ["bash", str(ROOT / "launch" / "torchrun.sh"), *args]
        env.update(PYTHON=sys.executable, GPUS_PER_NODE=str(nproc), MASTER_PORT=str(free_port()))
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(ROOT / "launch" / "train.py"), *args]
    log = open(run_dir / "log.txt", "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    signalled, first_logged, last_logged, seen = None, None, None, 0
    try:
        while proc.poll() is None:
            if time.monotonic() - start > timeout:
                kill_tree(proc.pid, signal.SIGKILL)
                break
            logged = records(run_dir)
            if len(logged) > seen:
                seen, last_logged = len(logged), round(time.monotonic() - start, 1)
                if first_logged is None and on_first_log is not None:
                    on_first_log()
                first_logged = first_logged or last_logged
            if kill_after is not None and signalled is None and max(logged, default=0) >= kill_after:
                kill_tree(proc.pid, sig) if sig == signal.SIGKILL else os.kill(proc.pid, sig)
                signalled = time.monotonic()
            time.sleep(0.2)
    except BaseException:
        # The run has its own session (kill_after signals it alone), so a signal ending this process would not
        # reach it: without this it trained on beside the next call's runs on a warm machine.
        kill_tree(proc.pid, signal.SIGKILL)
        raise
    finally:
        proc.wait()
        log.close()
    text = (run_dir / "log.txt").read_text()
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - start, 1), "first_logged_s": first_logged,
            "signal_to_exit_s": round(time.monotonic() - signalled, 1) if signalled else None,
            "last_logged_s": last_logged, "tail": text[-3000:], "records": records(run_dir)}


def kill_tree(pid: int, sig) -> None:
    """``sig`` to ``pid`` and every process below it. torchrun's workers do not stay in its process group: a
    killpg left them training (and saving) beside the next run (seen on the H200 and the CPU). The caller reaps
    ``pid`` itself (psutil's wait would take its exit status: the JSON's killed_rc read 0)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in (parent, *children):
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timing(*runs: dict) -> list[dict]:
    return [{k: run[k] for k in ("seconds", "first_logged_s", "last_logged_s")} for run in runs]


def records(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "lm_loss" in record and record.get("split") != "valid":
            out[record["iteration"]] = record
    return out
