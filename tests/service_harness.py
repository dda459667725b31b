"""Real gRPC servers on loopback, in this process, over given models (tests only)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from coordinator.clients import ChannelPool
from coordinator.endpoints import StaticEndpoints
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from draft_service.servicer import DraftServicer
from specdec.engine.models import ModelInfo
from specdec.engine.runner import ModelRunner
from specdec.proto.specdec.v1 import coordinator_pb2_grpc
from specdec.serving.grpc_server import ServerHandle, build_server
from target_service.servicer import TargetServicer


def target_info(model: torch.nn.Module, eos: Sequence[int] = ()) -> ModelInfo:
    config = model.config
    return ModelInfo(int(config.vocab_size), int(config.max_position_embeddings), tuple(eos))


@dataclass
class Services:
    """Draft, target and coordinator servers; restart_* replace one with a fresh cache."""

    draft_model: torch.nn.Module | None
    target_model: torch.nn.Module
    settings: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    tokenizer: object | None = None
    eos: Sequence[int] = ()
    session_ttl_s: float = 600.0
    draft_interceptors: Sequence[grpc.ServerInterceptor] = ()
    target_interceptors: Sequence[grpc.ServerInterceptor] = ()
    target_kv_budget_bytes: int | None = None
    draft_token_map: torch.Tensor | None = None  # reduced-vocabulary draft
    draft_precision_text: str = ""  # what Draft.Describe reports
    # build_server's keyword arguments for the coordinator (specdec.serving.security.server_options:
    # TLS, API keys); self.stub is plaintext, so it serves only a coordinator without them.
    coordinator_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.draft: DraftServicer | None = None
        self.draft_server: ServerHandle | None = None
        self.draft_port = 0
        self.target_port = 0
        self.start_target()
        if self.draft_model is not None:
            self.start_draft()
        self.channels = ChannelPool()
        draft_endpoint = f"127.0.0.1:{self.draft_port}" if self.draft_model is not None else None
        self.coordinator = CoordinatorServicer(
            target_info(self.target_model, self.eos),
            StaticEndpoints(f"127.0.0.1:{self.target_port}", draft_endpoint),
            settings=self.settings, tokenizer=self.tokenizer, channels=self.channels)
        self.coordinator_server = build_server([self.coordinator.service()],
                                               **self.coordinator_options)
        self.channel = grpc.insecure_channel(self.coordinator_server.address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def start_target(self) -> None:
        runner = ModelRunner(self.target_model, kv_budget_bytes=self.target_kv_budget_bytes)
        self.target = TargetServicer(runner, session_ttl_s=self.session_ttl_s)
        self.target_server = build_server([self.target.service()], port=self.target_port,
                                          interceptors=self.target_interceptors)
        self.target_port = self.target_server.port

    def start_draft(self) -> None:
        assert self.draft_model is not None
        vocab = int(self.target_model.config.vocab_size)
        runner = ModelRunner(self.draft_model, target_vocab_size=vocab,
                             token_map=self.draft_token_map)
        self.draft = DraftServicer(runner, session_ttl_s=self.session_ttl_s,
                                   precision=self.draft_precision_text)
        self.draft_server = build_server([self.draft.service()], port=self.draft_port,
                                         interceptors=self.draft_interceptors)
        self.draft_port = self.draft_server.port

    @property
    def draft_endpoint(self) -> str:
        return f"127.0.0.1:{self.draft_port}"

    def draft_precision(self) -> str:
        """As specdec bench's ProcessStack answers it: through Draft.Describe."""
        from specdec.bench.harness import described_draft_precision

        return described_draft_precision(self.draft_endpoint)

    @property
    def target_endpoint(self) -> str:
        return f"127.0.0.1:{self.target_port}"

    def stop_draft(self) -> None:
        assert self.draft_server is not None
        self.draft_server.stop(0)

    def stop_target(self) -> None:
        self.target_server.stop(0)

    def close(self) -> None:
        self.channel.close()
        self.coordinator_server.stop(0)
        self.channels.close()
        self.target_server.stop(0)
        if self.draft_server is not None:
            self.draft_server.stop(0)


class DelayInterceptor(grpc.ServerInterceptor):
    """Sleeps before every call of one method: a slow service."""

    def __init__(self, method: str, delay_s: float,
                 when: Callable[[Any], bool] = lambda request: True) -> None:
        self.method = method
        self.delay_s = delay_s
        self.when = when

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.endswith("/" + self.method):
            return handler
        inner = handler.unary_unary

        def delayed(request: Any, context: Any) -> Any:
            if self.when(request):
                time.sleep(self.delay_s)
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            delayed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
