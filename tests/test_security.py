"""TLS, mutual TLS, API keys and limits on real servers over loopback, tiny models.

The secure stack here is the one `specdec serve` builds (specdec.serving.security.server_options
into specdec.serving.grpc_server.build_server), in this process; test_security_up.py runs
`specdec up --secure` as processes."""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_harness import DelayInterceptor, target_info
from tiny_models import tiny_llama

from coordinator.clients import ChannelPool
from coordinator.endpoints import StaticEndpoints
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from draft_service.servicer import DraftServicer
from specdec import cli
from specdec.core.loop import GenerateConfig, generate
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specdec.serving.certificates import write_certs
from specdec.serving.grpc_server import ServerHandle, build_server, check_health
from specdec.serving.security import (
    ApiKeys,
    SecuritySettings,
    bearer,
    channel_credentials,
    channel_options,
    public_channel,
    secure_stack_env,
    server_options,
)
from target_service.servicer import TargetServicer

VOCAB = 32
PROMPT = [1, 5, 7, 3]
KEY = "sk-test-7f3a9c1e5b2d4f6a8c0e"
OTHER_KEY = "sk-test-rotated-0d9e8f7a6b5c"


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(1)
    return tiny_llama(VOCAB, seed=1), tiny_llama(VOCAB, seed=2, layers=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Our CA's files, and a second CA's client certificate (must be refused)."""
    root = tmp_path_factory.mktemp("pki")
    paths = write_certs(root / "ours")
    other = write_certs(root / "other")
    paths.update({f"other-{name}": path for name, path in other.items()})
    keys = root / "api-keys"
    keys.write_text(f"# test keys\n\n{KEY}\n")
    paths["api-keys"] = keys
    return paths


def reference(models: tuple[torch.nn.Module, torch.nn.Module], new_tokens: int) -> list[int]:
    target, draft = models
    result = generate(LocalDrafter(ModelRunner(draft)), LocalVerifier(ModelRunner(target)),
                      PROMPT, GenerateConfig(max_new_tokens=new_tokens, num_draft_tokens=4))
    return list(result.token_ids)


@dataclass
class SecureStack:
    draft: ServerHandle
    target: ServerHandle
    coordinator: ServerHandle
    channels: ChannelPool
    coordinator_servicer: CoordinatorServicer
    draft_servicer: DraftServicer
    draft_health_port: int

    def close(self) -> None:
        self.coordinator.stop(0)
        self.channels.close()
        self.draft.stop(0)
        self.target.stop(0)


def start_secure(models: tuple[torch.nn.Module, torch.nn.Module],
                 settings: SecuritySettings,
                 coordinator_settings: CoordinatorSettings | None = None) -> SecureStack:
    target_model, draft_model = models
    target = TargetServicer(ModelRunner(target_model))
    draft = DraftServicer(ModelRunner(draft_model, target_vocab_size=VOCAB))
    draft_options = server_options(settings, role="model")
    # The health port (if any) is the draft's.
    target_server = build_server([target.service()], **server_options(
        replace(settings, health_port=0), role="model"))
    draft_server = build_server([draft.service()], **draft_options)
    for servicer in (target, draft):
        servicer.sessions.max_sessions = settings.max_sessions
    channels = ChannelPool(credentials=channel_credentials(settings),
                           options=channel_options(settings))
    coordinator = CoordinatorServicer(
        target_info(target_model),
        StaticEndpoints(target_server.address, draft_server.address),
        settings=coordinator_settings or CoordinatorSettings(
            max_prompt_tokens=settings.max_prompt_tokens),
        channels=channels)
    coordinator_server = build_server([coordinator.service()], **server_options(
        replace(settings, health_port=0), role="coordinator"))
    health_port = settings.health_port
    return SecureStack(draft_server, target_server, coordinator_server, channels, coordinator,
                       draft, health_port)


def secure_settings(pki: dict[str, Path], **changes: object) -> SecuritySettings:
    settings = SecuritySettings(
        tls_cert_file=str(pki["server.crt"]), tls_key_file=str(pki["server.key"]),
        tls_ca_file=str(pki["ca.crt"]), tls_client_cert_file=str(pki["client.crt"]),
        tls_client_key_file=str(pki["client.key"]), api_keys_file=str(pki["api-keys"]))
    return replace(settings, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stack(models, pki) -> Iterator[SecureStack]:
    running = start_secure(models, secure_settings(pki, reflection="off"))
    yield running
    running.close()


def request(new_tokens: int = 12) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=new_tokens)


def tls_channel(address: str, pki: dict[str, Path], client: str | None = None) -> grpc.Channel:
    """TLS verifying against our CA; client: 'client' or 'other-client' certificate."""
    key = pki[f"{client}.key"].read_bytes() if client else None
    cert = pki[f"{client}.crt"].read_bytes() if client else None
    credentials = grpc.ssl_channel_credentials(pki["ca.crt"].read_bytes(), key, cert)
    return grpc.secure_channel(address, credentials)


def call_code(fn: object, *args: object, **kwargs: object) -> tuple[grpc.StatusCode, str]:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


# -- `specdec certs` ------------------------------------------------------------------


def test_certs_command_writes_a_verifiable_chain(tmp_path: Path) -> None:
    from cryptography import x509

    out = tmp_path / "certs"
    assert cli.main(["certs", "--out", str(out), "--hosts", "specdec.example,10.1.2.3"]) == 0
    files = {p.name for p in out.iterdir()}
    assert files == {"ca.crt", "server.crt", "server.key", "client.crt", "client.key"}
    for key in ("server.key", "client.key"):
        assert stat.S_IMODE(os.stat(out / key).st_mode) == 0o600, key
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    x509.load_pem_x509_certificate((out / "client.crt").read_bytes()).verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = {str(n) for n in san.get_values_for_type(x509.DNSName)}
    addresses = {str(a) for a in san.get_values_for_type(x509.IPAddress)}
    assert {"localhost", "specdec.example"} <= names
    assert {"127.0.0.1", "10.1.2.3"} <= addresses


# -- API keys -------------------------------------------------------------------------


def test_the_key_up_secure_generates_passes_as_a_command_line_value(tmp_path: Path) -> None:
    """`specdec up --secure` prints `--api-key KEY` for the client: a base64url key
    starts with "-" one time in 64, which argparse reads as an option. Hex never does."""
    env, key = secure_stack_env(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert Path(env["SPECDEC_API_KEYS_FILE"]).read_text().splitlines()[-1] == key


def test_api_keys_skip_comments_and_follow_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# a comment\nalpha\n\n  beta  \n")
    keys = ApiKeys(str(path))
    assert len(keys) == 2 and keys.valid("alpha") and keys.valid("beta")
    assert not keys.valid("# a comment") and not keys.valid("") and not keys.valid("alph")
    replacement = tmp_path / "keys.new"
    replacement.write_text("gamma\n")
    replacement.replace(path)  # rotation by rename: a new inode
    assert keys.valid("gamma") and not keys.valid("alpha")
    path.unlink()  # briefly missing mid-rotation: the last keys stay in force
    assert keys.valid("gamma")
    with pytest.raises(ValueError, match="API keys file"):
        ApiKeys(str(tmp_path / "absent"))


# -- the refusal matrix of a secure stack ---------------------------------------------


def test_right_key_and_certificates_are_served_exactly(stack, models, pki) -> None:
    with tls_channel(stack.coordinator.address, pki) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response = stub.Generate(request(), timeout=60, metadata=bearer(KEY))
        streamed = list(stub.GenerateStream(request(), timeout=60, metadata=bearer(KEY)))
    assert list(response.token_ids) == reference(models, 12)
    assert [t for piece in streamed for t in piece.token_ids] == list(response.token_ids)


def test_public_port_refuses_plaintext_missing_and_wrong_keys(stack, pki) -> None:
    with grpc.insecure_channel(stack.coordinator.address) as channel:
        code, _ = call_code(coordinator_pb2_grpc.CoordinatorStub(channel).Generate, request(),
                            timeout=10, metadata=bearer(KEY))
        assert code == grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no service
    with tls_channel(stack.coordinator.address, pki) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        code, details = call_code(stub.Generate, request(), timeout=10)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in details
        for metadata in (bearer("sk-wrong"), bearer(KEY[:-1]), [("authorization", KEY)],
                         [("authorization", f"Basic {KEY}")]):
            code, details = call_code(stub.Generate, request(), timeout=10, metadata=metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "not valid" in details and KEY not in details
        code, _ = call_code(lambda: list(stub.GenerateStream(request(), timeout=10,
                                                             metadata=bearer("sk-wrong"))))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # Probes need no key; reflection is off here.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        code, _ = call_code(lambda: list(reflect))
        assert code == grpc.StatusCode.UNIMPLEMENTED


def test_rotated_key_is_served_without_restart(stack, pki) -> None:
    path = pki["api-keys"]
    original = path.read_text()
    try:
        path.write_text(f"{OTHER_KEY}\n")
        with tls_channel(stack.coordinator.address, pki) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert stub.Generate(request(4), timeout=60, metadata=bearer(OTHER_KEY)).token_ids
            code, _ = call_code(stub.Generate, request(4), timeout=10, metadata=bearer(KEY))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        path.write_text(original)


@pytest.mark.parametrize("client", [None, "other-client"])
def test_internal_services_refuse_callers_without_our_client_certificate(
        stack, pki, client: str | None) -> None:
    for server, call in ((stack.draft, lambda ch: draft_pb2_grpc.DraftStub(ch).Describe(
                              draft_pb2.DescribeRequest(), timeout=10)),
                         (stack.target, lambda ch: target_pb2_grpc.TargetStub(ch).Release(
                              target_pb2.TargetReleaseRequest(session_id="x"), timeout=10))):
        with tls_channel(server.address, pki, client) as channel:
            code, _ = call_code(call, channel)
        assert code == grpc.StatusCode.UNAVAILABLE, (server.address, client)
        with grpc.insecure_channel(server.address) as channel:
            code, _ = call_code(call, channel)
        assert code == grpc.StatusCode.UNAVAILABLE
        with tls_channel(server.address, pki, "client") as channel:
            code, details = call_code(call, channel)
        assert code == grpc.StatusCode.OK, details


def test_coordinator_side_refuses_services_signed_by_another_ca(stack, pki) -> None:
    # A coordinator trusting another CA (and holding that CA's client certificate) must
    # neither trust our services nor be trusted by them.
    settings = secure_settings(pki, tls_ca_file=str(pki["other-ca.crt"]),
                               tls_client_cert_file=str(pki["other-client.crt"]),
                               tls_client_key_file=str(pki["other-client.key"]))
    pool = ChannelPool(credentials=channel_credentials(settings))
    ours = ChannelPool(credentials=channel_credentials(secure_settings(pki)))
    try:
        assert not pool.check_health(stack.draft.address)
        code, _ = call_code(draft_pb2_grpc.DraftStub(pool.get(stack.draft.address)).Describe,
                            draft_pb2.DescribeRequest(), timeout=10)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert ours.check_health(stack.draft.address)
        assert ours.check_health(stack.target.address)
    finally:
        pool.close()
        ours.close()


def test_health_port_serves_health_only_in_plaintext(models, pki) -> None:
    from specdec.serving.stack import free_port

    port = free_port()
    running = start_secure(models, secure_settings(pki, health_port=port))
    try:
        assert check_health(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            code, _ = call_code(draft_pb2_grpc.DraftStub(channel).Describe,
                                draft_pb2.DescribeRequest(), timeout=10)
        assert code == grpc.StatusCode.UNIMPLEMENTED
        # Reflection stays on by default (the shared stack turns it off).
        with tls_channel(running.coordinator.address, pki) as channel:
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            names = {s.name for r in reflect for s in r.list_services_response.service}
        assert "specdec.v1.Coordinator" in names
        running.draft.stop(0)
        assert not check_health(f"127.0.0.1:{port}")  # the probe port goes with the server
    finally:
        running.close()


def test_non_loopback_plaintext_bind_warns(caplog: pytest.LogCaptureFixture,
                                           models) -> None:
    target = TargetServicer(ModelRunner(models[0]))
    with caplog.at_level(logging.WARNING, logger="specdec.serving.security"):
        handle = build_server([target.service()], host="0.0.0.0")
    handle.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "plaintext" in warnings[0]
    assert "specdec.v1.Target" in warnings[0] and "SPECDEC_TLS_CERT_FILE" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.serving.security"):
        build_server([target.service()], host="127.0.0.1").stop(0)
    assert not caplog.records


# -- limits ---------------------------------------------------------------------------


def test_limits_name_the_setting(models) -> None:
    settings = SecuritySettings(max_sessions=2, max_prompt_tokens=3, max_message_mb=1)
    running = start_secure(models, settings)
    try:
        with grpc.insecure_channel(running.coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            code, details = call_code(stub.Generate, request(), timeout=10)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "SPECDEC_MAX_PROMPT_TOKENS" in details and "at most 3" in details
            short = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT[:3],
                                                    max_new_tokens=4)
            assert len(stub.Generate(short, timeout=60).token_ids) == 4
            # A message over --max-message-mb never reaches the servicer.
            huge = coordinator_pb2.GenerateRequest(prompt="x" * (2 * 1024 * 1024),
                                                   max_new_tokens=4)
            code, _ = call_code(stub.Generate, huge, timeout=10)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with grpc.insecure_channel(running.draft.address) as channel:
            stub_d = draft_pb2_grpc.DraftStub(channel)

            def propose(session: str) -> draft_pb2.ProposeResponse:
                return stub_d.Propose(draft_pb2.ProposeRequest(
                    sync=common_pb2.SyncPoint(session_id=session, committed_position=0,
                                              append_tokens=PROMPT),
                    num_tokens=2, sampling=common_pb2.SamplingParams()), timeout=30)

            propose("a")
            propose("b")
            code, details = call_code(propose, "c")
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SPECDEC_MAX_SESSIONS" in details and "draft" in details
            stub_d.Release(draft_pb2.DraftReleaseRequest(session_id="a"), timeout=10)
            assert propose("c").tokens  # a released session frees its place
    finally:
        running.close()


def test_coordinator_caps_generations_in_flight(models) -> None:
    settings = SecuritySettings(max_sessions=1)
    # A slow target keeps the first generation in flight while the second arrives.
    target_model, _ = models
    target = TargetServicer(ModelRunner(target_model))
    target_server = build_server([target.service()],
                                 interceptors=[DelayInterceptor("Verify", 0.3)])
    channels = ChannelPool()
    coordinator = CoordinatorServicer(target_info(target_model),
                                      StaticEndpoints(target_server.address, None),
                                      channels=channels)
    server = build_server([coordinator.service()], **server_options(settings,
                                                                    role="coordinator"))
    try:
        with grpc.insecure_channel(server.address) as channel, \
                ThreadPoolExecutor(2) as pool:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            first = pool.submit(stub.Generate, request(3), timeout=60)
            time.sleep(0.15)
            code, details = call_code(stub.Generate, request(3), timeout=10)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SPECDEC_MAX_SESSIONS" in details
            assert len(first.result().token_ids) == 3
            assert len(stub.Generate(request(2), timeout=60).token_ids) == 2  # slot freed
    finally:
        server.stop(0)
        channels.close()
        target_server.stop(0)


def test_public_channel_helper_speaks_tls(stack, pki) -> None:
    with public_channel(stack.coordinator.address, ca_file=str(pki["ca.crt"])) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        assert stub.Generate(request(3), timeout=60, metadata=bearer(KEY)).token_ids


def test_settings_from_environment_and_incomplete_tls(pki) -> None:
    settings = SecuritySettings.from_environ({
        "SPECDEC_TLS_CERT_FILE": str(pki["server.crt"]), "SPECDEC_MAX_SESSIONS": "7",
        "SPECDEC_REFLECTION": "off"})
    assert settings.tls_cert_file == str(pki["server.crt"]) and settings.max_sessions == 7
    assert settings.reflection == "off" and settings.internal_tls
    assert SecuritySettings.from_environ({}) == SecuritySettings()
    with pytest.raises(ValueError, match="--tls-key-file"):
        server_options(settings, role="model")
    with pytest.raises(ValueError, match="mutual TLS"):
        server_options(SecuritySettings(tls_ca_file=str(pki["ca.crt"])), role="model")
    with pytest.raises(ValueError, match="cannot read TLS (key|cert)"):
        server_options(SecuritySettings(tls_cert_file="/nonexistent.crt",
                                        tls_key_file="/nonexistent.key"), role="model")
