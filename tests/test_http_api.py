"""The OpenAI-compatible HTTP API (`specdec http`) with the official `openai` client, in
front of real gRPC services over tiny models that use the real SmolLM2 tokenizer (so
text, chat templates and stop strings work end to end); and `specdec up` serving it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from child_process import read_until
from service_harness import DelayInterceptor, Services
from tiny_models import save_tiny_pair, tiny_llama
from transformers import AutoTokenizer

from coordinator.servicer import CoordinatorSettings
from specdec.commands.http import start_http
from specdec.engine.models import DEFAULT_TARGET, resolve
from specdec.proto.specdec.v1 import coordinator_pb2
from specdec.serving.stack import free_port

# Every test here reads the one stack the module fixture starts: on one worker, it starts once.
pytestmark = pytest.mark.xdist_group("http-api-stack")
MODEL = "tiny-smollm2"
LIMIT = 200  # the coordinator's max_new_tokens limit
VERIFY_DELAY_S = 0.02  # per Verify: a long generation takes seconds, so cancelling shows
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]


class Stack:
    def __init__(self, services: Services, url: str, tokenizer: Any,
                 verify_calls: list[int]) -> None:
        self.services = services
        self.url = url
        self.tokenizer = tokenizer
        self.verify_calls = verify_calls
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                    timeout=60)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET, progress=False))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    verify_calls = [0]

    def count(request: object) -> bool:
        verify_calls[0] += 1
        return True

    services = Services(tiny_llama(len(tokenizer), seed=2, layers=1),
                        tiny_llama(len(tokenizer), seed=1, layers=2),
                        settings=CoordinatorSettings(max_new_tokens_limit=LIMIT),
                        tokenizer=tokenizer, eos=[eos],
                        target_interceptors=[DelayInterceptor("Verify", VERIFY_DELAY_S,
                                                              when=count)])
    # The served model name is the target model setting's.
    http = start_http(services.coordinator_server.address, free_port(), MODEL, 60)
    yield Stack(services, http.url, tokenizer, verify_calls)
    assert http.stop() == 0
    services.close()


def raw(url: str, body: bytes | None = None, method: str = "POST") -> tuple[int, Any]:
    """One HTTP request without the SDK: (status, parsed JSON body)."""
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def greedy(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, "max_tokens": 16, **fields}


# -- chat --------------------------------------------------------------------------------
def test_chat_plain_and_streamed_agree_and_render_the_conversation(stack: Stack) -> None:
    plain = stack.client.chat.completions.create(messages=CONVERSATION, **greedy())
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    rendered = stack.tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                   tokenize=False)
    prompt_ids = stack.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert plain.usage is not None
    assert plain.usage.prompt_tokens == len(prompt_ids)
    assert plain.usage.completion_tokens == 16 or choice.finish_reason == "stop"
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    speculation = plain.usage.model_extra["speculation"]
    assert speculation["rounds"] > 0 and speculation["draft_tokens"] > 0
    assert 0.0 <= speculation["acceptance_rate"] <= 1.0
    assert speculation["mean_accepted_length"] >= 1.0

    # The same conversation through the gRPC API: the same text.
    grpc_reply = stack.services.stub.Generate(coordinator_pb2.GenerateRequest(
        messages=[coordinator_pb2.ChatMessage(**m) for m in CONVERSATION],
        max_new_tokens=16), timeout=60)
    assert grpc_reply.text == choice.message.content
    by_ids = stack.services.stub.Generate(coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids, max_new_tokens=16), timeout=60)
    assert by_ids.token_ids == grpc_reply.token_ids

    chunks = list(stack.client.chat.completions.create(
        messages=CONVERSATION, stream=True, stream_options={"include_usage": True},
        **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sampled_requests_with_a_seed_repeat(stack: Stack) -> None:
    # A seed fixes every draw by position; the tokens also depend on the draft lengths
    # the rounds use, so the repeat fixes the length (adaptive lengths follow timing).
    fields = {"model": MODEL, "temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 12,
              "messages": [{"role": "user", "content": "Hello"}],
              "extra_body": {"num_draft_tokens": 3, "adaptive": False}}
    first = stack.client.chat.completions.create(**fields)
    again = stack.client.chat.completions.create(**fields)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       stack.client.chat.completions.create(stream=True, **fields) if c.choices)
    assert first.choices[0].message.content == again.choices[0].message.content == streamed


def test_text_content_parts_and_developer_role(stack: Stack) -> None:
    as_parts = stack.client.chat.completions.create(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "there"}]}], **greedy())
    as_text = stack.client.chat.completions.create(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"}], **greedy())
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage is not None and as_text.usage is not None
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


BAD_GRPC_MESSAGES = {
    "messages and prompt": (dict(prompt="hi"), "not both prompt and messages"),
    "messages and token ids": (dict(prompt_token_ids=[1, 2]),
                               "not both prompt_token_ids and messages"),
    "unknown role": (dict(role="tool"), "messages[1].role must be one of"),
    "chat flag": (dict(chat=True), "chat applies the chat template to `prompt`"),
}


@pytest.mark.parametrize("case", sorted(BAD_GRPC_MESSAGES))
def test_grpc_messages_are_checked(stack: Stack, case: str) -> None:
    fields, named = BAD_GRPC_MESSAGES[case]
    fields = dict(fields)
    request = coordinator_pb2.GenerateRequest(max_new_tokens=4, messages=[
        coordinator_pb2.ChatMessage(role="system", content="Be brief."),
        coordinator_pb2.ChatMessage(role=str(fields.pop("role", "user")), content="")])
    for name, value in fields.items():
        if name == "prompt_token_ids":
            request.prompt_token_ids.extend(value)  # type: ignore[arg-type]
        else:
            setattr(request, name, value)
    with pytest.raises(grpc.RpcError) as caught:
        stack.services.stub.Generate(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details(), caught.value.details()


def test_grpc_empty_turns_are_valid(stack: Stack) -> None:
    reply = stack.services.stub.Generate(coordinator_pb2.GenerateRequest(
        max_new_tokens=2, messages=[coordinator_pb2.ChatMessage(role="user", content="")]),
        timeout=30)
    assert len(reply.token_ids) == 2 or reply.finish_reason == "eos"


# -- completions -------------------------------------------------------------------------
def test_completions_plain_and_streamed_agree(stack: Stack) -> None:
    plain = stack.client.completions.create(prompt="Once upon a time", **greedy())
    assert plain.object == "text_completion" and plain.choices[0].text
    prompt_ids = stack.tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    assert plain.usage is not None and plain.usage.prompt_tokens == len(prompt_ids)
    streamed = list(stack.client.completions.create(prompt="Once upon a time", stream=True,
                                                    **greedy()))
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    by_ids = stack.client.completions.create(prompt=prompt_ids, **greedy())
    assert by_ids.choices[0].text == plain.choices[0].text


def test_stop_strings_cut_plain_and_streamed_text(stack: Stack) -> None:
    full = stack.client.completions.create(prompt="The list:", **greedy(max_tokens=24))
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2, text
    expected = text[:text.index(stop)]
    cut = stack.client.completions.create(prompt="The list:", stop=[stop],
                                          **greedy(max_tokens=24))
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = list(stack.client.completions.create(prompt="The list:", stop=stop, stream=True,
                                                    **greedy(max_tokens=24)))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_an_authorization_header_reaches_a_coordinator_without_keys(stack: Stack) -> None:
    # Not ASCII, so not sendable as gRPC metadata: dropped, and no key is required here.
    request = urllib.request.Request(
        stack.url + "/v1/completions", method="POST",
        data=json.dumps(greedy(prompt="Hi", max_tokens=2)).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer caf\u00e9"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200 and json.loads(reply.read())["choices"]


def test_models_and_health(stack: Stack) -> None:
    assert [m.id for m in stack.client.models.list()] == [MODEL]
    status, body = raw(stack.url + "/health", method="GET")
    assert (status, body) == (200, {"status": "ok"})


# -- errors ------------------------------------------------------------------------------
BAD_CHAT: dict[str, tuple[dict[str, Any], str]] = {
    "n=2": ({"n": 2}, "n"),
    "temperature above 2": ({"temperature": 2.5}, "temperature"),
    "temperature as text": ({"temperature": "hot"}, "temperature"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens over the coordinator's limit": ({"max_tokens": LIMIT + 1}, "max_tokens"),
    "tool role": ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    "no messages": ({"messages": []}, "messages"),
    "image part": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "negative seed": ({"seed": -1}, "seed"),
    "empty stop": ({"stop": [""]}, "stop"),
    "too many draft tokens": ({"num_draft_tokens": 1000}, "num_draft_tokens"),
    "adaptive as text": ({"adaptive": "yes"}, "adaptive"),
    "unknown speculation_method": ({"speculation_method": "fast"}, "speculation_method"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}},
                                      "stream_options"),
}


# specdec's own fields: the SDK sends them through extra_body.
EXTENSIONS = ("num_draft_tokens", "adaptive", "speculation_method", "top_k", "min_p")


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_requests_get_a_400_naming_the_field(stack: Stack, case: str) -> None:
    fields, param = BAD_CHAT[case]
    body = {"messages": [{"role": "user", "content": "hi"}], **greedy(), **fields}
    extensions = {name: body.pop(name) for name in EXTENSIONS if name in body}
    for stream in ((False, True) if "stream_options" not in fields else (False,)):
        with pytest.raises(openai.BadRequestError) as caught:
            stack.client.chat.completions.create(**{**body, "stream": stream},
                                                 extra_body=extensions)
        error = caught.value.body
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert error["message"]


def test_unknown_model_is_a_404_and_bad_json_a_400(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        stack.client.completions.create(prompt="hi", **greedy(model="gpt-4o"))
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "model_not_found" and MODEL in caught.value.body["message"]
    status, body = raw(stack.url + "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = raw(stack.url + "/v1/nothing", b"{}")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = raw(stack.url + "/v1/completions", method="GET")
    assert status == 405 and "error" in body
    # The server still answers after the bad requests.
    assert stack.client.completions.create(prompt="hi", **greedy(max_tokens=2)).choices


def test_disconnecting_cancels_the_generation(stack: Stack) -> None:
    target_sessions = stack.services.target.sessions.runner
    before = stack.verify_calls[0]
    body = json.dumps({"model": MODEL, "temperature": 1.0, "seed": 1, "max_tokens": LIMIT,
                       "num_draft_tokens": 1, "prompt": "Count:", "stream": True}).encode()
    request = urllib.request.Request(stack.url + "/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    reply = urllib.request.urlopen(request, timeout=60)
    assert reply.status == 200 and reply.readline().startswith(b"data: {")
    reply.close()  # the client goes away after the first chunk
    deadline = time.monotonic() + 10
    while target_sessions.active_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert target_sessions.active_sessions == 0, "the cancelled session kept its cache"
    rounds = stack.verify_calls[0] - before
    time.sleep(0.5)
    assert stack.verify_calls[0] - before == rounds, "rounds ran on after the disconnect"
    # One draft token per round: a finished generation would take LIMIT / 2 rounds or more.
    assert rounds < LIMIT // 4


# -- `specdec up` ------------------------------------------------------------------------
def test_up_serves_the_http_api(tmp_path: Path) -> None:
    target, draft = save_tiny_pair(tmp_path / "models")
    ports = {role: free_port() for role in ("coordinator", "draft", "target", "http")}
    env = {**os.environ, "SPECDEC_TORCH_THREADS": "1", "SPECDEC_METRICS_PORT": "0",
           "SPECDEC_TRACING": "off"}
    up = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "up", "--target-model", str(target),
         "--draft-model", str(draft), "--draft-dtype", "float32",
         "--draft-linear-kernel", "torch", "--log-dir", str(tmp_path / "logs"),
         "--startup-timeout-s", "120",
         *(arg for role, port in ports.items() for arg in (f"--{role}-port", str(port)))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = read_until(up, "ready")
        assert any(line.startswith(f"http         http://127.0.0.1:{ports['http']}")
                   for line in lines), "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1",
                               api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [str(target)]
        reply = client.chat.completions.create(
            model=str(target), messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
    assert up.returncode == 0, rest
    assert "stopped: http exit 0" in rest


# -- Kubernetes --------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_serves_the_http_api_with_http_probes(overlay: str) -> None:
    from test_k8s import K8S, docs, find

    objects = docs(K8S / "overlays" / overlay)
    pod = find(objects, "Deployment", "specdec-http")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"][-2:] == ["specdec", "http"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPECDEC_COORDINATOR_ENDPOINT"] == "specdec-coordinator:50051"
    assert env["SPECDEC_HTTP_HOST"] == "0.0.0.0"
    port = int(env["SPECDEC_HTTP_PORT"])
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "livenessProbe"):  # never restarted for a coordinator outage
        assert container[probe]["httpGet"]["path"] == "/v1/models"
    service = find(objects, "Service", "specdec-http")["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["ports"][0]["targetPort"] == "http"
    # The served model id follows the ConfigMap's target model, as the coordinator's does.
    assert container["envFrom"] == [{"configMapRef": {"name": next(
        o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"
        and o["metadata"]["name"].startswith("specdec-config"))}}]
