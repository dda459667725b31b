"""`specdec up` gives the draft and the target every CPU of the host (specdec.serving.stack)."""

from __future__ import annotations

from specdec.serving.stack import co_located_threads, free_port, split_threads


def test_each_service_gets_every_cpu() -> None:
    for cpus in range(1, 65):
        assert co_located_threads(cpus) == {"draft": cpus, "target": cpus}


def test_auto_threads_get_every_cpu_and_explicit_ones_win() -> None:
    auto = split_threads(["--torch-threads", "0"], {"coordinator": ["-v"]}, {}, 8)
    assert auto == {"coordinator": ["-v"], "draft": ["--torch-threads", "8"],
                    "target": ["--torch-threads", "8"]}
    assert split_threads([], {}, {}, 2)["target"] == ["--torch-threads", "2"]
    explicit = split_threads(["--torch-threads", "3"], {}, {}, 8)
    assert explicit == {}
    from_env = split_threads([], {}, {"SPECDEC_TORCH_THREADS": "2"}, 8)
    assert from_env == {}
    per_role = split_threads(["--torch-threads=0"], {"target": ["--torch-threads", "5"]},
                             {}, 8)
    assert per_role == {"target": ["--torch-threads", "5"], "draft": ["--torch-threads", "8"]}


def test_free_ports_are_never_handed_out_twice() -> None:
    """A stack picks every port (services, /metrics) before a child binds one, and the
    kernel readily offers a just-released port again: without memory, two of a thousand
    picks share a port often enough to fail a start now and then."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
