"""TLS, mutual TLS, API keys and resource limits of the specdec servers and channels.

Roles and what each checks:

- draft and target: TLS with `--tls-cert-file` / `--tls-key-file`; with `--tls-ca-file`
  they also require a client certificate signed by that CA (mutual TLS), so only a
  coordinator holding such a certificate can extend or release their sessions.
- coordinator: its public port is TLS without client certificates (callers present an
  API key from `--api-keys-file` instead); its channels to draft and target verify the
  services' certificates against `--tls-ca-file` and present
  `--tls-client-cert-file` / `--tls-client-key-file`.
- HTTP API (`specdec http`): HTTPS with `--tls-cert-file` / `--tls-key-file`; its channel
  to the coordinator verifies the coordinator's certificate against `--tls-ca-file`, and
  forwards each caller's `Authorization` header, so the coordinator's API keys apply.

Every setting is a flag `--x-y` with the environment variable SPECDEC_X_Y, so
`specdec up` hands one set to all three processes through their environment.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import grpc

from specdec.config import env_name
from specdec.errors import SpecdecError
from specdec.settings import SECURITY_SETTINGS, add_settings, default

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_MB: int = default("max-message-mb")  # a long draft's q is a few MB
DEFAULT_MAX_SESSIONS: int = default("max-sessions")
COORDINATOR_SERVICE = "specdec.v1.Coordinator"
GENERATE_METHODS = (f"/{COORDINATOR_SERVICE}/Generate", f"/{COORDINATOR_SERVICE}/GenerateStream")


class SessionLimitReached(SpecdecError):
    """A new session beyond SPECDEC_MAX_SESSIONS."""

    code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class SecuritySettings:
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""
    tls_server_name: str = ""
    api_keys_file: str = ""
    reflection: str = "on"
    health_port: int = 0
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_prompt_tokens: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace | Any) -> SecuritySettings:
        """From parsed flags; a namespace without some of them gets their defaults."""
        defaults = cls()
        return cls(**{f.name: getattr(args, f.name, getattr(defaults, f.name))
                      for f in fields(cls)})

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SecuritySettings:
        """From SPECDEC_* variables alone (a process that starts or calls the servers)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(env_name("--" + f.name.replace("_", "-")), "")
            if raw:
                values[f.name] = int(raw) if isinstance(f.default, int) else raw
        return cls(**values)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file or self.tls_key_file)

    @property
    def internal_tls(self) -> bool:
        """Whether the coordinator's channels to draft and target use TLS: with a CA or a
        client certificate, or when this process serves TLS itself (one set of settings
        for all three, as `specdec up` and the Kubernetes component give)."""
        return bool(self.tls_ca_file or self.tls_client_cert_file or self.tls_cert_file)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


def add_security_settings(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, SECURITY_SETTINGS)


# -- TLS -----------------------------------------------------------------------------


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {what} {path!r}: {error.strerror}") from None


def served_files(settings: SecuritySettings) -> tuple[str, str] | None:
    """The certificate and key file a TLS server presents (None: plaintext); one without
    the other is an error."""
    if not settings.tls:
        return None
    if not (settings.tls_cert_file and settings.tls_key_file):
        raise ValueError("TLS needs both --tls-cert-file and --tls-key-file "
                         "(SPECDEC_TLS_CERT_FILE, SPECDEC_TLS_KEY_FILE)")
    return settings.tls_cert_file, settings.tls_key_file


_Stamp = tuple[int, int, int] | None


