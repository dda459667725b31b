"""Where a session's draft and target live: the seam for replica discovery.

The coordinator asks `for_session(session_id)` once per request and keeps the answer
for the whole generation, since the KV caches live on those replicas. StaticEndpoints
serves the flags; a discovery-backed source (e.g. specdec.discovery.ReplicaSet.pick
for each role) can replace it without touching the servicer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SessionEndpoints:
    target: str
    draft: str | None  # None: no draft, every round is target-only


class EndpointSource(Protocol):
    def for_session(self, session_id: str) -> SessionEndpoints: ...


@dataclass(frozen=True)
class StaticEndpoints:
    target: str
    draft: str | None = None

    def for_session(self, session_id: str) -> SessionEndpoints:
        return SessionEndpoints(self.target, self.draft or None)
