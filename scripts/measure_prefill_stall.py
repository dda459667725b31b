"""What a long prompt does to the other sessions' inter-token latency at a batching target.

A target service (the default target, bfloat16) on loopback; `--sessions` clients decode
target-only through Verify (one committed token per call, so a call's latency is that
session's inter-token latency); after `--warm-s` one more client sends a `--prompt-tokens`
prompt. Prints the decoders' inter-token latency p50 / p99 / max before the long prompt
arrived and while it was being served, and the prompt's own Verify time.

    PYTHONPATH=. python scripts/measure_prefill_stall.py --sessions 4 --prompt-tokens 2000
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import grpc
import torch

from specdec.core.history import TokenHistory
from specdec.engine.models import DEFAULT_TARGET
from specdec.proto.specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.grpc_server import build_server
from specdec.serving.model_service import BatchLimits, load_runner
from target_service.servicer import TargetServicer


def verify(stub: target_pb2_grpc.TargetStub, session: str, history: TokenHistory,
           position: int, append: list[int]) -> target_pb2.VerifyResponse:
    return stub.Verify(target_pb2.VerifyRequest(sync=common_pb2.SyncPoint(
        session_id=session, committed_position=position,
        fingerprint=history.fingerprint(position), append_tokens=append)), timeout=600)


def decoder(stub: target_pb2_grpc.TargetStub, session: str, stop: threading.Event,
            samples: list[tuple[float, float]]) -> None:
    """(end time, latency) of every call after the first."""
    history = TokenHistory([1 + (7 * i + len(session)) % 500 for i in range(16)])
    response = verify(stub, session, history, 0, list(history.tokens))
    while not stop.is_set():
        position = len(history)
        history.extend([response.next_token])
        started = time.perf_counter()
        response = verify(stub, session, history, position, [response.next_token])
        samples.append((time.perf_counter(), time.perf_counter() - started))
        if len(history) > 1500:  # stay within the context
            break


def summary(latencies: list[float]) -> str:
    if not latencies:
        return "no samples"
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (f"n={len(ordered)} p50={statistics.median(ordered) * 1000:.1f} ms "
            f"p99={p99 * 1000:.1f} ms max={ordered[-1] * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--warm-s", type=float, default=8.0)
    parser.add_argument("--after-s", type=float, default=4.0)
    parser.add_argument("--max-batch-prefills", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    runner = load_runner(DEFAULT_TARGET, device=torch.device("cpu"),
                         dtype=getattr(torch, args.dtype))
    servicer = TargetServicer(runner, limits=BatchLimits(
        max_prefills=args.max_batch_prefills))
    server = build_server([servicer.service()])
    channel = grpc.insecure_channel(server.address)
    stub = target_pb2_grpc.TargetStub(channel)
    stop = threading.Event()
    samples: list[tuple[float, float]] = []
    threads = [threading.Thread(target=decoder, args=(stub, f"decoder-{i}", stop, samples))
               for i in range(args.sessions)]
    for thread in threads:
        thread.start()
    time.sleep(args.warm_s)
    prompt = TokenHistory([1 + (13 * i) % 4000 for i in range(args.prompt_tokens)])
    sent = time.perf_counter()
    verify(stub, "long-prompt", prompt, 0, list(prompt.tokens))
    answered = time.perf_counter()
    time.sleep(args.after_s)
    stop.set()
    for thread in threads:
        thread.join()
    before = [latency for end, latency in samples if end < sent]
    during = [latency for end, latency in samples if end - latency < answered and end > sent]
    after = [latency for end, latency in samples if end - latency >= answered]
    print(f"{args.sessions} decoding sessions, {args.dtype}, a {args.prompt_tokens}-token "
          f"prompt; its Verify took {answered - sent:.2f} s")
    print(f"inter-token latency before it:     {summary(before)}")
    print(f"calls overlapping it:              {summary(during)}")
    print(f"after it:                          {summary(after)}")
    channel.close()
    server.stop(0)
    servicer.sessions.close()


if __name__ == "__main__":
    main()
