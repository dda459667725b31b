"""The OpenAI-compatible HTTP API: a Starlette app that calls the coordinator over gRPC.

Routes: POST /v1/chat/completions, POST /v1/completions (stream: Server-Sent Events
ending with `data: [DONE]`), GET /v1/models, GET /health (the coordinator's gRPC health).
Every failure answers OpenAI's error object; gRPC statuses map to HTTP statuses
(STATUS_FOR_CODE). A client that disconnects cancels its gRPC call, which ends the
generation and frees both services' caches. An `Authorization` header is forwarded to
the coordinator as gRPC metadata, so the coordinator's API keys apply unchanged; its
UNAUTHENTICATED is a 401 with code `invalid_api_key`. The channel to the coordinator is
TLS when the security settings give a CA or a client certificate (caller_settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec.engine.models import DEFAULT_TARGET
from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.serving.http_api.parsing import ApiError, ParsedRequest, parse
from specdec.serving.security import (
    SecuritySettings,
    caller_settings,
    channel_credentials,
    channel_options,
)
from specdec.settings import default

log = logging.getLogger(__name__)
T = TypeVar("T")

STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# The coordinator's field names, as the HTTP request calls them (first match wins).
PARAM_FOR_FIELD = (
    ("max_new_tokens", "max_tokens"), ("sampling.temperature", "temperature"),
    ("sampling.top_p", "top_p"), ("sampling.top_k", "top_k"), ("sampling.min_p", "min_p"),
    ("speculation.num_draft_tokens", "num_draft_tokens"),
    ("speculation.method", "speculation_method"), ("cache_salt", "cache_salt"),
    ("messages", "messages"),
    ("prompt_token_ids", "prompt"), ("prompt", "prompt"), ("stop", "stop"),
)
# specdec's finish reasons -> OpenAI's ("eos": the model ended its turn).
FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop"}
TRACE_HEADER = "x-specdec-trace-id"
REQUEST_ID_HEADER = "x-request-id"


@dataclass(frozen=True)
class HttpSettings:
    coordinator_endpoint: str = default("coordinator-endpoint")
    served_model_name: str = DEFAULT_TARGET
    default_max_tokens: int = 256  # requests without max_tokens / max_completion_tokens
    request_timeout_s: float = 600.0  # gRPC deadline of one generation
    # TLS of the HTTP port, and of the channel to the coordinator.
    security: SecuritySettings = field(default_factory=SecuritySettings)


# The coordinator's own messages name gRPC metadata and `specdec generate`; an HTTP
# caller sends a header. Neither names the key that was sent.
NO_KEY = ("this server requires an API key: send the header 'Authorization: Bearer <key>' "
          "(the openai client's api_key, or OPENAI_API_KEY); ask its operator for a key "
          "from the coordinator's SPECDEC_API_KEYS_FILE")
WRONG_KEY = ("the API key is not valid on this server (unknown, revoked, or not in the "
             "form 'Authorization: Bearer <key>'); ask its operator for a key from the "
             "coordinator's SPECDEC_API_KEYS_FILE")


def api_error_from_rpc(error: grpc.aio.AioRpcError, key_sent: bool = True) -> ApiError:
    code = error.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ApiError(401, WRONG_KEY if key_sent else NO_KEY, code="invalid_api_key")
    details = error.details() or code.name
    status = STATUS_FOR_CODE.get(code, 500)
    param = None
    if status == 400:
        param = next((p for field, p in PARAM_FOR_FIELD if details.startswith(field)), None)
    return ApiError(status, details, param=param, code=code.name.lower())


def usage(stats: coordinator_pb2.GenerationStats) -> dict[str, Any]:
    """OpenAI's token counts, plus this request's speculative decoding statistics."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "speculation": {
            "rounds": stats.rounds,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
        },
    }


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has gone (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The HTTP client disconnected; its gRPC call has been cancelled."""


async def _unless_disconnected(request: Request, call: grpc.aio.Call,
                               result: Awaitable[T]) -> T:
    """Await one step of `call`, cancelling the call if the client disconnects first."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(lambda task: task.cancelled() or call.cancel())
    try:
        return await result
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


class Completions:
    """The two generation routes; `chat` picks the request and response shapes."""

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.channel: grpc.aio.Channel | None = None
        # The generated stub's annotations describe the blocking API; on an aio channel
        # its methods return grpc.aio calls.
        self.stub: Any = None
        self.health: health_pb2_grpc.HealthStub | None = None
        self.created = int(time.time())
        # Read here, before the server starts: a missing CA file is an error at startup.
        self.security = caller_settings(settings.security)
        self.credentials = channel_credentials(self.security)

    # -- lifecycle (inside the server's event loop) ----------------------------------------
    async def open(self) -> None:
        endpoint, options = self.settings.coordinator_endpoint, channel_options(self.security)
        self.channel = (grpc.aio.insecure_channel(endpoint, options=options)
                        if self.credentials is None else
                        grpc.aio.secure_channel(endpoint, self.credentials, options=options))
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    # -- routes ----------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completion(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.served_model_name, "object": "model",
             "created": self.created, "owned_by": "specdec"}]})

    async def healthz(self, request: Request) -> Response:
        assert self.health is not None
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as error:
            return error_response(ApiError(
                503, f"coordinator {self.settings.coordinator_endpoint}: "
                f"{error.code().name}: {error.details()}", code="coordinator_unavailable"))
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return error_response(ApiError(503, "coordinator is not serving",
                                           code="coordinator_unavailable"))
        return JSONResponse({"status": "ok"})

    # -- generation ------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ApiError(400, f"the request body is not valid JSON: {error}") from error
            parsed = parse(body, chat=chat, served_model=self.settings.served_model_name,
                           default_max_tokens=self.settings.default_max_tokens,
                           request_id=request_id)
            metadata = self._metadata(request)
            if parsed.stream:
                return await self._stream(request, parsed, chat, metadata)
            return await self._unary(request, parsed, chat, metadata)
        except ApiError as error:
            return error_response(error)
        except ClientGone:
            log.info("request %s: client disconnected; generation cancelled", request_id)
            return Response(status_code=499)  # nobody reads it

    @staticmethod
    def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
        authorization = request.headers.get("authorization")
        # gRPC metadata carries printable ASCII only, and no key has other characters:
        # such a header is dropped, and a coordinator that requires keys refuses the call.
        if not authorization or not (authorization.isascii() and authorization.isprintable()):
            return ()
        return (("authorization", authorization),)

    @staticmethod
    def _key_sent(request: Request) -> bool:
        return bool(request.headers.get("authorization"))

    def _envelope(self, chat: bool, request_id: str, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat
                                                                      else "")
        return {"id": ("chatcmpl-" if chat else "cmpl-") + request_id, "object": kind,
                "created": int(time.time()), "model": self.settings.served_model_name}

    async def _unary(self, request: Request, parsed: ParsedRequest, chat: bool,
                     metadata: tuple[tuple[str, str], ...]) -> Response:
        assert self.stub is not None
        call: grpc.aio.UnaryUnaryCall = self.stub.Generate(
            parsed.generate, timeout=self.settings.request_timeout_s, metadata=metadata)
        try:
            reply: coordinator_pb2.GenerateResponse = await _unless_disconnected(
                request, call, call)
        except grpc.aio.AioRpcError as error:
            raise api_error_from_rpc(error, self._key_sent(request)) from error
        finish = FINISH_REASONS.get(reply.finish_reason, reply.finish_reason)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        body = {**self._envelope(chat, parsed.generate.request_id, chunk=False),
                "choices": [choice], "usage": usage(reply.stats)}
        headers = {REQUEST_ID_HEADER: parsed.generate.request_id}
        if reply.trace_id:
            body["trace_id"] = reply.trace_id
            headers[TRACE_HEADER] = reply.trace_id
        return JSONResponse(body, headers=headers)

    async def _stream(self, request: Request, parsed: ParsedRequest, chat: bool,
                      metadata: tuple[tuple[str, str], ...]) -> Response:
        assert self.stub is not None
        call: grpc.aio.UnaryStreamCall = self.stub.GenerateStream(
            parsed.generate, timeout=self.settings.request_timeout_s, metadata=metadata)
        # The first message before the headers: a request the coordinator rejects gets
        # its HTTP status (400, 429, ...) instead of an error inside a 200 stream.
        try:
            first = await _unless_disconnected(request, call, call.read())
        except grpc.aio.AioRpcError as error:
            raise api_error_from_rpc(error, self._key_sent(request)) from error
        envelope = self._envelope(chat, parsed.generate.request_id, chunk=True)

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice["delta"] = delta
            else:
                choice["text"] = text or ""
            out = {**envelope, "choices": [choice]}
            if parsed.include_usage:
                out["usage"] = None  # OpenAI's shape: only the extra last chunk has usage
            return out

        async def events() -> AsyncIterator[str]:
            message = first
            try:
                if chat:
                    yield sse(chunk("", None, role=True))
                while message is not grpc.aio.EOF:
                    assert isinstance(message, coordinator_pb2.GenerateResponse)
                    if message.text:
                        yield sse(chunk(message.text, None))
                    if message.finish_reason:
                        last = chunk(None, FINISH_REASONS.get(message.finish_reason,
                                                              message.finish_reason))
                        if message.trace_id:
                            last["trace_id"] = message.trace_id
                        yield sse(last)
                        if parsed.include_usage:
                            yield sse({**envelope, "choices": [],
                                       "usage": usage(message.stats)})
                    message = await call.read()
                yield sse("[DONE]")
            except grpc.aio.AioRpcError as error:  # after the headers: an error event
                yield sse(api_error_from_rpc(error).body())
                yield sse("[DONE]")
            finally:
                call.cancel()  # a no-op once the call has ended; else the client has gone

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={REQUEST_ID_HEADER: parsed.generate.request_id,
                                          "cache-control": "no-cache"})


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return error_response(ApiError(error.status_code, f"{request.method} {request.url.path}: "
                                   f"{error.detail}", code=str(error.status_code)))


async def _internal_error(request: Request, error: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}"))


def create_app(settings: HttpSettings) -> Starlette:
    completions = Completions(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await completions.open()
        try:
            yield
        finally:
            await completions.close()

    routes = [
        Route("/v1/chat/completions", completions.chat, methods=["POST"]),
        Route("/v1/completions", completions.completion, methods=["POST"]),
        Route("/v1/models", completions.models, methods=["GET"]),
        Route("/health", completions.healthz, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.tls_to_coordinator = completions.credentials is not None
    return app
