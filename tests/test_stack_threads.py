"""`specdec up` splits the host's CPUs between the draft and the target (specdec.serving.stack)."""

from __future__ import annotations

from specdec.serving.stack import co_located_threads, free_port, split_threads


def test_the_cpus_are_split_never_shared() -> None:
    assert co_located_threads(2) == {"draft": 1, "target": 1}
    assert co_located_threads(16) == {"draft": 4, "target": 12}
    for cpus in range(2, 65):
        split = co_located_threads(cpus)
        assert split["draft"] >= 1 and split["draft"] + split["target"] == cpus
    assert co_located_threads(1) == {"draft": 1, "target": 1}


def test_auto_threads_get_the_split_and_explicit_ones_win() -> None:
    auto = split_threads(["--torch-threads", "0"], {"coordinator": ["-v"]}, {}, 8)
    assert auto == {"coordinator": ["-v"], "draft": ["--torch-threads", "2"],
                    "target": ["--torch-threads", "6"]}
    assert split_threads([], {}, {}, 2)["target"] == ["--torch-threads", "1"]
    explicit = split_threads(["--torch-threads", "3"], {}, {}, 8)
    assert explicit == {}
    from_env = split_threads([], {}, {"SPECDEC_TORCH_THREADS": "2"}, 8)
    assert from_env == {}
    per_role = split_threads(["--torch-threads=0"], {"target": ["--torch-threads", "5"]},
                             {}, 8)
    assert per_role == {"target": ["--torch-threads", "5"], "draft": ["--torch-threads", "2"]}


def test_free_ports_are_never_handed_out_twice() -> None:
    """A stack picks every port (services, /metrics) before a child binds one, and the
    kernel readily offers a just-released port again: without memory, two of a thousand
    picks share a port often enough to fail a start now and then."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
