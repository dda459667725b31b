"""`make install` asks for the CPU build of torch whatever the machine's pip config."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def planned(tmp_path: Path, *overrides: str) -> str:
    result = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}", *overrides],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_default_is_the_cpu_wheel_from_the_cpu_index(tmp_path: Path) -> None:
    plan = planned(tmp_path)
    torch_lines = [line for line in plan.splitlines() if "torch==" in line]
    # The local version pins the CPU build: a CUDA wheel can never satisfy it.
    assert torch_lines and all('"torch==2.13.0+cpu"' in line for line in torch_lines)
    assert '--extra-index-url "https://download.pytorch.org/whl/cpu"' in plan
    # torch comes before the package that depends on it.
    assert plan.index("torch==") < plan.index('-e ".[dev]"')


def test_a_gpu_build_is_a_variable_away(tmp_path: Path) -> None:
    plan = planned(tmp_path, "TORCH_SPEC=torch==2.13.0+cu128",
                   "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128")
    assert '"torch==2.13.0+cu128" --extra-index-url "https://download.pytorch.org/whl/cu128"' \
        in plan
    assert "--extra-index-url" not in planned(tmp_path, "TORCH_INDEX_URL=")
