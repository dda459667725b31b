"""TLS certificates, keys and client CAs rotate on running gRPC servers: real servers on
loopback (health service alone), real handshakes, certificates from `specdec certs`.

Each check opens a fresh channel with its own subchannel pool, so it makes a new
connection and a new handshake; a channel reuses its connection across calls."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.certificates import FILES, write_certs
from specdec.serving.grpc_server import ServerHandle, build_server
from specdec.serving.security import SecuritySettings, server_credentials, server_options

NEW_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Two CAs, 'a' and 'b', each with its server and client certificate."""
    root = tmp_path_factory.mktemp("cas")
    return {name: write_certs(root / name) for name in ("a", "b")}


@pytest.fixture
def live(tmp_path: Path, cas: dict[str, dict[str, Path]]) -> Path:
    """The files a server reads, holding CA a's certificates."""
    directory = tmp_path / "live"
    directory.mkdir()
    for file in FILES:
        shutil.copyfile(cas["a"][file], directory / file)
    return directory


def install(source: Path | bytes, target: Path) -> None:
    """Replace target atomically (a new file renamed over it)."""
    staged = target.with_name(target.name + ".new")
    if isinstance(source, Path):
        shutil.copyfile(source, staged)
    else:
        staged.write_bytes(source)
    os.replace(staged, target)


def answers(address: str, ca: Path, client: dict[str, Path] | None = None) -> bool:
    """Whether a new connection trusting only ca (presenting client's certificate, if
    given) gets a health answer; False when the handshake fails."""
    credentials = grpc.ssl_channel_credentials(
        ca.read_bytes(),
        client["client.key"].read_bytes() if client else None,
        client["client.crt"].read_bytes() if client else None)
    with grpc.secure_channel(address, credentials, options=NEW_CONNECTION) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def serve(settings: SecuritySettings, role: str = "coordinator") -> ServerHandle:
    options = server_options(settings, role=role)
    options["reflection"] = False
    return build_server([], **options)


@pytest.fixture
def tls_server(live: Path) -> Iterator[ServerHandle]:
    handle = serve(SecuritySettings(tls_cert_file=str(live / "server.crt"),
                                    tls_key_file=str(live / "server.key")))
    yield handle
    handle.stop(0)


def rotation_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "specdec.serving.security" and record.levelno == logging.WARNING]


def test_renewed_certificate_from_another_ca_is_served_at_the_next_connection(
        tls_server: ServerHandle, live: Path, cas: dict[str, dict[str, Path]]) -> None:
    a, b = cas["a"], cas["b"]
    assert answers(tls_server.address, a["ca.crt"])
    assert not answers(tls_server.address, b["ca.crt"])
    credentials = grpc.ssl_channel_credentials(a["ca.crt"].read_bytes())
    with grpc.secure_channel(tls_server.address, credentials,
                             options=NEW_CONNECTION) as open_before:
        health = health_pb2_grpc.HealthStub(open_before)
        health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        install(b["server.crt"], live / "server.crt")
        install(b["server.key"], live / "server.key")
        assert answers(tls_server.address, b["ca.crt"])
        assert not answers(tls_server.address, a["ca.crt"])
        # A connection made before the renewal keeps its session.
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("broken", ["garbage certificate", "key of another certificate",
                                    "missing key"])
def test_unusable_renewal_keeps_the_certificate_in_force_with_one_warning(
        tls_server: ServerHandle, live: Path, cas: dict[str, dict[str, Path]],
        caplog: pytest.LogCaptureFixture, broken: str) -> None:
    a, b = cas["a"], cas["b"]
    with caplog.at_level(logging.WARNING, logger="specdec.serving.security"):
        if broken == "garbage certificate":
            faulty = live / "server.crt"
            install(b"-----BEGIN CERTIFICATE-----\nMIIB half written", faulty)
        elif broken == "key of another certificate":
            faulty = live / "server.key"
            install(b["server.key"], faulty)
        else:
            faulty = live / "server.key"
            faulty.unlink()
        for _ in range(3):
            assert answers(tls_server.address, a["ca.crt"])
        assert not answers(tls_server.address, b["ca.crt"])
        warnings = rotation_warnings(caplog)
        assert len(warnings) == 1, warnings
        assert repr(str(faulty)) in warnings[0] and "keeping the certificate" in warnings[0]
        # A complete renewal after the broken one is taken up.
        install(b["server.crt"], live / "server.crt")
        install(b["server.key"], live / "server.key")
        assert answers(tls_server.address, b["ca.crt"])
        assert len(rotation_warnings(caplog)) == 1


def test_rotated_client_ca_accepts_its_clients_and_refuses_the_old_ones(
        live: Path, cas: dict[str, dict[str, Path]]) -> None:
    a, b = cas["a"], cas["b"]
    handle = serve(SecuritySettings(tls_cert_file=str(live / "server.crt"),
                                    tls_key_file=str(live / "server.key"),
                                    tls_ca_file=str(live / "ca.crt")), role="model")
    try:
        # The server's own certificate stays CA a's throughout.
        assert answers(handle.address, a["ca.crt"], client=a)
        assert not answers(handle.address, a["ca.crt"], client=b)
        assert not answers(handle.address, a["ca.crt"])
        install(b["ca.crt"], live / "ca.crt")
        assert answers(handle.address, a["ca.crt"], client=b)
        assert not answers(handle.address, a["ca.crt"], client=a)
        assert not answers(handle.address, a["ca.crt"])
    finally:
        handle.stop(0)


def test_kubernetes_secret_volume_swap_is_followed(
        tmp_path: Path, cas: dict[str, dict[str, Path]]) -> None:
    """A Secret volume's files are links through `..data`, itself a link the kubelet
    swaps to a new directory."""
    a, b = cas["a"], cas["b"]
    volume = tmp_path / "secret"
    volume.mkdir()

    def version(name: str, source: dict[str, Path]) -> None:
        (volume / name).mkdir()
        shutil.copyfile(source["server.crt"], volume / name / "tls.crt")
        shutil.copyfile(source["server.key"], volume / name / "tls.key")
        (volume / "..data_tmp").symlink_to(name)
        os.replace(volume / "..data_tmp", volume / "..data")

    version("..v1", a)
    for file in ("tls.crt", "tls.key"):
        (volume / file).symlink_to(Path("..data") / file)
    handle = serve(SecuritySettings(tls_cert_file=str(volume / "tls.crt"),
                                    tls_key_file=str(volume / "tls.key")))
    try:
        assert answers(handle.address, a["ca.crt"])
        version("..v2", b)
        assert answers(handle.address, b["ca.crt"])
        assert not answers(handle.address, a["ca.crt"])
    finally:
        handle.stop(0)


def test_unusable_files_at_start_are_refused(live: Path,
                                             cas: dict[str, dict[str, Path]]) -> None:
    install(cas["b"]["server.key"], live / "server.key")
    settings = SecuritySettings(tls_cert_file=str(live / "server.crt"),
                                tls_key_file=str(live / "server.key"))
    with pytest.raises(ValueError, match="does not match the certificate"):
        server_credentials(settings, client_auth=False)
    install(b"not a certificate", live / "ca.crt")
    install(cas["a"]["server.key"], live / "server.key")
    with pytest.raises(ValueError, match="TLS CA .* holds no PEM certificate"):
        server_credentials(SecuritySettings(tls_cert_file=str(live / "server.crt"),
                                            tls_key_file=str(live / "server.key"),
                                            tls_ca_file=str(live / "ca.crt")),
                           client_auth=True)
