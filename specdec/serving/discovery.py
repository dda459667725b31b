"""Replica discovery and session pinning for the draft and target services.

An endpoint spec is either a static list, ``host:port,host:port`` (``[::1]:50052`` for
IPv6), or a gRPC-style DNS name, ``dns:///name:port``. In Kubernetes the name is a
headless Service, whose DNS answer lists one A/AAAA record per *ready* pod, so
re-resolving it periodically tracks scale-ups, scale-downs and replaced pods.

Sessions hold KV caches on one replica, so every call of a session must reach the same
replica. `ReplicaSet.pick` uses rendezvous (highest-random-weight) hashing: each
(session, replica) pair gets a pseudo-random weight and the session goes to the replica
with the highest weight. Adding a replica moves only the sessions it now wins (about
1/n); removing one moves only the sessions it held. The weight is a stable hash, not
Python's per-process `hash()`, so every coordinator replica pins a session to the same
draft/target replica without talking to the others.

Pure Python on purpose: the coordinator plugs in a gRPC health check through the
`health_check` callback, so this module stays testable without servers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from specdec.settings import default, env_name

log = logging.getLogger(__name__)

REFRESH_ENV = env_name("discovery-refresh-s")
DEFAULT_REFRESH_S: float = default("discovery-refresh-s")
# A replica marked down stays out this long unless a health check or DNS change (a new
# pod behind the name) clears it earlier; long enough not to flap on a restarting pod.
DEFAULT_COOLDOWN_S = 30.0

Resolver = Callable[[str, int], list[str]]


class NoReplicaError(RuntimeError):
    """No replica is available: none resolved, or all are marked down."""


@dataclass(frozen=True)
class EndpointSpec:
    """A parsed endpoint spec: a fixed list of ``host:port``, or one DNS name and port."""

    static: tuple[str, ...] = ()
    dns_name: str | None = None
    port: int | None = None

    @property
    def is_dns(self) -> bool:
        return self.dns_name is not None


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed so the port stays unambiguous."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [v6]:port
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad endpoint {text!r}: expected [ipv6]:port")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # bare host, or a bare IPv6 literal that cannot carry a port
        host, port_text = text, ""
    if not host:
        raise ValueError(f"bad endpoint {text!r}: empty host")
    if not port_text:
        if default_port is None:
            raise ValueError(f"bad endpoint {text!r}: missing port")
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad endpoint {text!r}: port must be 1-65535")
    return host, int(port_text)


def parse_endpoint_spec(spec: str, default_port: int | None = None) -> EndpointSpec:
    """Parse ``host:port[,host:port...]``, ``dns:///name:port`` or ``dns:name:port``."""
    spec = spec.strip()
    if spec.startswith("dns:"):
        rest = spec[len("dns:"):]
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            # gRPC lets dns://server/name pick a DNS server; getaddrinfo cannot, and a
            # silently ignored server would be a surprise.
            if authority:
                raise ValueError(f"bad endpoint spec {spec!r}: a DNS authority is not supported")
        host, port = split_host_port(rest, default_port)
        return EndpointSpec(dns_name=host, port=port)
    parts = [part for part in spec.split(",") if part.strip()]
    if not parts:
        raise ValueError("empty endpoint spec")
    endpoints = [format_endpoint(*split_host_port(part, default_port)) for part in parts]
    # Order-free and duplicate-free: the same replicas must give the same pinning.
    return EndpointSpec(static=tuple(sorted(set(endpoints))))


