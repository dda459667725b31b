"""Build the target server from `specdec serve target` flags."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from concurrent.futures import Executor

import grpc

from specdec.engine.backends import select_backend
from specdec.serving.grpc_server import ServerHandle
from specdec.serving.model_service import BatchLimits, serving_runner, start_model_server
from specdec.telemetry.service import Telemetry
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)


def create(args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
           telemetry: Telemetry | None = None, executor: Executor | None = None) -> ServerHandle:
    """executor: where forwards run (`specdec serve`: the main thread, specdec.serving.compute)."""
    backend = select_backend(args)
    backend.configure_process()
    loaded = backend.load(args.target_model)
    log.info("loaded %s: %s (%s)", args.target_model, loaded.precision, backend.name)
    if loaded.row_invariance_caveat:  # the target's rounding is what greedy equality rests on
        log.warning("%s", loaded.row_invariance_caveat)
    runner = serving_runner(loaded, kv_budget_mb=args.kv_budget_mb)
    servicer = TargetServicer(runner, session_ttl_s=args.session_ttl_s,
                              max_draft_tokens=args.max_draft_tokens, telemetry=telemetry,
                              executor=executor, limits=BatchLimits.from_args(args))
    return start_model_server(servicer, args, interceptors, telemetry)
