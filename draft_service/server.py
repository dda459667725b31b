"""Build the draft server from `specdec serve draft` flags."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from concurrent.futures import Executor

import grpc

from draft_service.servicer import DraftServicer
from specdec.engine.backends import select_backend
from specdec.engine.models import model_info
from specdec.serving.grpc_server import ServerHandle
from specdec.serving.model_service import BatchLimits, serving_runner, start_model_server
from specdec.telemetry.service import Telemetry

log = logging.getLogger(__name__)


def create(args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
           telemetry: Telemetry | None = None, executor: Executor | None = None) -> ServerHandle:
    """executor: where forwards run (`specdec serve`: the main thread, specdec.serving.compute)."""
    backend = select_backend(args)
    backend.configure_process()
    # The draft maps its rows onto the target's vocabulary, so it needs its size.
    vocab = model_info(args.target_model).vocab_size
    choice = backend.load_draft(args.draft_model, target_vocab_size=vocab,
                                target_model=args.target_model)
    log.info("loaded %s: %s; precision %s", args.draft_model, choice.loaded.precision,
             choice.describe())
    runner = serving_runner(choice.loaded, target_vocab_size=vocab,
                            kv_budget_mb=args.kv_budget_mb)
    servicer = DraftServicer(runner, session_ttl_s=args.session_ttl_s,
                             max_draft_tokens=args.max_draft_tokens, telemetry=telemetry,
                             precision=choice.describe(), executor=executor,
                             limits=BatchLimits.from_args(args))
    return start_model_server(servicer, args, interceptors, telemetry)