def _stamp(path: str) -> _Stamp:
    """A file's (st_mtime_ns, st_size, st_ino), following links (a Kubernetes Secret
    volume swaps its `..data` link), or None when it cannot be statted."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


class CertificateFiles:
    """A TLS server's certificate, key and client CA files, and the gRPC certificate
    configuration built from their versions in force.

    fetch() runs before each new TLS handshake: it stats the files, as ApiKeys does its
    keys file, and reads them only when one changed. A changed set whose certificate
    chain, key and CA parse, with the key matching the certificate, replaces the one in
    force; any other set keeps it, with one warning naming the file, and is tried again
    when a file changes again. Connections open before a change keep the certificate
    they were made with."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str | None = None) -> None:
        """Read and check the files; ValueError when one is unreadable or they do not
        form a matching pair."""
        self.cert_file = cert_file
        self.key_file = key_file
        self.ca_file = ca_file
        self._lock = threading.Lock()
        self._stamps = self._stat()
        self._refused: tuple[_Stamp, ...] | None = None
        self.configuration = self._configuration(*self._read_all())

    @property
    def client_auth(self) -> bool:
        """Whether the server requires client certificates signed by the CA file."""
        return self.ca_file is not None

    def _paths(self) -> tuple[str, ...]:
        return (self.cert_file, self.key_file, *(() if self.ca_file is None
                                                 else (self.ca_file,)))

    def _stat(self) -> tuple[_Stamp, ...]:
        return tuple(_stamp(path) for path in self._paths())

    def _read_all(self) -> tuple[bytes, bytes, bytes | None]:
        key = _read(self.key_file, "TLS key")
        cert = _read(self.cert_file, "TLS cert")
        ca = _read(self.ca_file, "TLS CA") if self.ca_file is not None else None
        return cert, key, ca

    def _configuration(self, cert: bytes, key: bytes,
                       ca: bytes | None) -> grpc.ServerCertificateConfiguration:
        """The configuration of these contents; ValueError naming the file at fault."""
        from cryptography import x509
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization

        def public(holder: Any) -> bytes:
            return bytes(holder.public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo))

        try:
            chain = x509.load_pem_x509_certificates(cert)
        except ValueError:
            raise ValueError(f"TLS cert {self.cert_file!r} holds no PEM certificate") from None
        try:
            private = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise ValueError(f"TLS key {self.key_file!r} holds no unencrypted PEM private "
                             "key") from None
        if public(private.public_key()) != public(chain[0].public_key()):
            raise ValueError(f"TLS key {self.key_file!r} does not match the certificate "
                             f"in {self.cert_file!r}")
        if ca is not None:
            try:
                x509.load_pem_x509_certificates(ca)
            except ValueError:
                raise ValueError(f"TLS CA {self.ca_file!r} holds no PEM "
                                 "certificate") from None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The configuration to switch to before a handshake, or None to keep the one in
        force. Never raises: an exception here would fail the handshake."""
        try:
            with self._lock:
                return self._fetch()
        except Exception:  # a failed handshake is worse than a stale certificate
            log.exception("checking the TLS files %s failed: keeping the certificate in "
                          "force", ", ".join(self._paths()))
            return None

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamps = self._stat()
        if stamps == self._stamps or stamps == self._refused:
            return None
        try:
            configuration = self._configuration(*self._read_all())
        except Exception as error:  # unreadable, half written, mismatched: all refused
            self._refused = stamps
            log.warning("the TLS files %s changed but are not usable (%s): keeping the "
                        "certificate in force until they change again",
                        ", ".join(self._paths()), error)
            return None
        self._stamps, self._refused = stamps, None
        self.configuration = configuration
        log.info("serving the renewed TLS certificate %s%s", self.cert_file,
                 f" and client CA {self.ca_file}" if self.ca_file else "")
        return configuration

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that take up the files' changes at each new connection."""
        # grpc's stubs type the fetcher without its None ("no change") result.
        fetcher = cast("Callable[[], grpc.ServerCertificateConfiguration]", self.fetch)
        return grpc.dynamic_ssl_server_credentials(self.configuration, fetcher,
                                                   require_client_authentication=self.client_auth)


def server_credentials(settings: SecuritySettings, *,
                       client_auth: bool) -> grpc.ServerCredentials | None:
    """TLS credentials of a server, or None for plaintext. The certificate, key and
    client CA files are read at start and again at a new connection after they change
    (CertificateFiles).

    client_auth: require client certificates signed by --tls-ca-file (draft and target);
    ignored without a CA file."""
    files = served_files(settings)
    if files is None:
        if settings.tls_ca_file and client_auth:
            raise ValueError("--tls-ca-file asks for mutual TLS, which needs this server's "
                             "own --tls-cert-file and --tls-key-file")
        return None
    cert_file, key_file = files
    require = client_auth and bool(settings.tls_ca_file)
    return CertificateFiles(cert_file, key_file,
                            settings.tls_ca_file if require else None).credentials()


def channel_credentials(settings: SecuritySettings) -> grpc.ChannelCredentials | None:
    """The coordinator's credentials towards draft and target, or None for plaintext."""
    if not settings.internal_tls:
        return None
    if bool(settings.tls_client_cert_file) != bool(settings.tls_client_key_file):
        raise ValueError("--tls-client-cert-file and --tls-client-key-file go together")
    return grpc.ssl_channel_credentials(
        root_certificates=(_read(settings.tls_ca_file, "TLS CA")
                           if settings.tls_ca_file else None),
        private_key=(_read(settings.tls_client_key_file, "TLS client key")
                     if settings.tls_client_key_file else None),
        certificate_chain=(_read(settings.tls_client_cert_file, "TLS client cert")
                           if settings.tls_client_cert_file else None))


