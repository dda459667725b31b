"""Replica discovery: spec parsing, DNS refresh, and rendezvous pinning of sessions."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from specdec.serving.discovery import (
    REFRESH_ENV,
    NoReplicaError,
    ReplicaSet,
    parse_endpoint_spec,
    rank,
    refresh_interval_from_env,
)

SESSIONS = [f"session-{i}" for i in range(4000)]


def replicas(n: int) -> list[str]:
    return [f"10.0.0.{i}:50052" for i in range(1, n + 1)]


def assignment(replica_set: ReplicaSet) -> dict[str, str]:
    return {s: replica_set.pick(s) for s in SESSIONS}


class FakeDNS:
    """A resolver whose answer the test changes, as pods come and go behind a name."""

    def __init__(self, answer: list[str]) -> None:
        self.answer = answer
        self.fail = False
        self.calls = 0

    def __call__(self, name: str, port: int) -> list[str]:
        self.calls += 1
        if self.fail:
            raise OSError("temporary failure in name resolution")
        return sorted(self.answer)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- parsing -------------------------------------------------------------------------


def test_static_list_is_parsed_sorted_and_deduplicated() -> None:
    spec = parse_endpoint_spec(" b:2, a:1 ,b:2,[::1]:3,")
    assert not spec.is_dns
    assert spec.static == ("[::1]:3", "a:1", "b:2")


def test_dns_spec_forms() -> None:
    spec = parse_endpoint_spec("dns:///specdec-draft-headless.default.svc.cluster.local:50052")
    assert spec.is_dns
    assert (spec.dns_name, spec.port) == ("specdec-draft-headless.default.svc.cluster.local", 50052)
    assert parse_endpoint_spec("dns:draft:7").dns_name == "draft"
    assert parse_endpoint_spec("dns:///draft", default_port=50052).port == 50052


@pytest.mark.parametrize("bad", ["", " , ", "host", "host:0", "host:x", "host:70000", ":5",
                                 "[::1", "dns://8.8.8.8/name:5", "dns:///name"])
def test_bad_specs_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint_spec(bad)


def test_refresh_interval_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REFRESH_ENV, "0.25")
    assert refresh_interval_from_env() == 0.25
    assert ReplicaSet("a:1").refresh_s == 0.25
    monkeypatch.setenv(REFRESH_ENV, "0")
    with pytest.raises(ValueError):
        refresh_interval_from_env()


# -- resolution ----------------------------------------------------------------------


def test_static_replica_set() -> None:
    with ReplicaSet("h1:50052,h2:50052") as replica_set:
        assert replica_set.endpoints() == ["h1:50052", "h2:50052"]
        assert replica_set.pick("s") in {"h1:50052", "h2:50052"}
        assert replica_set._thread is None  # nothing to re-resolve


def test_dns_of_localhost() -> None:
    with ReplicaSet("dns:///localhost:50052", refresh_s=60) as replica_set:
        found = replica_set.endpoints()
        assert found and set(found) <= {"127.0.0.1:50052", "[::1]:50052"}
        assert replica_set.pick("s") in found


def test_background_refresh_follows_dns() -> None:
    dns = FakeDNS(replicas(2))
    changes: list[list[str]] = []
    changed = threading.Event()

    def on_change(endpoints: list[str]) -> None:
        changes.append(endpoints)
        changed.set()

    with ReplicaSet("dns:///draft:50052", refresh_s=0.02, resolver=dns,
                    on_change=on_change) as replica_set:
        assert replica_set.endpoints() == replicas(2)
        changed.clear()
        dns.answer = replicas(3)
        assert changed.wait(5), "background refresh never saw the new replica"
        assert replica_set.endpoints() == replicas(3)
        assert changes[-1] == replicas(3)
    calls = dns.calls
    time.sleep(0.1)
    assert dns.calls == calls, "refresh thread still running after close()"


def test_dns_failure_keeps_last_known_replicas() -> None:
    dns = FakeDNS(replicas(3))
    replica_set = ReplicaSet("dns:///draft:50052", resolver=dns, start=False)
    dns.fail = True
    replica_set.refresh()
    assert replica_set.endpoints() == replicas(3)


def test_nothing_resolved_raises() -> None:
    dns = FakeDNS([])
    replica_set = ReplicaSet("dns:///draft:50052", resolver=dns, start=False)
    with pytest.raises(NoReplicaError):
        replica_set.pick("s")
    dns.answer = replicas(1)
    replica_set.refresh()
    assert replica_set.pick("s") == replicas(1)[0]


# -- pinning -------------------------------------------------------------------------


def test_assignment_is_independent_of_order_and_instance() -> None:
    # Two coordinator replicas must agree without talking to each other.
    a = ReplicaSet(",".join(replicas(5)))
    b = ReplicaSet(",".join(reversed(replicas(5))))
    assert assignment(a) == assignment(b)


def test_spread_is_roughly_even() -> None:
    counts = Counter(assignment(ReplicaSet(",".join(replicas(4)))).values())
    expected = len(SESSIONS) / 4
    assert set(counts) == set(replicas(4))
    assert all(abs(c - expected) < 0.15 * expected for c in counts.values()), counts


def test_adding_a_replica_moves_about_one_in_n_sessions() -> None:
    dns = FakeDNS(replicas(4))
    replica_set = ReplicaSet("dns:///draft:50052", resolver=dns, start=False)
    before = assignment(replica_set)
    dns.answer = replicas(5)
    replica_set.refresh()
    after = assignment(replica_set)
    moved = [s for s in SESSIONS if before[s] != after[s]]
    # Only sessions the new replica wins move, and all of them move to it.
    assert {after[s] for s in moved} == {replicas(5)[-1]}
    assert 0.7 / 5 < len(moved) / len(SESSIONS) < 1.3 / 5


def test_removing_a_replica_moves_only_its_sessions() -> None:
    dns = FakeDNS(replicas(5))
    replica_set = ReplicaSet("dns:///draft:50052", resolver=dns, start=False)
    before = assignment(replica_set)
    gone = replicas(5)[2]
    dns.answer = [r for r in replicas(5) if r != gone]
    replica_set.refresh()
    after = assignment(replica_set)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == gone}
    assert gone not in after.values()
    # The orphans spread over the survivors rather than piling onto one.
    assert len(Counter(after[s] for s in moved)) == 4


def test_replacing_a_static_replica_moves_only_its_sessions_and_reports_the_list() -> None:
    changes: list[list[str]] = []
    replica_set = ReplicaSet(",".join(replicas(3)), on_change=changes.append, start=False)
    before = assignment(replica_set)
    gone, replacement = replicas(3)[1], "10.0.0.9:41234"  # restarted on another port
    replica_set.mark_down(gone)
    replica_set.replace_static([r for r in replicas(3) if r != gone] + [replacement])
    after = assignment(replica_set)
    assert set(changes[-1]) == {*replicas(3)[::2], replacement}
    assert gone not in after.values() and replica_set._down == {}  # its mark is forgotten
    # A survivor's session moves only if the replacement now wins it (rendezvous hashing).
    assert all(after[s] in (before[s], replacement) for s in SESSIONS if before[s] != gone)
    assert {after[s] for s in SESSIONS if before[s] == gone} <= {*replicas(3)[::2], replacement}
    with pytest.raises(ValueError, match="at least one"):
        replica_set.replace_static([])
    dns = ReplicaSet("dns:///draft:50052", resolver=FakeDNS(replicas(2)), start=False)
    with pytest.raises(ValueError, match="DNS"):
        dns.replace_static(replicas(1))


def test_mark_down_moves_only_that_replicas_sessions_until_cooldown() -> None:
    clock = FakeClock()
    replica_set = ReplicaSet(",".join(replicas(4)), cooldown_s=30, clock=clock)
    before = assignment(replica_set)
    failed = replicas(4)[0]
    replica_set.mark_down(failed)
    assert failed not in replica_set.endpoints()
    after = assignment(replica_set)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == failed}
    # Each moved session lands on its second choice, so every coordinator agrees.
    assert all(after[s] == rank(s, replicas(4))[1] for s in moved)
    clock.now += 31
    assert assignment(replica_set) == before


def test_health_check_restores_a_down_replica_early() -> None:
    healthy: set[str] = set()
    replica_set = ReplicaSet(",".join(replicas(3)), health_check=lambda e: e in healthy,
                             start=False)
    failed = replicas(3)[1]
    replica_set.mark_down(failed)
    replica_set.refresh()
    assert failed not in replica_set.endpoints()
    healthy.add(failed)
    replica_set.refresh()
    assert failed in replica_set.endpoints()


def test_replica_leaving_dns_forgets_its_down_mark() -> None:
    dns = FakeDNS(replicas(3))
    replica_set = ReplicaSet("dns:///draft:50052", resolver=dns, start=False)
    replica_set.mark_down(replicas(3)[0])
    dns.answer = replicas(3)[1:]
    replica_set.refresh()
    dns.answer = replicas(3)  # a new pod reusing the address
    replica_set.refresh()
    assert replica_set.endpoints() == replicas(3)


def test_all_down_falls_back_to_every_replica() -> None:
    replica_set = ReplicaSet(",".join(replicas(2)))
    for endpoint in replicas(2):
        replica_set.mark_down(endpoint)
    assert replica_set.endpoints() == []
    assert replica_set.pick("s") in replicas(2)


def test_mark_down_of_an_unknown_replica_is_ignored() -> None:
    replica_set = ReplicaSet(",".join(replicas(2)))
    replica_set.mark_down("10.9.9.9:50052")
    assert replica_set.endpoints() == replicas(2)
