"""One streamed load through the coordinator's gRPC API and through the HTTP API.

The same prompts (one user turn each, chat template applied by the coordinator), greedy,
the same max tokens, at each concurrency: clients are threads in this process, each
sending its next request as soon as the previous one ends (a closed loop, as AIPerf's
--concurrency runs). Per request: TTFT (until the first non-empty text), ITL ((latency -
TTFT) / (output tokens - 1)), output tokens (the server's count); per run: output tokens
per second over the run's wall time. The HTTP client is the standard library's, reading
Server-Sent Events line by line, so both APIs pay a similar client cost.

    python scripts/measure_http_load.py --grpc-endpoint 127.0.0.1:50051 \
        --http-url http://127.0.0.1:8000 --concurrency 1,8 --requests 8 --max-tokens 64

Also writes the prompts as an AIPerf single-turn dataset (--aiperf-dataset), so a
standard tool can replay the same load.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from specdec.proto.specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

PROMPTS = Path(__file__).resolve().parents[1] / "specdec" / "bench" / "prompts.jsonl"


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    tokens: int

    @property
    def itl_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def grpc_request(stub: Any, prompt: str, max_tokens: int) -> Sample:
    start = time.perf_counter()
    first = None
    tokens = 0
    request = coordinator_pb2.GenerateRequest(
        messages=[coordinator_pb2.ChatMessage(role="user", content=prompt)],
        max_new_tokens=max_tokens)
    for message in stub.GenerateStream(request, timeout=600):
        if first is None and message.text:
            first = time.perf_counter()
        if message.finish_reason:
            tokens = message.stats.completion_tokens
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens)


def http_request(url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                            timeout=600)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body,
                       {"content-type": "application/json"})
    reply = connection.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()!r}")
    first = None
    tokens = 0
    for line in reply:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
            first = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    connection.close()
    return Sample((first or end) - start, end - start, tokens)


def run_load(api: str, args: argparse.Namespace, prompts: list[str],
             concurrency: int) -> dict[str, Any]:
    channel = grpc.insecure_channel(args.grpc_endpoint)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    samples: list[Sample] = []
    errors: list[str] = []  # failed requests count as no tokens, like AIPerf's errors
    next_index = [0]
    guard = threading.Lock()

    def client() -> None:
        while True:
            with guard:
                index = next_index[0]
                if index >= args.requests:
                    return
                next_index[0] += 1
            prompt = prompts[index % len(prompts)]
            try:
                sample = (grpc_request(stub, prompt, args.max_tokens) if api == "grpc"
                          else http_request(args.http_url, args.model, prompt,
                                            args.max_tokens))
            except (grpc.RpcError, RuntimeError, OSError) as error:
                with guard:
                    errors.append(f"{type(error).__name__}: {error}")
                continue
            with guard:
                samples.append(sample)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    channel.close()
    if not samples:
        return {"api": api, "concurrency": concurrency, "requests": 0,
                "errors": len(errors), "first_error": errors[0] if errors else None}
    itls = [s.itl_s for s in samples if s.itl_s is not None]
    tokens = sum(s.tokens for s in samples)
    return {"api": api, "concurrency": concurrency, "requests": len(samples),
            "errors": len(errors), "first_error": errors[0] if errors else None,
            "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_ms_mean": 1000 * statistics.fmean(s.ttft_s for s in samples),
            "itl_ms_mean": 1000 * statistics.fmean(itls) if itls else None,
            "latency_s_mean": statistics.fmean(s.latency_s for s in samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc-endpoint", default="127.0.0.1:50051")
    parser.add_argument("--http-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=8, help="per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16,
                        help="the first N prompts of specdec/bench/prompts.jsonl")
    parser.add_argument("--order", default="grpc,http,http,grpc",
                        help="runs per concurrency, back to back (ABBA evens out drift)")
    parser.add_argument("--aiperf-dataset", default="",
                        help="also write the prompts as an AIPerf single_turn JSONL file")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()
               if line.strip()][: args.prompts]
    if args.aiperf_dataset:
        Path(args.aiperf_dataset).write_text(
            "".join(json.dumps({"text": p}) + "\n" for p in prompts))
    results = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for api in args.order.split(","):
            result = run_load(api, args, prompts, concurrency)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