def caller_settings(settings: SecuritySettings) -> SecuritySettings:
    """The settings of a process's calls to the coordinator (the HTTP API): TLS with a CA
    or a client certificate, plaintext otherwise; serving TLS itself does not make its
    calls TLS. channel_credentials and channel_options take the result."""
    return replace(settings, tls_cert_file="", tls_key_file="")


def https_files(settings: SecuritySettings) -> tuple[str, str] | None:
    """The certificate and key file an HTTPS server presents, checked readable, or None
    for plain HTTP."""
    files = served_files(settings)
    if files is not None:
        _read(files[0], "TLS cert")
        _read(files[1], "TLS key")
    return files


def message_options(max_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes)]


def channel_options(settings: SecuritySettings) -> list[tuple[str, Any]]:
    """Options of the coordinator's channels to draft and target."""
    options = message_options(settings.max_message_bytes)
    if settings.tls_server_name and settings.internal_tls:
        options.append(("grpc.ssl_target_name_override", settings.tls_server_name))
    return options


def is_loopback(host: str) -> bool:
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, port: int, services: Sequence[str], *, tls: bool,
                    client_auth: bool) -> None:
    """One warning when a non-loopback bind leaves its services open to the network."""
    if is_loopback(host):
        return
    names = ", ".join(services)
    if not tls:
        log.warning("%s:%d serves %s in plaintext on a non-loopback interface: anyone who "
                    "can reach it can call them and read their traffic (set "
                    "SPECDEC_TLS_CERT_FILE and SPECDEC_TLS_KEY_FILE)", host, port, names)
    elif not client_auth:
        log.warning("%s:%d serves %s over TLS without client certificates: anyone who can "
                    "reach it can call them (set SPECDEC_TLS_CA_FILE for mutual TLS)",
                    host, port, names)


def public_channel(endpoint: str, *, ca_file: str = "", tls: bool | None = None,
                   server_name: str = "",
                   options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A client's channel to the coordinator: TLS when a CA file is given (or tls=True,
    verifying against the system's roots), else plaintext."""
    opts = list(options)
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    if ca_file or tls:
        root = _read(ca_file, "TLS CA") if ca_file else None
        return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(root), options=opts)
    return grpc.insecure_channel(endpoint, options=opts)


def bearer(api_key: str) -> tuple[tuple[str, str | bytes], ...]:
    """Call metadata carrying an API key (empty without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


# -- API keys ------------------------------------------------------------------------


class ApiKeys:
    """The keys of a keys file, re-read when its modification time, size or inode
    changes (checked on each call: one stat), so keys rotate without a restart."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keys: list[bytes] = []
        self._reload(required=True)

    def _reload(self, required: bool = False) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if stamp == self._stamp:
                return
            text = self.path.read_text()
        except OSError as error:
            if required:
                raise ValueError(f"cannot read the API keys file {str(self.path)!r}: "
                                 f"{error.strerror}") from None
            # A rotation by rename can briefly leave no file: keep the last keys.
            log.warning("cannot read the API keys file %s (%s): keeping the %d keys read "
                        "before", self.path, error.strerror, len(self._keys))
            return
        keys = [line.strip().encode() for line in text.splitlines()]
        self._keys = [key for key in keys if key and not key.startswith(b"#")]
        self._stamp = stamp
        if not self._keys:
            log.warning("the API keys file %s lists no keys: every call is refused", self.path)
        else:
            log.info("read %d API keys from %s", len(self._keys), self.path)

    def __len__(self) -> int:
        return len(self._keys)

    def valid(self, candidate: str) -> bool:
        with self._lock:
            self._reload()
            keys = self._keys
        given = candidate.encode()
        # Compare against every key, each in constant time: the time taken says nothing
        # about which key, or how much of one, matched.
        found = False
        for key in keys:
            found |= hmac.compare_digest(key, given)
        return found


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
            message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends every call with code."""

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    def stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)
        yield  # pragma: no cover - a generator, as a streaming handler must be

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream, **kwargs)


def _service(method: str) -> str:
    return method.split("/")[1] if method.count("/") >= 2 else ""


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Every call of the protected services needs `authorization: Bearer <key>` with a key
    of the keys file; health and reflection stay open. The key itself is never logged."""

    def __init__(self, keys: ApiKeys, services: Iterable[str] = (COORDINATOR_SERVICE,)) -> None:
        self.keys = keys
        self.services = frozenset(services)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if _service(details.method) not in self.services:
            return continuation(details)
        header = next((value for name, value in details.invocation_metadata or ()
                       if name == "authorization"), None)
        if header is None:
            message = ("this server requires an API key: send the metadata "
                       "'authorization: Bearer <key>' (specdec generate --api-key, or "
                       "SPECDEC_API_KEY)")
        else:
            scheme, _, key = str(header).strip().partition(" ")
            if scheme.lower() == "bearer" and key.strip() and self.keys.valid(key.strip()):
                return continuation(details)
            message = ("the API key is not valid on this server (unknown, revoked, or not "
                       "in the form 'authorization: Bearer <key>'); ask its operator for "
                       "a key from its SPECDEC_API_KEYS_FILE")
        handler = continuation(details)
        if handler is None:
            return None
        log.info("refused %s: %s", details.method,
                 "no API key" if header is None else "invalid API key")
        return _denied(handler, grpc.StatusCode.UNAUTHENTICATED, message)


