"""`specdec http` with the stack's security settings: HTTPS with the certificates of
`specdec up --secure` (specdec.serving.security.secure_stack_env), TLS to a coordinator that
requires API keys, and OpenAI's 401 error object for a missing or wrong key. Real
processes and servers over tiny models with the real SmolLM2 tokenizer, called with the
official `openai` client."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from child_process import read_until
from service_harness import Services
from tiny_models import tiny_llama
from transformers import AutoTokenizer

from specdec.commands.http import HttpProcess, start_http
from specdec.engine.models import DEFAULT_TARGET, resolve
from specdec.serving.security import SecuritySettings, secure_stack_env, server_options
from specdec.serving.stack import free_port

MODEL = "tiny-smollm2"
HELLO = [{"role": "user", "content": "Hello"}]
ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class Secured:
    http: HttpProcess
    ca_file: str
    key: str

    def client(self, key: str, verify: ssl.SSLContext | bool | None = None) -> openai.OpenAI:
        context = verify if verify is not None else ssl.create_default_context(
            cafile=self.ca_file)
        return openai.OpenAI(base_url=self.http.url + "/v1", api_key=key, max_retries=0,
                             timeout=60, http_client=openai.DefaultHttpxClient(verify=context))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    torch.set_num_threads(1)
    env, key = secure_stack_env(tmp_path_factory.mktemp("secure"))
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET, progress=False))
    # The coordinator as `specdec serve` builds it from these settings: TLS, API keys.
    options = server_options(SecuritySettings.from_environ(env), role="coordinator")
    services = Services(tiny_llama(len(tokenizer), seed=2, layers=1),
                        tiny_llama(len(tokenizer), seed=1, layers=1), tokenizer=tokenizer,
                        eos=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
                        coordinator_options=options)
    http = start_http(services.coordinator_server.address, free_port(), MODEL, 60, env=env)
    try:
        yield Secured(http, env["SPECDEC_TLS_CA_FILE"], key)
    finally:
        assert http.stop() == 0
        services.close()


def call(url: str, ca_file: str, body: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One HTTPS request without the SDK: (status, parsed JSON body)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode() if body is not None else None,
        headers={"content-type": "application/json", **(headers or {})})
    context = ssl.create_default_context(cafile=ca_file)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_right_key_over_https_generates(secured: Secured) -> None:
    assert secured.http.url.startswith("https://")
    client = secured.client(secured.key)
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].message.content and plain.usage is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == plain.choices[0].message.content
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_no_key_is_a_401_error_object(secured: Secured, stream: bool) -> None:
    status, body = call(secured.http.url + "/v1/chat/completions", secured.ca_file,
                        {"messages": HELLO, "max_tokens": 4, "stream": stream})
    assert status == 401 and set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS
    error = body["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert "Authorization: Bearer <key>" in error["message"]


def test_a_wrong_key_is_a_401_that_does_not_echo_it(secured: Secured) -> None:
    wrong = "sk-wrong-" + secured.key[:6]
    with pytest.raises(openai.AuthenticationError) as caught:
        secured.client(wrong).chat.completions.create(model=MODEL, messages=HELLO,
                                                      max_tokens=4)
    assert caught.value.status_code == 401
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == ERROR_FIELDS
    assert error["code"] == "invalid_api_key" and "not valid" in error["message"]
    assert wrong not in error["message"] and secured.key not in error["message"]
    with pytest.raises(openai.AuthenticationError):  # streamed: the status, not a 200
        secured.client(wrong).completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                                 stream=True)
    # A header gRPC metadata cannot carry (not ASCII) is no key either: a 401, not a 500.
    status, body = call(secured.http.url + "/v1/completions", secured.ca_file,
                        {"prompt": "Hi", "max_tokens": 2}, {"Authorization": "Bearer caf\u00e9"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_health_answers_without_a_key(secured: Secured) -> None:
    assert call(secured.http.url + "/health", secured.ca_file) == (200, {"status": "ok"})


def test_plain_http_and_unverified_tls_are_refused(secured: Secured) -> None:
    plain = secured.http.url.replace("https://", "http://")
    with pytest.raises(OSError):  # the server speaks TLS only: no HTTP answer
        urllib.request.urlopen(plain + "/health", timeout=10)
    # Without the CA the client cannot verify the server's certificate.
    with pytest.raises(openai.APIConnectionError):
        secured.client(secured.key, verify=ssl.create_default_context()).models.list()


def test_a_plaintext_non_loopback_bind_warns(tmp_path: Path) -> None:
    port = free_port("0.0.0.0")
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "http", "--http-host", "0.0.0.0",
         "--http-port", str(port), "--coordinator-endpoint", f"127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = "".join(read_until(process, "http serving on"))
        assert "in plaintext on a non-loopback interface" in output, output
        assert "/v1/chat/completions" in output and "SPECDEC_TLS_CERT_FILE" in output
    finally:
        process.terminate()
        process.communicate(timeout=30)
