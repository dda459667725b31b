"""Build the draft server from `specdec serve draft` flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import grpc

from draft_service.servicer import DraftServicer
from specdec.config import apply_torch_settings, draft_precision
from specdec.grpc_server import ServerHandle
from specdec.model_service import load_runner, model_info, start_model_server
from specdec.telemetry.service import Telemetry


def create(args: argparse.Namespace, interceptors: Sequence[grpc.ServerInterceptor] = (),
           telemetry: Telemetry | None = None) -> ServerHandle:
    device, _ = apply_torch_settings(args)
    dtype, linear_kernel = draft_precision(args)
    # The draft maps its rows onto the target's vocabulary, so it needs its size.
    vocab = model_info(args.target_model).vocab_size
    runner = load_runner(args.draft_model, device=device, dtype=dtype,
                         target_vocab_size=vocab, kv_budget_mb=args.kv_budget_mb,
                         linear_kernel=linear_kernel,
                         attention_kernel=args.attention_kernel)
    servicer = DraftServicer(runner, session_ttl_s=args.session_ttl_s,
                             max_draft_tokens=args.max_draft_tokens, telemetry=telemetry)
    return start_model_server(servicer, args, interceptors, telemetry)
