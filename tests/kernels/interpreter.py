"""Run a kernel test module's CPU cases under Triton's interpreter, in a fresh subprocess.

``TRITON_INTERPRET=1`` must be set before triton is first imported, and other modules of the same
pytest run (the model, the other kernels) import it earlier. So a kernel test module marks its
interpreter cases with :data:`interpreter_case` and adds :func:`launcher_test`: in the parent run
the cases are skipped and the launcher runs the module in a subprocess with the interpreter on,
failing with the subprocess's report if any case fails or is skipped there. On a CUDA machine the
launcher is skipped (the cases run on the GPU only where they are marked ``gpu``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_case = pytest.mark.skipif(
    not INTERPRETED, reason="runs in its module's TRITON_INTERPRET=1 subprocess (see launcher_test)"
)


def launcher_test(module_file: str):
    """A test that runs ``module_file``'s interpreter cases in a subprocess."""

    @pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(),
                        reason="launches the CPU interpreter subprocess")
    def test_cases_under_interpreter():
        repo_root = Path(module_file).resolve().parents[2]
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo_root))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", module_file]
        result = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=900)
        report = result.stdout + result.stderr
        assert result.returncode == 0, report
        summary = report.strip().splitlines()[-1]
        # Every case ran in the subprocess: only the launcher itself may be skipped there.
        assert re.search(r"\b\d+ passed", summary) and not re.search(r"\b([2-9]|\d\d+) skipped", summary), report

    return test_cases_under_interpreter
