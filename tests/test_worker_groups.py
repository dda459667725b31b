"""The suite's worker groups hold: under `--dist loadgroup` (`make test`) pytest-xdist
sends every test of an xdist_group to one worker, which it marks by the group's name
at the end of the test's id. A pytest and pytest-xdist pair that drops the mark would
split the Ray tests over the workers (two local Ray clusters competing for the CPUs and
ports) and start a module's shared stack once per worker (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("worker-groups-probe")
def test_a_grouped_test_carries_its_group_under_loadgroup(request: pytest.FixtureRequest
                                                          ) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@worker-groups-probe"), request.node.nodeid


def test_the_ray_modules_share_a_group(request: pytest.FixtureRequest) -> None:
    """tests/conftest.py marks them where the suite collects them, before pytest-xdist
    reads the marks."""
    ray_tests = [item for item in request.session.items
                 if item.module is not None and item.module.__name__ in {"test_ray", "test_soak"}]
    if not ray_tests:
        pytest.skip("the Ray tests are not collected in this run")
    for item in ray_tests:
        assert item.get_closest_marker("xdist_group").args == ("ray",), item.nodeid
        if getattr(request.config.option, "loadgroup", False):
            assert item.nodeid.endswith("@ray"), item.nodeid
