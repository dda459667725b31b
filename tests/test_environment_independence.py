"""The suite passes whatever environment its runner exports: caches in other folders
(HF_HOME, XDG_CACHE_HOME, XDG_STATE_HOME, SPECDEC_MODEL_CACHE, TORCHINDUCTOR_CACHE_DIR,
TORCH_EXTENSIONS_DIR, as many ML users set them) and service settings in the shell
(SPECDEC_DTYPE=float32, SPECDEC_DRAFT_COMPILE=on, OTEL_SDK_DISABLED=true, ...).

tests/conftest.py removes the settings; the tests that name a cache or a default path
compute it as the code does. The last test runs those tests again in a pytest of their
own under such an environment, so a test that asserts a machine's path or default fails
here, not on the first user's machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from specdec.config import serve_parser
from specdec.settings import SETTINGS
from specdec.telemetry.tracing import otlp_requested, sdk_disabled

ROOT = Path(__file__).resolve().parents[1]

# The folders a user points elsewhere; each gets a fresh empty one.
CACHE_VARIABLES = ("HF_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME", "SPECDEC_MODEL_CACHE",
                   "SPECDEC_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR")
# Settings a user exports for their own runs, each away from its default.
USER_SETTINGS = {"HF_HUB_OFFLINE": "1", "SPECDEC_DTYPE": "float32",
                 "SPECDEC_DRAFT_COMPILE": "on", "SPECDEC_BACKEND": "torch",
                 "SPECDEC_MAX_NEW_TOKENS_LIMIT": "16", "SPECDEC_NUM_DRAFT_TOKENS": "2",
                 "SPECDEC_METRICS_PORT": "9999", "SPECDEC_TRACE_TOKENS": "on",
                 "SPECDEC_TRACE_DIR": "/nonexistent/traces", "OTEL_SDK_DISABLED": "true",
                 "OTEL_TRACES_EXPORTER": "otlp"}
# Tests whose assertions involve a cache, a default path or the settings' defaults; they
# start no model, so they need no prepared target in the fresh cache.
ENVIRONMENT_SENSITIVE = (
    "tests/test_own_models.py::test_an_unknown_model_is_one_line_naming_it_and_the_cache",
    "tests/test_settings.py::test_markdown_table_lists_every_setting_and_matches_the_docs",
    "tests/test_settings.py::test_serve_flags_come_from_the_registry",
    "tests/test_observability_defaults.py::test_traces_default_to_the_state_directory",
    "tests/test_environment_independence.py::"
    "test_the_services_the_suite_starts_see_the_code_defaults",
)
EXPECTED_TESTS = 6  # test_own_models' test runs for two names


def test_the_services_the_suite_starts_see_the_code_defaults() -> None:
    """Every flag of `specdec serve` is at its registry default (the draft's compile at the
    suite's `off`, and under pytest-xdist the torch threads at the worker's share of the
    CPUs: tests/conftest.py), and tracing at the SDK's defaults, whatever the runner
    exported."""
    suite: dict[str, object] = {"draft-compile": "off"}
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        suite["torch-threads"] = max(1, (os.cpu_count() or 1) // workers)
    args = vars(serve_parser().parse_args(["target"]))
    for setting in SETTINGS.values():
        if setting.dest in args:
            assert args[setting.dest] == suite.get(setting.name, setting.default), setting.env
    assert not sdk_disabled() and not otlp_requested()


def test_the_environment_sensitive_tests_pass_with_fresh_caches_and_a_users_settings(
        tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if name != "HF_HUB_CACHE"}
    for name in CACHE_VARIABLES:
        folder = tmp_path / name.lower()
        folder.mkdir()
        env[name] = str(folder)
    env.update(USER_SETTINGS)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
         "--basetemp", str(tmp_path / "basetemp"), *ENVIRONMENT_SENSITIVE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (\w+)", summary)}
    assert result.returncode == 0 and counts.get("passed", 0) + counts.get("skipped", 0) \
        == EXPECTED_TESTS, f"{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
