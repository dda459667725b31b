"""`specdec generate "prompt"`: a client of the coordinator; streams text, prints stats."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdec.config import add_setting


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text through the coordinator")
    parser.add_argument("prompt", help="prompt text")
    add_setting(parser, "--endpoint", "127.0.0.1:50051", "the coordinator")
    add_setting(parser, "--tls-ca-file", "",
                "PEM CA that signed the coordinator's certificate: call it over TLS "
                "(empty = plaintext)")
    add_setting(parser, "--api-key", "", "API key sent as 'authorization: Bearer <key>'")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--seed", type=int, default=None, help="reproducible sampling")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="tokens drafted per round; 0 = target only (default: server's)")
    parser.add_argument("--adaptive", action="store_true", help="adapt the draft length")
    parser.add_argument("--draft-confidence", type=float, default=None,
                        help="end a round's draft after a token the draft gives less than "
                        "this probability, 0 = off (default: server's, for --adaptive)")
    parser.add_argument("--draft-alternatives", type=int, default=None,
                        help="greedy: also verify this many of the draft's next-best tokens "
                        "each round, 0 = off (default: server's)")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=None,
                        help="most tokens a prompt-lookup round proposes (copied from "
                        "earlier text, no draft forward), 0 = off (default: server's)")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="request deadline")
    parser.set_defaults(func=run)


def build_request(prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  seed: int | None = None, num_draft_tokens: int | None = None,
                  adaptive: bool = False, chat: bool = False,
                  stop: list[str] | None = None, draft_confidence: float | None = None,
                  num_alternatives: int | None = None,
                  prompt_lookup_tokens: int | None = None) -> Any:
    from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2

    request = coordinator_pb2.GenerateRequest(
        prompt=prompt, chat=chat, max_new_tokens=max_new_tokens, stop=stop or [],
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k,
                                           top_p=top_p, min_p=min_p))
    if seed is not None:
        request.sampling.seed = seed
    if num_draft_tokens is not None or adaptive or draft_confidence is not None \
            or num_alternatives is not None or prompt_lookup_tokens is not None:
        request.speculation.num_draft_tokens = 4 if num_draft_tokens is None else num_draft_tokens
        request.speculation.adaptive = adaptive
    if draft_confidence is not None:
        request.speculation.draft_confidence = draft_confidence
    if num_alternatives is not None:
        request.speculation.num_alternatives = num_alternatives
    if prompt_lookup_tokens is not None:
        request.speculation.prompt_lookup_tokens = prompt_lookup_tokens
    return request


def call(endpoint: str, request: Any, *, stream: bool, timeout_s: float,
         echo: Any = None, tls_ca_file: str = "", api_key: str = "") -> Any:
    """Run the request; with stream, pass each text piece to echo(text) as it arrives.
    Returns one GenerateResponse (stream pieces merged)."""
    from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
    from specdec.security import bearer, public_channel

    metadata = bearer(api_key)
    with public_channel(endpoint, ca_file=tls_ca_file) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        if not stream:
            return stub.Generate(request, timeout=timeout_s, metadata=metadata)
        merged = coordinator_pb2.GenerateResponse()
        for piece in stub.GenerateStream(request, timeout=timeout_s, metadata=metadata):
            if echo is not None and piece.text:
                echo(piece.text)
            merged.text += piece.text
            merged.token_ids.extend(piece.token_ids)
            if piece.finish_reason:
                merged.finish_reason = piece.finish_reason
                merged.stats.CopyFrom(piece.stats)
                merged.trace_id = piece.trace_id
        return merged


def stats_table(response: Any, title: str = "generation stats") -> Any:
    from rich.table import Table

    stats = response.stats
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    tokens = stats.completion_tokens or len(response.token_ids)
    rows = [
        ("finish reason", response.finish_reason),
        ("tokens (prompt / new)", f"{stats.prompt_tokens} / {tokens}"),
        ("rounds", str(stats.rounds)),
        ("drafted / accepted", f"{stats.draft_tokens} / {stats.accepted_tokens}"),
        ("acceptance rate", f"{stats.acceptance_rate:.1%}"),
        ("mean accepted length", f"{stats.mean_accepted_length:.2f} tokens/round"),
        ("accepted per position", " ".join(map(str, stats.accepted_per_position)) or "-"),
        ("alternatives verified / kept", f"{stats.alternatives} / {stats.kept_alternatives}"),
        ("prompt lookup rounds / drafted / accepted",
         f"{stats.lookup_drafts} / {stats.lookup_draft_tokens} / "
         f"{stats.lookup_accepted_tokens}"),
        ("total time", f"{stats.total_seconds:.2f} s"),
        ("tokens per second",
         f"{tokens / stats.total_seconds:.1f}" if stats.total_seconds else "-"),
        ("time to first round", f"{stats.first_token_seconds * 1000:.0f} ms"),
        ("draft wait / model",
         f"{stats.draft_seconds:.2f} s / {stats.draft_forward_seconds:.2f} s"),
        ("verify wait / model",
         f"{stats.verify_seconds:.2f} s / {stats.verify_forward_seconds:.2f} s"),
        ("wire bytes per round", f"{stats.wire_bytes / max(1, stats.rounds):,.0f}"),
        ("degraded / resyncs", f"{'yes' if stats.degraded else 'no'} / {stats.resyncs}"),
        # From a response to its trace: `specdec traces <id>` (or the id in Jaeger/Phoenix).
        ("trace id", response.trace_id or "- (tracing off or not sampled)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict
    from rich.console import Console

    request = build_request(
        args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        num_draft_tokens=args.num_draft_tokens, adaptive=args.adaptive, chat=args.chat,
        stop=args.stop, draft_confidence=args.draft_confidence,
        num_alternatives=args.draft_alternatives,
        prompt_lookup_tokens=args.prompt_lookup_tokens)
    console = Console()
    echo = None if args.json else (lambda text: print(text, end="", flush=True))
    try:
        response = call(args.endpoint, request, stream=args.stream, timeout_s=args.timeout_s,
                        echo=echo, tls_ca_file=args.tls_ca_file, api_key=args.api_key)
    except grpc.RpcError as error:
        print(f"specdec generate: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(response, preserving_proto_field_name=True), indent=2))
        return 0
    if not args.stream:
        print(response.text, end="")
    print()
    console.print(stats_table(response))
    return 0
