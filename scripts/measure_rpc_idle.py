"""Latency of a trivial gRPC call after idle gaps: thread-pool vs asyncio server,
unary call vs a message on an open bidirectional stream (docs/benchmarks.md 4i).

    .venv/bin/python scripts/measure_rpc_idle.py sync|aio

The server runs in a child process on loopback with raw-bytes handlers (no protobuf), so
what is timed is gRPC Python's own hand-offs. A speculative round leaves each service idle
for 5-60 ms between its calls, which is why the gaps matter. Prints medians of 60 calls.
"""

from __future__ import annotations

import asyncio
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc

PAYLOAD = b"x" * 200
GAPS_S = (0.0, 0.005, 0.02, 0.04)


def _identity(request: bytes, context: object) -> bytes:
    return request


def _echo(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
    yield from requests


def serve_sync(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "U": grpc.unary_unary_rpc_method_handler(_identity),
        "S": grpc.stream_stream_rpc_method_handler(_echo)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_aio(port: int) -> None:
    async def identity(request: bytes, context: object) -> bytes:
        return request

    async def echo(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
        async for message in requests:
            yield message

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
            "U": grpc.unary_unary_rpc_method_handler(identity),
            "S": grpc.stream_stream_rpc_method_handler(echo)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def measure(port: int, gap_s: float, calls: int = 60) -> tuple[float, float]:
    """Median ms of a unary call and of a stream round trip, each after gap_s idle."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    unary: Any = channel.unary_unary("/t.T/U")
    for _ in range(5):
        unary(PAYLOAD)
    unary_s = []
    for _ in range(calls):
        time.sleep(gap_s)
        started = time.perf_counter()
        unary(PAYLOAD)
        unary_s.append(time.perf_counter() - started)
    outgoing: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (message := outgoing.get()) is not None:
            yield message

    stream: Any = channel.stream_stream("/t.T/S")
    replies = stream(requests())
    for _ in range(5):
        outgoing.put(PAYLOAD)
        next(replies)
    stream_s = []
    for _ in range(calls):
        time.sleep(gap_s)
        started = time.perf_counter()
        outgoing.put(PAYLOAD)
        next(replies)
        stream_s.append(time.perf_counter() - started)
    outgoing.put(None)
    channel.close()
    return statistics.median(unary_s) * 1e3, statistics.median(stream_s) * 1e3


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        (serve_sync if sys.argv[2] == "sync" else serve_aio)(int(sys.argv[3]))
        return
    kind = sys.argv[1] if len(sys.argv) > 1 else "sync"
    if kind not in ("sync", "aio"):
        sys.exit("usage: measure_rpc_idle.py sync|aio")
    port = 50990
    server = subprocess.Popen([sys.executable, __file__, "serve", kind, str(port)],
                              env=os.environ.copy())
    try:
        time.sleep(1.5)
        for gap_s in GAPS_S:
            unary_ms, stream_ms = measure(port, gap_s)
            print(f"{kind} server, idle {gap_s * 1e3:4.0f} ms: unary {unary_ms:.3f} ms, "
                  f"stream message {stream_ms:.3f} ms", flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