class ConcurrencyInterceptor(grpc.ServerInterceptor):
    """At most `limit` calls of `methods` in flight (the coordinator's generations); one
    beyond gets RESOURCE_EXHAUSTED naming SPECDEC_MAX_SESSIONS."""

    def __init__(self, limit: int, methods: Iterable[str] = GENERATE_METHODS,
                 what: str = "generations") -> None:
        self.limit = limit
        self.methods = frozenset(methods)
        self.what = what
        self._lock = threading.Lock()
        self.in_flight = 0

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method not in self.methods:
            return handler
        if handler.unary_unary:
            inner, wrap = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        else:
            inner, wrap = handler.unary_stream, grpc.unary_stream_rpc_method_handler

        def limited(request: Any, context: grpc.ServicerContext) -> Any:
            with self._lock:
                if self.in_flight >= self.limit:
                    full = True
                else:
                    full = False
                    self.in_flight += 1
            if full:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, session_limit_message(
                    self.limit, f"{self.what} are in flight on this coordinator"))
            done = threading.Event()

            def release() -> None:
                if not done.is_set():
                    done.set()
                    with self._lock:
                        self.in_flight -= 1

            if not context.add_callback(release):
                release()
            return inner(request, context)

        return wrap(limited, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def session_limit_message(limit: int, what: str) -> str:
    return (f"{limit} {what}, the most SPECDEC_MAX_SESSIONS (--max-sessions) allows; "
            "retry later, or raise the limit")


def check_session_cap(open_sessions: int, limit: int, service: str) -> None:
    """Raise SessionLimitReached when a new session would exceed the cap (0 = no cap).

    The model services' session table calls it before it admits an unknown session id."""
    if limit and open_sessions >= limit:
        raise SessionLimitReached(session_limit_message(
            limit, f"sessions are open on this {service} service"))


# -- one place that turns settings into a server -------------------------------------


def server_options(args: argparse.Namespace | Any, *, role: str) -> dict[str, Any]:
    """build_server's keyword arguments for a role: credentials, limits, reflection,
    health port and the interceptors the settings ask for (API keys, session cap)."""
    settings = SecuritySettings.from_args(args)
    interceptors: list[grpc.ServerInterceptor] = []
    if role == "coordinator":
        if settings.api_keys_file:
            interceptors.append(ApiKeyInterceptor(ApiKeys(settings.api_keys_file)))
        if settings.max_sessions:
            interceptors.append(ConcurrencyInterceptor(settings.max_sessions))
    return {"credentials": server_credentials(settings, client_auth=role != "coordinator"),
            "client_auth": role != "coordinator" and bool(settings.tls_ca_file),
            "reflection": settings.reflection == "on",
            "health_port": settings.health_port or None,
            "max_message_bytes": settings.max_message_bytes,
            "interceptors": interceptors}


def secure_stack_env(directory: Path) -> tuple[dict[str, str], str]:
    """Certificates and one API key for a local stack with TLS everywhere: the children's
    SPECDEC_* environment, and the key (generated here, written 0600)."""
    import secrets

    from specdec.serving.certificates import write_certs, write_key_file

    paths = write_certs(directory)
    # Hex, not base64url: a key that began with "-" would read as an option where a
    # command line takes it (`specdec generate --api-key KEY`, as `up` prints it).
    api_key = secrets.token_hex(32)
    keys_file = directory / "api-keys"
    write_key_file(keys_file, f"# generated by specdec up --secure\n{api_key}\n".encode())
    env = {"SPECDEC_TLS_CERT_FILE": paths["server.crt"], "SPECDEC_TLS_KEY_FILE":
           paths["server.key"], "SPECDEC_TLS_CA_FILE": paths["ca.crt"],
           "SPECDEC_TLS_CLIENT_CERT_FILE": paths["client.crt"],
           "SPECDEC_TLS_CLIENT_KEY_FILE": paths["client.key"],
           "SPECDEC_API_KEYS_FILE": keys_file}
    return {name: str(path) for name, path in env.items()}, api_key
