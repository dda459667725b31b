"""Build the target server from `specdec serve target` flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from concurrent.futures import Executor

import grpc

from specdec.config import apply_torch_settings
from specdec.grpc_server import ServerHandle
from specdec.model_service import BatchLimits, load_runner, start_model_server
from specdec.telemetry.service import Telemetry
from target_service.servicer import TargetServicer


def create(args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
           telemetry: Telemetry | None = None, executor: Executor | None = None) -> ServerHandle:
    """executor: where forwards run (`specdec serve`: the main thread, specdec.compute)."""
    device, dtype = apply_torch_settings(args)
    runner = load_runner(args.target_model, device=device, dtype=dtype,
                         kv_budget_mb=args.kv_budget_mb, linear_kernel=args.linear_kernel,
                         attention_kernel=args.attention_kernel)
    servicer = TargetServicer(runner, session_ttl_s=args.session_ttl_s,
                              max_draft_tokens=args.max_draft_tokens, telemetry=telemetry,
                              executor=executor, limits=BatchLimits.from_args(args))
    return start_model_server(servicer, args, interceptors, telemetry)
