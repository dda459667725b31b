"""Settings for the whole suite.

Services and benches the tests start load the draft eager: with the default
`--draft-compile auto` each process would compile it (10-60 s on 2 cores).
tests/test_draft_compile.py and test_exactness.py compile it where that is the subject.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("SPECDEC_DRAFT_COMPILE", "off")

# Under pytest-xdist (`make test` runs one worker per core) the workers share the CPUs:
# each gets an equal share for torch's threads, and OpenMP threads sleep rather than spin
# while they wait, as `specdec up` sets for its services. Pools that together hold more
# spinning threads than cores wait on each other many times over.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _threads = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")


def pytest_collection_modifyitems(items: list) -> None:
    """Tests that start a Ray instance run on one worker, one after another: two local Ray
    clusters on one machine compete for its CPUs and its default ports."""
    for item in items:
        if item.module is not None and item.module.__name__ in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))


RAY_MODULES = {"test_ray", "test_ray_capacity", "test_soak"}  # test_soak: `soak --ray`


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
