"""The compile tests again, against the Triton release of the GPU machine (3.6.0 with its torch 2.11), which CI's
venv does not have (torch from PyPI brings a newer one): register use, spills and vector widths differ between
releases (one of our kernels spilled 420 bytes with 3.6 and none with 3.8), and what runs on the H200 is 3.6's code.

``make test`` installs that release into ``.venv/device-triton`` (Makefile, ``DEVICE_TRITON``) and points
``KIMI_DEVICE_TRITON`` at it; this test runs every ``tests/kernels/*_compile.py`` in a subprocess with it first on
``sys.path``. Run outside ``make test`` without that variable, it is skipped and says how to run it.
"""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_TRITON = os.environ.get("KIMI_DEVICE_TRITON")

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiling JIT, not the interpreter"),
    pytest.mark.skipif(not DEVICE_TRITON, reason="KIMI_DEVICE_TRITON unset: `make test` installs the GPU machine's "
                                                 "Triton and sets it"),
]


def _device_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([DEVICE_TRITON, str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # the venv's release must not serve cached binaries
    return env


def test_compile_tests_pass_with_the_gpu_machines_triton(tmp_path):
    installed = glob.glob(os.path.join(DEVICE_TRITON, "triton-*.dist-info"))
    assert len(installed) == 1, f"{DEVICE_TRITON}: expected one triton-*.dist-info, found {installed}"
    expected = Path(installed[0]).name.removeprefix("triton-").removesuffix(".dist-info")
    env = _device_env(tmp_path)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == expected, f"the subprocess imported Triton {version}, not {DEVICE_TRITON}'s {expected}"

    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "kernels").glob("test_*_compile.py"))
    assert files, "no compile tests found"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"compile tests with Triton {version}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
