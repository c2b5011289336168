"""The installed distribution ships only what users import, under names that clash with nothing on PyPI:
``kernels`` is Hugging Face's kernel hub package (``transformers`` imports it when present) and ``tools`` /
``launch`` are generic. Checked on the wheel itself; a fresh venv with the PyPI ``kernels`` package beside it was
checked by hand (README, "Development")."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_megatron_ext_and_kimi_kernels_only(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"megatron_ext", "kimi_kernels"}
    # every kernel folder travels (a missing __init__.py would drop one silently)
    shipped = {n.split("/")[1] for n in names if n.startswith("kimi_kernels/") and n.count("/") == 2}
    assert shipped == {p.name for p in (ROOT / "kimi_kernels").iterdir() if (p / "__init__.py").exists()}
