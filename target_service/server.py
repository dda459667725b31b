"""Build the target server from `specdec serve target` flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import grpc

from specdec.config import apply_torch_settings
from specdec.grpc_server import ServerHandle, build_server
from specdec.model_service import load_runner
from specdec.telemetry.service import Telemetry
from target_service.servicer import TargetServicer


def create(args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
           telemetry: Telemetry | None = None) -> ServerHandle:
    device, dtype = apply_torch_settings(args)
    runner = load_runner(args.target_model, device=device, dtype=dtype,
                         kv_budget_mb=args.kv_budget_mb)
    servicer = TargetServicer(runner, session_ttl_s=args.session_ttl_s,
                              max_draft_tokens=args.max_draft_tokens, telemetry=telemetry)
    if telemetry is not None:  # tracing outermost: its span covers the other interceptors
        interceptors = [*telemetry.server_interceptors(), *interceptors]
    handle = build_server([servicer.service()], host=args.host, port=args.port,
                          max_workers=args.max_workers, interceptors=interceptors)
    servicer.sessions.start_reaper()
    handle.on_stop.append(servicer.sessions.close)
    if telemetry is not None:
        handle.on_stop.append(telemetry.shutdown)  # flush the last spans
    return handle
