"""Build the coordinator server from `specdec serve coordinator` flags."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from coordinator.clients import ChannelPool
from coordinator.endpoints import ReplicaEndpoints
from coordinator.servicer import CoordinatorServicer, CoordinatorSettings
from specdec.engine.models import load_tokenizer, model_info
from specdec.engine.tokenizer_check import check_pair
from specdec.serving.grpc_server import ServerHandle, build_server
from specdec.serving.security import (
    SecuritySettings,
    channel_credentials,
    channel_options,
    server_options,
)
from specdec.settings import DEFAULT_PORTS
from specdec.telemetry.service import Telemetry

log = logging.getLogger(__name__)


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    return CoordinatorSettings(
        num_draft_tokens=args.num_draft_tokens, max_draft_tokens=args.max_draft_tokens,
        draft_confidence=args.draft_confidence, num_alternatives=args.draft_alternatives,
        prompt_lookup_tokens=args.prompt_lookup_tokens, decode_steps=args.decode_steps,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_prompt_tokens=getattr(args, "max_prompt_tokens", 0),
        draft_timeout_s=args.draft_timeout_ms / 1000, target_timeout_s=args.target_timeout_s,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        suffix_max_tokens=args.suffix_max_tokens,
        suffix_max_tree_depth=args.suffix_max_tree_depth,
        suffix_prompt_tokens=args.suffix_prompt_tokens,
        suffix_max_cached_requests=args.suffix_max_cached_requests,
        suffix_cache_mb=args.suffix_cache_mb,
        suffix_max_spec_factor=args.suffix_max_spec_factor,
        suffix_min_token_prob=args.suffix_min_token_prob,
        suffix_share_tenants=args.suffix_share_tenants == "on")


def replica_endpoints(args: argparse.Namespace, channels: ChannelPool) -> ReplicaEndpoints:
    """The draft and target replica sets named by --draft-endpoint / --target-endpoint."""
    draft = args.draft_endpoint if args.draft_endpoint.lower() not in ("", "none") else None
    return ReplicaEndpoints(
        args.target_endpoint, draft,
        default_ports=(DEFAULT_PORTS["target"], DEFAULT_PORTS["draft"]),
        # A replica marked down returns as soon as it answers a health check.
        health_check=channels.check_health, on_replicas=channels.retain)


def create(args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
           telemetry: Telemetry | None = None) -> ServerHandle:
    return create_with_endpoints(args, interceptors, telemetry)[0]


def create_with_endpoints(
        args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
        telemetry: Telemetry | None = None) -> tuple[ServerHandle, ReplicaEndpoints]:
    """The server, and the replica sets it routes to (for a caller that replaces replicas,
    e.g. `specdec ray`)."""
    # Only the target's tokenizer and config: the weights live in the target service.
    target = model_info(args.target_model)
    try:
        tokenizer = load_tokenizer(args.target_model)
    except (OSError, ValueError) as error:
        log.warning("no tokenizer for %s (%s): only prompt_token_ids will be accepted",
                    args.target_model, error)
        tokenizer = None
    if args.draft_endpoint.lower() not in ("", "none"):
        check_pair(args.target_model, args.draft_model, tokenizer, target.vocab_size)
    # Client interceptor: Propose/Verify carry the trace context to the services.
    security = SecuritySettings.from_args(args)
    channels = ChannelPool(wrap=telemetry.intercept_channel if telemetry else None,
                           credentials=channel_credentials(security),
                           options=channel_options(security))
    endpoints = replica_endpoints(args, channels)
    servicer = CoordinatorServicer(
        target, endpoints, settings=settings_from_args(args), tokenizer=tokenizer,
        channels=channels, telemetry=telemetry)
    if telemetry is not None:  # tracing outermost: its span covers the other interceptors
        interceptors = [*telemetry.server_interceptors(), *interceptors]
    secure = server_options(args, role="coordinator")
    handle = build_coordinator_server(
        servicer, host=args.host, port=args.port, max_workers=args.max_workers,
        **{**secure, "interceptors": [*interceptors, *secure["interceptors"]]})
    handle.on_stop.append(endpoints.close)  # stop discovery before closing its channels
    handle.on_stop.append(channels.close)
    if telemetry is not None:
        handle.on_stop.append(telemetry.shutdown)  # flush the last spans
    return handle, endpoints


def build_coordinator_server(servicer: CoordinatorServicer, *, host: str = "127.0.0.1",
                             port: int = 0, max_workers: int = 0,
                             interceptors: Sequence[grpc.ServerInterceptor] = (),
                             **server_options: Any) -> ServerHandle:
    """The coordinator's gRPC server, its thread pool sized for its admission limits.

    A synchronous server: the Drafter/Verifier clients and the loop are blocking code,
    and a thread per stream is cheap next to the model work behind it (an asyncio server
    would still run each generation in a thread). So the pool holds a thread for every
    running and queued request plus spares (Admission.threads_needed), and admission
    control, not the pool, bounds the load: over capacity a request gets
    RESOURCE_EXHAUSTED naming the limit. maximum_concurrent_rpcs is the backstop that
    keeps gRPC from queueing calls, unbounded, for a thread.
    """
    workers = max(max_workers, servicer.admission.threads_needed())
    return build_server([servicer.service()], host=host, port=port, max_workers=workers,
                        interceptors=interceptors, maximum_concurrent_rpcs=workers,
                        **server_options)
