"""`specdec generate "prompt"`: a client of the coordinator.

Text goes to stdout and the statistics to stderr, so `specdec generate ... > out.txt`
keeps only the text; --json prints the whole response (every field) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specdec.config import add_setting

DEFAULT_ENDPOINT = "127.0.0.1:50051"


def add_connection_settings(parser: argparse.ArgumentParser) -> None:
    """How a client reaches the coordinator (the one place client connection flags live)."""
    add_setting(parser, "--endpoint", DEFAULT_ENDPOINT, "the coordinator, host:port")
    add_setting(parser, "--timeout-s", 600.0, "request deadline in seconds", type=float)
    add_setting(parser, "--tls-ca-file", "",
                "PEM CA that signed the coordinator's certificate: call it over TLS "
                "(empty = plaintext)")
    add_setting(parser, "--api-key", "", "API key sent as 'authorization: Bearer <key>'")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text through the coordinator",
        description="Send one prompt to the coordinator. The text goes to stdout, the "
                    "statistics table to stderr (--quiet: none; --json: the whole response "
                    "as JSON on stdout).")
    parser.add_argument("prompt", help="prompt text")
    add_connection_settings(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="most tokens to generate (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature, 0 = greedy (default: 0)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k, 0 = off (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p, 1 = off (default: 1)")
    parser.add_argument("--min-p", type=float, default=0.0, help="min-p, 0 = off (default: 0)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for reproducible sampling (default: none)")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="draft length: where adaptive speculation starts, or the fixed "
                        "length with --fixed; 0 = target only, no draft (default: the "
                        "server's)")
    parser.add_argument("--fixed", action="store_true",
                        help="draft a fixed --num-draft-tokens per round instead of adapting "
                        "the length (default: adaptive)")
    parser.add_argument("--adaptive", action="store_true",
                        help="adapt the draft length per round (the default; kept for "
                        "scripts that pass it)")
    parser.add_argument("--draft-confidence", type=float, default=None,
                        help="end a round's draft after a token the draft gives less than "
                        "this probability, 0 = off (default: the server's)")
    parser.add_argument("--draft-alternatives", type=int, default=None,
                        help="verify a token tree of up to this many alternatives beside the "
                        "draft's chain each round, 0 = a chain (default: the server's)")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=None,
                        help="most tokens a prompt-lookup round proposes (copied from "
                        "earlier text, no draft forward), 0 = off (default: the server's)")
    parser.add_argument("--chat", action="store_true",
                        help="apply the chat template (default: off)")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop string, repeatable (default: none)")
    parser.add_argument("--stream", action="store_true",
                        help="print text as it is generated (default: off)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true",
                        help="print the whole response as JSON, every field included "
                        "(default: off)")
    output.add_argument("--quiet", "-q", action="store_true",
                        help="print only the text, no statistics (default: off)")
    parser.set_defaults(func=run)


def build_request(prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  seed: int | None = None, num_draft_tokens: int | None = None,
                  adaptive: bool = False, fixed: bool = False, chat: bool = False,
                  stop: list[str] | None = None, draft_confidence: float | None = None,
                  num_alternatives: int | None = None,
                  prompt_lookup_tokens: int | None = None) -> Any:
    """A GenerateRequest carrying only what was asked: what is left out takes the
    server's defaults (adaptive speculation from the server's draft length).

    num_draft_tokens 0 asks for target-only decoding; `fixed` a fixed length of
    num_draft_tokens; `adaptive` is the default and only needs saying with a length.
    """
    from specdec.proto.specdec.v1 import common_pb2, coordinator_pb2

    if fixed and adaptive:
        raise ValueError("--fixed and --adaptive contradict each other; pass one")
    if fixed and not num_draft_tokens:
        raise ValueError("--fixed needs --num-draft-tokens N (N > 0): the fixed length")
    request = coordinator_pb2.GenerateRequest(
        prompt=prompt, chat=chat, max_new_tokens=max_new_tokens, stop=stop or [],
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k,
                                           top_p=top_p, min_p=min_p))
    if seed is not None:
        request.sampling.seed = seed
    if num_draft_tokens is not None:
        request.speculation.num_draft_tokens = num_draft_tokens
        request.speculation.adaptive = num_draft_tokens > 0 and not fixed
    elif draft_confidence is not None or num_alternatives is not None \
            or prompt_lookup_tokens is not None:
        request.speculation.adaptive = True  # the default mode, with a field of its own
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
    from specdec.serving.security import bearer, public_channel

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


def response_json(response: Any) -> str:
    """The response as JSON with every field, default values included (0, false, "")."""
    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(response, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True), indent=2)


def unreachable_hint(error: Any, endpoint: str) -> str:
    """A line telling what to do when nothing answers at the endpoint, else ""."""
    import grpc

    if error.code() == grpc.StatusCode.UNAVAILABLE and (
            "connect" in (error.details() or "").lower()
            or "unavailable" in (error.details() or "").lower()):
        return (f"nothing answers at {endpoint} (UNAVAILABLE): start the stack with "
                "`specdec up`, pass --endpoint / SPECDEC_ENDPOINT, or, for a TLS endpoint, "
                "--tls-ca-file")
    return ""


def run(args: argparse.Namespace) -> int:
    import grpc
    from rich.console import Console

    request = build_request(
        args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        num_draft_tokens=args.num_draft_tokens, adaptive=args.adaptive, fixed=args.fixed,
        chat=args.chat, stop=args.stop, draft_confidence=args.draft_confidence,
        num_alternatives=args.draft_alternatives,
        prompt_lookup_tokens=args.prompt_lookup_tokens)
    echo = None if args.json else (lambda text: print(text, end="", flush=True))
    try:
        response = call(args.endpoint, request, stream=args.stream, timeout_s=args.timeout_s,
                        echo=echo, tls_ca_file=args.tls_ca_file, api_key=args.api_key)
    except grpc.RpcError as error:
        hint = unreachable_hint(error, args.endpoint)
        print(f"specdec generate: {hint or f'{error.code().name}: {error.details()}'}",
              file=sys.stderr)
        return 1
    if args.json:
        print(response_json(response), flush=True)
        return 0
    if not args.stream:
        print(response.text, end="")
    print(flush=True)
    if not args.quiet:
        Console(stderr=True).print(stats_table(response))
    return 0
