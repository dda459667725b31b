"""`specdec up --secure` as real processes with tiny models: every open path refused (the
HTTP API's too), the right key and certificates served, and the key in no log, trace file
or /metrics page."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import torch
from child_process import read_until
from tiny_models import save_tiny_pair

from specdec.proto.specdec.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
)
from specdec.serving.security import bearer
from specdec.serving.stack import free_port

SPECDEC = [sys.executable, "-m", "specdec.cli"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


def code_of(fn: object) -> grpc.StatusCode:
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_up_secure_has_no_open_path(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = tiny_pair
    ports = {role: free_port() for role in ("coordinator", "draft", "target", "http")}
    logs, traces = tmp_path / "logs", tmp_path / "traces"
    env = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "SPECDEC_METRICS_PORT": "0",
           "SPECDEC_TRACING": "on", "SPECDEC_TRACE_DIR": str(traces),
           "SPECDEC_TRACE_TOKENS": "on"}
    for name in [n for n in env if n.startswith(("SPECDEC_TLS_", "SPECDEC_API_KEY"))]:
        del env[name]
    up = subprocess.Popen(
        [*SPECDEC, "up", "--secure", "--target-model", str(target), "--draft-model", str(draft),
         "--dtype", "float32", "--draft-dtype", "float32", "--draft-linear-kernel", "torch",
         "--log-dir", str(logs), "--startup-timeout-s", "180",
         *(arg for role, port in ports.items() for arg in (f"--{role}-port", str(port)))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    endpoint = f"127.0.0.1:{ports['coordinator']}"
    try:
        lines = read_until(up, "ready")
        assert lines and lines[-1].startswith("ready"), "".join(lines)
        found = re.search(r"--tls-ca-file (\S+) --api-key (\S+)", lines[-1])
        assert found, lines[-1]
        ca_file, key = found.group(1), found.group(2)
        http_url = f"https://127.0.0.1:{ports['http']}"
        curl = next(line for line in lines if line.startswith("http call: curl"))
        assert f"--cacert {ca_file} -H 'Authorization: Bearer {key}' {http_url}/v1/" in curl
        directory = Path(ca_file).parent
        client = grpc.ssl_channel_credentials(
            Path(ca_file).read_bytes(), (directory / "client.key").read_bytes(),
            (directory / "client.crt").read_bytes())

        generate = [*SPECDEC, "generate", "Hello there", "--chat", "--max-new-tokens", "8",
                    "--endpoint", endpoint, "--timeout-s", "120"]
        served = subprocess.run([*generate, "--tls-ca-file", ca_file, "--api-key", key],
                                capture_output=True, text=True, timeout=180, env=env)
        assert served.returncode == 0, served.stderr
        by_env = subprocess.run(generate, capture_output=True, text=True, timeout=180,
                                env={**env, "SPECDEC_TLS_CA_FILE": ca_file,
                                     "SPECDEC_API_KEY": key})
        assert by_env.returncode == 0, by_env.stderr
        no_key = subprocess.run([*generate, "--tls-ca-file", ca_file], capture_output=True,
                                text=True, timeout=180, env=env)
        assert no_key.returncode == 1 and "UNAUTHENTICATED" in no_key.stderr
        assert "--api-key" in no_key.stderr  # says what to do
        plaintext = subprocess.run([*generate, "--api-key", key], capture_output=True,
                                   text=True, timeout=180, env=env)
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr

        request = coordinator_pb2.GenerateRequest(prompt="Hi", max_new_tokens=2)
        with grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(
                Path(ca_file).read_bytes())) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert code_of(lambda: stub.Generate(request, timeout=30,
                                                 metadata=bearer(key + "x"))) \
                == grpc.StatusCode.UNAUTHENTICATED
        for role in ("draft", "target"):
            address = f"127.0.0.1:{ports[role]}"
            with grpc.secure_channel(address, grpc.ssl_channel_credentials(
                    Path(ca_file).read_bytes())) as channel:  # TLS, no client certificate
                assert code_of(lambda ch=channel: draft_pb2_grpc.DraftStub(ch).Describe(
                    draft_pb2.DescribeRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
            with grpc.insecure_channel(address) as channel:
                assert code_of(lambda ch=channel: draft_pb2_grpc.DraftStub(ch).Describe(
                    draft_pb2.DescribeRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(f"127.0.0.1:{ports['draft']}", client) as channel:
            assert draft_pb2_grpc.DraftStub(channel).Describe(draft_pb2.DescribeRequest(),
                                                              timeout=10).precision

        # The HTTP API: HTTPS with the stack's CA, the key required, /health open.
        context = ssl.create_default_context(cafile=ca_file)
        client = openai.OpenAI(base_url=http_url + "/v1", api_key=key, max_retries=0,
                               timeout=120, http_client=openai.DefaultHttpxClient(
                                   verify=context))
        reply = client.completions.create(model=str(target), prompt="Hi", max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        with urllib.request.urlopen(http_url + "/health", timeout=10, context=context) as ok:
            assert ok.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(
                http_url + "/v1/completions", data=json.dumps({"prompt": "Hi"}).encode(),
                headers={"content-type": "application/json"}), timeout=30, context=context)
        assert refused.value.code == 401
        assert json.loads(refused.value.read())["error"]["code"] == "invalid_api_key"
        with pytest.raises(OSError):  # no plain HTTP on the HTTPS port
            urllib.request.urlopen(http_url.replace("https:", "http:") + "/health", timeout=10)

        # The key appears in no service log, trace file or metrics page.
        texts = {str(p): p.read_text(errors="replace") for p in [*logs.iterdir(),
                                                                 *traces.glob("*")]}
        assert any("coordinator" in name for name in texts) and traces.exists()
        assert any(t.strip() for name, t in texts.items() if name.endswith(".jsonl"))
        metrics_ports = [int(p) for t in texts.values()
                         for p in re.findall(r"Prometheus metrics on [^:\s]*:(\d+)/metrics", t)]
        assert len(metrics_ports) == 3, metrics_ports
        for port in metrics_ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
                texts[f"metrics:{port}"] = page.read().decode()
        for name, text in texts.items():
            assert key not in text, name
    finally:
        up.terminate()
        up.wait(60)
