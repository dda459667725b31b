"""Where sessions' drafts and targets live: the replica sets behind the endpoint flags.

`--target-endpoint` / `--draft-endpoint` take what specdec.serving.discovery.ReplicaSet parses:
``host:port``, a list ``host:port,host:port``, or a headless Service ``dns:///name:port``
(re-resolved every SPECDEC_DISCOVERY_REFRESH_S seconds). The servicer pins each session
to one replica of each role at its start (coordinator.routing.ReplicaRoute) and keeps it
there for the whole generation, since the KV caches live on those replicas.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from specdec.serving.discovery import EndpointSpec, ReplicaSet, parse_endpoint_spec

# gRPC target schemes other than dns: that name one endpoint gRPC resolves itself
# (a Unix socket, a literal address list). Passed through unchanged as one replica, so
# whatever gRPC accepted as an endpoint before discovery still works.
_GRPC_SCHEME = re.compile(r"^(unix|unix-abstract|ipv4|ipv6|vsock):")


@dataclass(frozen=True)
class SessionEndpoints:
    target: str
    draft: str | None  # None: no draft, every round is target-only


class EndpointSource(Protocol):
    """The replicas of each role; `draft` is None when there is no draft."""

    @property
    def target(self) -> ReplicaSet: ...

    @property
    def draft(self) -> ReplicaSet | None: ...


def endpoint_spec(text: str, default_port: int | None = None) -> EndpointSpec:
    """ReplicaSet's spec, or a gRPC target URI it does not parse as one fixed replica."""
    if _GRPC_SCHEME.match(text.strip()):
        return EndpointSpec(static=(text.strip(),))
    return parse_endpoint_spec(text, default_port)


class ReplicaEndpoints:
    """Target (and optional draft) replica sets from two endpoint specs.

    `health_check(endpoint)` probes replicas marked down so they return before their
    cooldown; it runs in each set's refresh thread, so it is skipped for a single static
    endpoint, which never needs one. `on_replicas(live)` gets every endpoint still
    discovered, over both roles, whenever DNS changes a set (to close stale channels).
    """

    def __init__(self, target: str, draft: str | None = None, *,
                 default_ports: tuple[int | None, int | None] = (None, None),
                 refresh_s: float | None = None,
                 health_check: Callable[[str], bool] | None = None,
                 on_replicas: Callable[[Iterable[str]], None] | None = None) -> None:
        self._on_replicas = on_replicas
        self._sets: list[ReplicaSet] = []
        self._target = self._replica_set(target, default_ports[0], refresh_s, health_check)
        self._draft = (self._replica_set(draft, default_ports[1], refresh_s, health_check)
                       if draft else None)

    @property
    def target(self) -> ReplicaSet:
        return self._target

    @property
    def draft(self) -> ReplicaSet | None:
        return self._draft

    def for_session(self, session_id: str) -> SessionEndpoints:
        """Where a new session would be pinned now (for logs and tools)."""
        return SessionEndpoints(self._target.pick(session_id),
                                self._draft.pick(session_id) if self._draft else None)

    def close(self) -> None:
        for replica_set in self._sets:
            replica_set.close()

    def _replica_set(self, text: str, default_port: int | None, refresh_s: float | None,
                     health_check: Callable[[str], bool] | None) -> ReplicaSet:
        spec = endpoint_spec(text, default_port)
        single = not spec.is_dns and len(spec.static) == 1
        replica_set = ReplicaSet(spec, refresh_s=refresh_s,
                                 health_check=None if single else health_check,
                                 on_change=self._changed)
        self._sets.append(replica_set)
        return replica_set

    def _changed(self, _endpoints: list[str]) -> None:
        # A set's first DNS answer arrives inside its constructor, before it is listed in
        # _sets; nothing has a channel yet then, so the union of the listed ones is safe.
        if self._on_replicas is not None:
            self._on_replicas({e for s in self._sets for e in s.all_endpoints()})


# The name the servicer's callers used before discovery; a single endpoint behaves as it
# always did.
StaticEndpoints = ReplicaEndpoints
