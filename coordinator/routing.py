"""Which replica one session's calls of one role go to, and moving it when it is gone.

A session is pinned at its start (`ReplicaSet.pick`, rendezvous hashing) because the KV
cache it builds lives on that replica. When the replica is gone (UNAVAILABLE, or it left
discovery) the route marks it down and moves to the session's next-ranked replica; the
client then re-sends the committed prefix there (coordinator.clients).

`FixedRoute` is the degenerate case, one endpoint: nothing to move to, so a failing
replica is waited for, exactly as before replicas existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc

from specdec.serving.discovery import NoReplicaError, ReplicaSet

log = logging.getLogger(__name__)

Stub = TypeVar("Stub")


class ChannelClosed(grpc.RpcError):
    """A call on a channel the pool closed because its replica left discovery.

    gRPC raises ValueError for that; as an RpcError it takes the "replica gone" path.
    """


class StubSource(Protocol):
    """A stub for an endpoint, over a channel shared by every session (ChannelPool.stub)."""

    def __call__(self, endpoint: str, make: Callable[[grpc.Channel], Stub]) -> Stub: ...


class Route:
    """Where a session's calls of one role go; this base never moves."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def stub(self, make: Callable[[grpc.Channel], Stub]) -> Stub:
        """A stub (built by `make`) for the current endpoint."""
        raise NotImplementedError

    @property
    def can_move(self) -> bool:
        """Whether another replica could take the session (else: wait for this one)."""
        return False

    def left_discovery(self) -> bool:
        return False

    def gone(self, code: grpc.StatusCode) -> bool:
        """Whether a call that failed with `code` means the replica itself is gone."""
        return False

    def move(self) -> bool:
        """Go to another replica; False if there is none (stay and retry here)."""
        return False


class FixedRoute(Route):
    """One endpoint and its channel."""

    def __init__(self, channel: grpc.Channel, endpoint: str) -> None:
        super().__init__(endpoint)
        self._channel = channel
        self._stub: object | None = None

    def stub(self, make: Callable[[grpc.Channel], Stub]) -> Stub:
        if self._stub is None:
            self._stub = make(self._channel)
        return self._stub  # type: ignore[return-value]  # one client, one stub type


class ReplicaRoute(Route):
    """A session's replica out of a ReplicaSet; stubs come from a shared pool.

    Not thread-safe: one route belongs to one session, whose calls are sequential.
    """

    def __init__(self, replicas: ReplicaSet, stubs: StubSource, session_id: str,
                 on_pin: Callable[[str], None] | None = None) -> None:
        self._replicas = replicas
        self._stubs = stubs
        self._session_id = session_id
        self._on_pin = on_pin
        super().__init__(replicas.pick(session_id))
        self._tried = {self.endpoint}
        self._pinned()

    def stub(self, make: Callable[[grpc.Channel], Stub]) -> Stub:
        return self._stubs(self.endpoint, make)

    @property
    def can_move(self) -> bool:
        return len(self._replicas.all_endpoints()) > 1

    def left_discovery(self) -> bool:
        return self.endpoint not in self._replicas.all_endpoints()

    def gone(self, code: grpc.StatusCode) -> bool:
        # CANCELLED without a client cancel: the pool closed the channel under the call.
        return code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.CANCELLED and self.left_discovery())

    def move(self) -> bool:
        left = self.left_discovery()
        if not left and not self.can_move:
            return False  # a single replica: marking it down would change nothing
        if not left:
            self._replicas.mark_down(self.endpoint)  # other sessions skip it too
        try:
            ranked = self._replicas.ranked(self._session_id)
        except NoReplicaError:
            return False
        candidates = [e for e in ranked if e not in self._tried]
        if not candidates:
            # Every replica failed this session once. Start the round over so a replica
            # that came back is tried again; the caller waits a little first.
            self._tried = {self.endpoint}
            return False
        log.warning("session %s: replica %s gone, moving to %s", self._session_id,
                    self.endpoint, candidates[0])
        self.endpoint = candidates[0]
        self._tried.add(self.endpoint)
        self._pinned()
        return True

    def _pinned(self) -> None:
        if self._on_pin is not None:
            self._on_pin(self.endpoint)
