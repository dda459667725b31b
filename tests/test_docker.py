"""Static checks of the container image definition (no Docker engine needed)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def venv_tool(name: str) -> Path:
    # The tools come from the dev extra, so they live beside the interpreter; PATH may
    # not include the venv (e.g. `.venv/bin/python -m pytest`).
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} not installed in the venv (pip install -e '.[dev]')")
    return path


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [str(venv_tool("hadolint")), "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_torch_pin_matches_makefile() -> None:
    # The image and `make install` must test the same torch.
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"TORCH_SPEC \?= torch==([^\s+]+)", makefile)  # the version, not +cpu
    assert pin, "Makefile no longer pins TORCH_SPEC"
    assert f"ARG TORCH_VERSION={pin.group(1)}" in DOCKERFILE.read_text()


def test_entrypoint_serves_a_role_and_runs_unprivileged() -> None:
    text = DOCKERFILE.read_text()
    assert 'ENTRYPOINT ["tini", "--", "specdec", "serve"]' in text
    assert 'CMD ["coordinator"]' in text
    runtime = text.split("AS runtime", 1)[1]
    assert re.search(r"^USER 10001", runtime, re.M), "runtime stage must not run as root"
    assert "RUN specdec prepare" in text, "the converted default target must be baked in"


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.replace("**/", "")):
            result = not negate
    return result


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "specdec", "specdec/cli.py", "coordinator",
                   "draft_service", "target_service"):
        assert not ignored(needed, patterns), f".dockerignore drops {needed}"
    for junk in (".venv", ".git", "tests", "specdec/__pycache__"):
        assert ignored(junk, patterns), f".dockerignore should drop {junk}"


def test_runtime_stage_has_a_compiler_for_the_draft() -> None:
    # SPECDEC_DRAFT_COMPILE=auto compiles the draft with inductor, which needs a C++
    # compiler where the server runs; without one the draft stays eager.
    runtime = DOCKERFILE.read_text().split("AS runtime", 1)[1]
    assert re.search(r"^ARG RUNTIME_COMPILER=g\+\+$", runtime, re.M)
    install = re.search(r"apt-get install [^\n]*", runtime)
    assert install and "${RUNTIME_COMPILER}" in install.group(0)