def resolve_dns(name: str, port: int) -> list[str]:
    """All A/AAAA addresses of `name` as sorted, de-duplicated ``ip:port`` strings."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({format_endpoint(str(info[4][0]), port) for info in infos})


def refresh_interval_from_env(default: float = DEFAULT_REFRESH_S) -> float:
    raw = os.environ.get(REFRESH_ENV, "")
    if not raw:
        return default
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{REFRESH_ENV} must be > 0, got {raw!r}")
    return value


def rendezvous_weight(session_id: str, endpoint: str) -> int:
    """Stable 64-bit weight of a (session, replica) pair, equal in every process."""
    digest = hashlib.blake2b(f"{endpoint}\0{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(session_id: str, endpoints: Iterable[str]) -> list[str]:
    """Replicas in the order a session should try them: best weight first."""
    return sorted(endpoints, key=lambda e: (rendezvous_weight(session_id, e), e), reverse=True)


class ReplicaSet:
    """The live replicas behind an endpoint spec, and the session -> replica pinning.

    DNS specs are resolved once at construction and then every `refresh_s` seconds in a
    daemon thread. A failed lookup keeps the last known replicas: a DNS blip must not
    unpin every session. `on_change` gets the new replica list whenever it changes,
    including the first DNS answer (e.g. to close channels to removed replicas).
    Thread-safe.
    """

    def __init__(self, spec: str | EndpointSpec, *, default_port: int | None = None,
                 refresh_s: float | None = None, cooldown_s: float = DEFAULT_COOLDOWN_S,
                 resolver: Resolver = resolve_dns,
                 health_check: Callable[[str], bool] | None = None,
                 on_change: Callable[[list[str]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        self.spec = spec if isinstance(spec, EndpointSpec) else parse_endpoint_spec(
            spec, default_port)
        self.refresh_s = refresh_interval_from_env() if refresh_s is None else refresh_s
        if self.refresh_s <= 0:
            raise ValueError(f"refresh interval must be > 0, got {self.refresh_s}")
        self.cooldown_s = cooldown_s
        self._resolver = resolver
        self._health_check = health_check
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._resolved: tuple[str, ...] = self.spec.static
        self._down: dict[str, float] = {}  # endpoint -> clock time its exclusion ends
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()
        # A static list only changes through mark_down, whose cooldown is checked lazily;
        # the thread is needed to re-resolve DNS or to probe replicas marked down.
        if start and (self.spec.is_dns or health_check is not None):
            self._thread = threading.Thread(
                target=self._run, name="specdec-discovery", daemon=True)
            self._thread.start()

    # -- queries ---------------------------------------------------------------------

    def all_endpoints(self) -> list[str]:
        """Every resolved replica, including those marked down."""
        with self._lock:
            return list(self._resolved)

    def endpoints(self) -> list[str]:
        """Replicas that may take sessions: resolved and not marked down."""
        now = self._clock()
        with self._lock:
            return [e for e in self._resolved if self._down.get(e, now) <= now]

    def ranked(self, session_id: str) -> list[str]:
        """Available replicas in the session's preference order; `pick` is the first."""
        candidates = self.endpoints()
        if not candidates:
            # Everything marked down: a wrong mark must not stop all traffic for a whole
            # cooldown, so try every resolved replica; the caller's call decides.
            candidates = self.all_endpoints()
        if not candidates:
            raise NoReplicaError(f"no replica resolved for {self.describe()}")
        return rank(session_id, candidates)

    def pick(self, session_id: str) -> str:
        """The replica that holds (or should hold) this session's caches."""
        return self.ranked(session_id)[0]

    def describe(self) -> str:
        if self.spec.is_dns:
            return f"dns:///{format_endpoint(self.spec.dns_name or '', self.spec.port or 0)}"
        return ",".join(self.spec.static)

    # -- updates ---------------------------------------------------------------------

    def mark_down(self, endpoint: str, cooldown_s: float | None = None) -> None:
        """Exclude a replica that failed; its sessions move to their next-ranked replica."""
        seconds = self.cooldown_s if cooldown_s is None else cooldown_s
        with self._lock:
            if endpoint not in self._resolved:
                return  # already gone from DNS: nothing to exclude
            self._down[endpoint] = self._clock() + seconds
        log.warning("replica %s marked down for %.0f s", endpoint, seconds)

    def mark_up(self, endpoint: str) -> None:
        with self._lock:
            self._down.pop(endpoint, None)

    def replace_static(self, endpoints: Sequence[str]) -> None:
        """Swap a static list for a new one (a dead replica replaced at a new address).

        Sessions pinned to an endpoint no longer listed move on their next call, as when
        a pod leaves DNS; `on_change` gets the new list.
        """
        if self.spec.is_dns:
            raise ValueError(f"{self.describe()} comes from DNS; its replicas change there")
        if not endpoints:
            raise ValueError("a replica set needs at least one endpoint")
        self.spec = EndpointSpec(static=tuple(endpoints))
        self.refresh()

    def refresh(self) -> None:
        """Re-resolve the spec now and probe replicas marked down."""
        if self.spec.is_dns:
            try:
                found = tuple(self._resolver(self.spec.dns_name or "", self.spec.port or 0))
            except OSError as error:
                log.warning("resolving %s failed, keeping %d known replicas: %s",
                            self.describe(), len(self._resolved), error)
                found = self._resolved
        else:
            found = self.spec.static
        with self._lock:
            changed = found != self._resolved
            self._resolved = found
            # A replica that left DNS and comes back is a restarted pod: forget its mark.
            self._down = {e: t for e, t in self._down.items() if e in found}
            down = list(self._down)
        if changed:
            log.info("replicas of %s: %s", self.describe(), ", ".join(found) or "none")
            if self._on_change is not None:
                self._on_change(list(found))
        if self._health_check is not None:
            # Outside the lock: a health check is a network call.
            for endpoint in down:
                if self._health_check(endpoint):
                    log.info("replica %s healthy again", endpoint)
                    self.mark_up(endpoint)

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # keep discovering: one bad callback must not end it
                log.exception("replica refresh for %s failed", self.describe())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
