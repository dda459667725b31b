"""OpenAI request bodies -> GenerateRequest; ApiError carries OpenAI's error object.

Fields keep OpenAI's names and meanings (temperature defaults to 1, as OpenAI's does).
Fields that would change the output in ways specdec does not implement (logprobs, tools,
penalties, several choices) are rejected with a 400 naming them rather than ignored;
fields that change nothing here (user, metadata, store, ...) are accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2
from specdec.settings import SPECULATION_METHODS

# OpenAI's sampling default; specdec's gRPC API instead defaults to greedy.
DEFAULT_TEMPERATURE = 1.0
MAX_SEED = 2**64 - 1
# "developer" is OpenAI's newer name for the system turn.
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}
# Accepted only at their no-op values: anything else would change the output.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
}


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error",
            403: "permission_error", 404: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class ParsedRequest:
    generate: coordinator_pb2.GenerateRequest
    stream: bool
    include_usage: bool


def parse(body: Any, *, chat: bool, served_model: str, default_max_tokens: int,
          request_id: str) -> ParsedRequest:
    """A /v1/chat/completions (chat) or /v1/completions body -> the gRPC request."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served_model!r} (GET /v1/models)", param="model",
                       code="model_not_found")
    for name, allowed in NEUTRAL_VALUES.items():
        if body.get(name) not in allowed:
            raise ApiError(400, f"{name} is not supported by specdec (only "
                           f"{' or '.join(map(_json, allowed))})", param=name,
                           code="unsupported_parameter")
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid("n", f"n must be 1 (one choice per request), got {_json(n)}")
    request = coordinator_pb2.GenerateRequest(request_id=request_id)
    if chat:
        if "prompt" in body:
            raise invalid("prompt", "/v1/chat/completions takes messages, not prompt "
                          "(prompt belongs to /v1/completions)")
        _set_messages(request, body.get("messages"))
    else:
        if "messages" in body:
            raise invalid("messages", "/v1/completions takes prompt, not messages "
                          "(messages belong to /v1/chat/completions)")
        _set_prompt(request, body.get("prompt"))
    request.max_new_tokens = _max_tokens(body, default_max_tokens)
    _set_sampling(request.sampling, body)
    _set_speculation(request, body)
    request.stop.extend(_stop(body.get("stop")))
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options applies only when stream is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "stream_options must be an object")
        include_usage = _bool(options, "include_usage", False, prefix="stream_options.")
    return ParsedRequest(request, stream, include_usage)


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _bool(body: dict[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(prefix + name, f"{prefix}{name} must be true or false, got {_json(value)}")
    return value


def _text_content(content: Any, param: str) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise invalid(f"{param}[{index}]", f"{param}[{index}] must be a text part "
                              '{"type": "text", "text": "..."}; specdec models read text only')
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(param, f"{param} must be a string or a list of text parts")


def _set_messages(request: coordinator_pb2.GenerateRequest, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of "
                      '{"role": ..., "content": ...} objects')
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(param, f"{param} must be an object with role and content")
        role = message.get("role")
        if role not in ROLE_NAMES:
            raise invalid(f"{param}.role", f"{param}.role must be one of "
                          f"{', '.join(ROLE_NAMES)}; got {_json(role)}")
        if message.get("tool_calls"):
            raise ApiError(400, f"{param}.tool_calls: tools are not supported by specdec",
                           param=f"{param}.tool_calls", code="unsupported_parameter")
        request.messages.add(role=ROLE_NAMES[role],
                             content=_text_content(message.get("content"), f"{param}.content"))


def _set_prompt(request: coordinator_pb2.GenerateRequest, prompt: Any) -> None:
    """One prompt: a string or a list of token ids (or a list holding one of either)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt is empty")
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(-2**31 <= t < 2**31 for t in prompt):
            raise invalid("prompt", "prompt token ids must be 32-bit integers")
        request.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("prompt", "one prompt per request: prompt must be a string or a list "
                      "of token ids, not a batch of prompts")
    else:
        raise invalid("prompt", "prompt is required: a string or a list of token ids")


def _max_tokens(body: dict[str, Any], default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or not 0 < value < 2**31:
            raise invalid(name, f"{name} must be a positive integer, got {_json(value)}")
        return int(value)
    return default


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise invalid(name, f"{name} must be a number in [{low:g}, {high:g}], got {_json(value)}")
    return float(value)


def _set_sampling(sampling: common_pb2.SamplingParams, body: dict[str, Any]) -> None:
    sampling.temperature = _number(body, "temperature", 0.0, 2.0, DEFAULT_TEMPERATURE)
    sampling.top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if body.get("top_p") is not None and sampling.top_p == 0.0:
        raise invalid("top_p", "top_p must be above 0 (1 keeps every token)")
    sampling.min_p = _number(body, "min_p", 0.0, 1.0, 0.0)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or not -1 <= top_k < 2**31:
            raise invalid("top_k", f"top_k must be an integer >= 0 (0 or -1 = off), "
                          f"got {_json(top_k)}")
        sampling.top_k = max(0, top_k)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise invalid("seed", f"seed must be an integer in [0, 2^64), got {_json(seed)}")
        sampling.seed = seed


def _set_speculation(request: coordinator_pb2.GenerateRequest, body: dict[str, Any]) -> None:
    """specdec's extensions: num_draft_tokens (0 = target only), adaptive and
    speculation_method (SpeculationParams.method); each one left out takes the
    coordinator's default. cache_salt (vLLM's field) partitions the suffix cache."""
    num_draft_tokens = body.get("num_draft_tokens")
    if num_draft_tokens is not None:
        if not _is_int(num_draft_tokens) or not 0 <= num_draft_tokens < 2**31:
            raise invalid("num_draft_tokens", f"num_draft_tokens must be an integer >= 0, "
                          f"got {_json(num_draft_tokens)}")
        request.speculation.num_draft_tokens = num_draft_tokens
    if body.get("adaptive") is not None:
        request.speculation.adaptive = _bool(body, "adaptive", True)
    method = body.get("speculation_method")
    if method is not None:
        if method not in SPECULATION_METHODS:
            raise invalid("speculation_method", f"speculation_method must be one of "
                          f"{', '.join(map(_json, SPECULATION_METHODS))}, got {_json(method)}")
        request.speculation.method = method
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise invalid("cache_salt", f"cache_salt must be a string, got {_json(salt)}")
        request.cache_salt = salt


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "stop must be a non-empty string or a list of them")
    return list(stop)
