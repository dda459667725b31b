"""Settings for the whole suite.

The suite runs with the code's defaults whatever its runner exports: the SPECDEC_*
settings and OTEL_* variables of the runner's shell are removed from this process's
environment before any test module is imported, so the tests and the services and CLIs
they start see none of them (`user_settings`); a test that needs a value sets it.

Services and benches the tests start load the draft eager: with the default
`--draft-compile auto` each process would compile it (10-60 s on 2 cores).
tests/test_draft_compile.py and test_exactness.py compile it where that is the subject.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

# Kept from the runner's environment: where `specdec prepare` put the converted target
# (`make test` prepares it, then the tests load it from there; like HF_HOME and
# XDG_CACHE_HOME it says where files are, not what the code does), and the suite's own
# knobs (tests/test_fuzz.py).
KEPT_VARIABLES = frozenset({"SPECDEC_MODEL_CACHE", "SPECDEC_FUZZ_EXAMPLES",
                            "SPECDEC_FUZZ_REPORT"})
# Prefixes of the variables that change what the code does: every service setting
# (specdec/settings.py: SPECDEC_DTYPE, SPECDEC_DRAFT_COMPILE, ...), the variables the
# services hand their children, and the OpenTelemetry SDK's (OTEL_SDK_DISABLED, exporters).
REMOVED_PREFIXES = ("SPECDEC_", "OTEL_")


def user_settings(environ: Mapping[str, str]) -> list[str]:
    """The names in `environ` that the suite removes before it runs."""
    return sorted(name for name in environ
                  if name.startswith(REMOVED_PREFIXES) and name not in KEPT_VARIABLES)


for _name in user_settings(os.environ):
    del os.environ[_name]
os.environ["SPECDEC_DRAFT_COMPILE"] = "off"

# Under pytest-xdist (`make test` runs one worker per core) the workers share the CPUs:
# each gets an equal share for torch's threads, its own and those of the services it
# starts (`specdec up` would give each service every CPU), and OpenMP threads sleep
# rather than spin while they wait, as `specdec up` sets for its services. Pools that
# together hold more threads than cores wait on each other many times over: a forward
# at more threads than its share, beside a busy worker, takes longer, not shorter.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    os.environ["SPECDEC_TORCH_THREADS"] = _threads
    from specdec.serving.stack import SERVICE_THREAD_ENV  # the services' setting; loads no torch

    for _key, _value in SERVICE_THREAD_ENV.items():
        os.environ.setdefault(_key, _value)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group marks
def pytest_collection_modifyitems(items: list) -> None:
    """Tests that start a Ray instance run on one worker, one after another: two local Ray
    clusters on one machine compete for its CPUs and its default ports. That group is the
    suite's longest piece of work (several minutes), so it goes first: the workers take
    work in collection order, and a long piece taken last would leave the others idle at
    the end."""
    for item in items:
        if item.module is not None and item.module.__name__ in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))

    # Stable: the group's tests, then the others, each in collection order.
    items.sort(key=lambda item: item.module is None or item.module.__name__ not in RAY_MODULES)


RAY_MODULES = {"test_ray", "test_ray_capacity", "test_soak"}  # test_soak: `soak --ray`


@pytest.fixture(scope="session")
def _suite_torch_threads() -> int:
    """torch's threads before any test sets them: the worker's share under xdist."""
    import torch

    return torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored(_suite_torch_threads: int) -> Iterator[None]:
    """A test that sets torch's threads (to split a kernel's work as a service on every
    core does) sets them for itself: the worker's next test runs at its share again."""
    yield
    import torch

    if torch.get_num_threads() != _suite_torch_threads:
        torch.set_num_threads(_suite_torch_threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The EAGLE-3 tests' target: a tiny 3-layer Llama (vocabulary 32, seed 1) saved once
    per module."""
    import torch

    from tests.tiny_models import tiny_llama

    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("target")
    tiny_llama(32, seed=1, layers=3).save_pretrained(directory)
    return directory
