"""Launchers: both parse with bash -n; the torchrun command line is built from the environment."""

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ROOT / "launch" / "torchrun.sh"
SBATCH = ROOT / "launch" / "slurm.sbatch"


@pytest.mark.parametrize("script", [TORCHRUN, SBATCH])
def test_bash_accepts_the_script(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def _dry_run(env, *args):
    out = subprocess.run(["bash", str(TORCHRUN), "--dry-run", *args], env={"PATH": os.environ["PATH"], **env},
                         capture_output=True, text=True, check=True)
    return shlex.split(out.stdout)


def test_torchrun_command_from_environment_and_defaults():
    cmd = _dry_run({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "node-a", "MASTER_PORT": "6000",
                    "GPUS_PER_NODE": "8", "PYTHON": "py"}, "--config", "configs/my run.yaml", "--lr", "1e-3")
    assert cmd == ["py", "-m", "torch.distributed.run", "--nnodes", "4", "--node-rank", "3",
                   "--nproc-per-node", "8", "--master-addr", "node-a", "--master-port", "6000",
                   str(ROOT / "launch" / "train.py"), "--config", "configs/my run.yaml", "--lr", "1e-3"]
    default = _dry_run({"GPUS_PER_NODE": "2"})
    assert default[3:12] == ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port"]


def test_torchrun_rejects_bad_environment():
    bad = subprocess.run(["bash", str(TORCHRUN), "--dry-run"], env={"PATH": os.environ["PATH"], "NNODES": "2",
                         "NODE_RANK": "2"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "NODE_RANK (2) must be < NNODES (2)" in bad.stderr


def _stub(directory: Path, name: str, body: str):
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_template_runs_one_torchrun_per_node_with_the_first_host_as_master(tmp_path):
    _stub(tmp_path, "scontrol", 'printf "gpu-17\\ngpu-18\\n"\n')
    # Fake srun: run the task once per node, as SLURM would, with its SLURM_NODEID.
    _stub(tmp_path, "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
                            'for n in 0 1; do SLURM_NODEID=$n "$@"; done\n')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[17-18]",
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(ROOT),
           "GPUS_PER_NODE": "8"}
    out = subprocess.run(["bash", str(SBATCH), "--dry-run", "--config", "c.yaml"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    commands = [shlex.split(line) for line in out if "torch.distributed.run" in line]
    assert len(commands) == 2
    for node, cmd in enumerate(commands):
        flags = dict(zip(cmd[3:13:2], cmd[4:13:2]))
        assert flags == {"--nnodes": "2", "--node-rank": str(node), "--nproc-per-node": "8",
                         "--master-addr": "gpu-17", "--master-port": str(20000 + 4242)}
        assert cmd[-2:] == ["--config", "c.yaml"]


def test_torchrun_runs_again_after_a_failure_at_most_max_restarts_times(tmp_path):
    # A stand-in for python: each run appends to a file; the first two fail, as torchrun does when a rank dies.
    _stub(tmp_path, "py", 'echo run >> "$RUNS"; (( $(wc -l < "$RUNS") > 2 ))\n')
    env = {"PATH": os.environ["PATH"], "PYTHON": str(tmp_path / "py"), "RUNS": str(tmp_path / "runs"),
           "GPUS_PER_NODE": "1"}
    once = subprocess.run(["bash", str(TORCHRUN)], env={**env, "MAX_RESTARTS": "1"}, capture_output=True, text=True)
    assert once.returncode == 1 and once.stderr.count("restart") == 1, once.stderr
    assert "torchrun.sh: torchrun failed (status 1); restart 1 of 1" in once.stderr
    (tmp_path / "runs").unlink()
    twice = subprocess.run(["bash", str(TORCHRUN)], env={**env, "MAX_RESTARTS": "3"}, capture_output=True, text=True)
    assert twice.returncode == 0 and (tmp_path / "runs").read_text().count("run") == 3, twice.stderr
    (tmp_path / "runs").unlink()
    never = subprocess.run(["bash", str(TORCHRUN)], env=env, capture_output=True, text=True)
    assert never.returncode == 1 and "restart" not in never.stderr  # MAX_RESTARTS defaults to 0


def test_slurm_template_restarts_all_nodes_together_after_a_failed_step(tmp_path):
    _stub(tmp_path, "scontrol", 'printf "gpu-1\\n"\n')
    # Fake srun: the first step fails; each step records the MAX_RESTARTS its tasks get.
    _stub(tmp_path, "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
                            'echo "step MAX_RESTARTS=$MAX_RESTARTS" >> "$STEPS"\n'
                            '(( $(wc -l < "$STEPS") > 1 )) || exit 1\n'
                            'SLURM_NODEID=0 "$@"\n')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-1", "SLURM_JOB_ID": "7",
           "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": str(ROOT), "GPUS_PER_NODE": "1", "STEPS": str(tmp_path / "steps")}
    out = subprocess.run(["bash", str(SBATCH), "--dry-run"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "slurm.sbatch: srun failed (status 1); restart 1 of 2" in out.stdout
    assert (tmp_path / "steps").read_text().splitlines() == ["step MAX_RESTARTS=0"] * 2
    assert sum("torch.distributed.run" in line for line in out.stdout.splitlines()) == 1
