"""What this machine allows a verification and a service call, beside what specdec takes.

Medians of:

- the int8 operator on one layer (--rows rows of --layer's shape, --codes, one thread): its time
  and multiply-adds per second, and what rows beyond the first cost;
- its compute against this CPU's 16-bit multiply-add peak: a second pass of 4 rows (8 rows
  less 4: the same codes, from cache) against a loop of twelve independent vpmaddwd chains
  (the instruction of the operator's AVX2 path, compiled for this CPU), timed in turn, round
  by round, since this VM's clock moves between rounds;
- a bare unary gRPC call (grpc.health.v1 Check) between two processes on loopback: the
  least a Verify or Propose can pay besides its forward.

Output: markdown on stdout.

    .venv/bin/python scripts/measure_floors.py --rows 1,4,8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <chrono>
#if defined(__AVX2__)
#include <immintrin.h>
double madd_per_ns(int64_t iterations) {
  __m256i acc[12], w[12];
  for (int j = 0; j < 12; ++j) { acc[j] = _mm256_setzero_si256(); w[j] = _mm256_set1_epi16(j + 1); }
  __m256i x = _mm256_set1_epi16(5);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(x, w[j]));
    __asm__ volatile("" : "+x"(x));  // a new x each time: the products stay in the loop
  }
  const double ns = std::chrono::duration<double, std::nano>(
      std::chrono::steady_clock::now() - start).count();
  __m256i sum = acc[0];
  for (int j = 1; j < 12; ++j) sum = _mm256_add_epi32(sum, acc[j]);
  volatile int sink = _mm256_extract_epi32(sum, 0);
  (void)sink;
  return 12.0 * iterations / ns;
}
#else
double madd_per_ns(int64_t) { return 0.0; }
#endif
"""

# Loop iterations per peak sample: 2.4M vpmaddwd, about a millisecond, taken right after the
# 4- and 8-row calls it is compared with.
PEAK_ITERATIONS = 200_000

HEALTH_SERVER = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


def operator_rows(shape: tuple[int, int], rows: list[int], repeats: int, nibbles: bool
                  ) -> tuple[list[tuple[int, float]], list[float]]:
    """Median seconds per row count, and per round the second 4-row pass's multiply-adds a
    ns over the peak loop's, timed back to back (this VM's clock moves between rounds)."""
    import torch
    from torch import nn

    from specdec.engine.int8 import Int8Linear, load_operator

    load_operator()
    peak = peak_loop()
    torch.manual_seed(0)
    layer = Int8Linear(nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16))
    if nibbles:  # 16 levels a group, as a 4-bit GGUF block holds: 4-bit codes
        layer.codes = torch.ops.specdec.int8_nibbles(layer.codes // 8 * 8)
    inputs = {count: torch.randn(count, shape[1]).to(torch.bfloat16) for count in {*rows, 4, 8}}
    times: dict[int, list[float]] = {count: [] for count in inputs}
    ratios = []
    with torch.inference_mode():
        for _ in range(5):
            for x in inputs.values():
                layer(x)
        for _ in range(repeats):
            for count, x in inputs.items():
                started = time.perf_counter()
                layer(x)
                times[count].append(time.perf_counter() - started)
            peak_rate = 16 * peak(PEAK_ITERATIONS)  # multiply-adds a ns
            second_pass_s = times[8][-1] - times[4][-1]
            if peak_rate > 0 and second_pass_s > 0:
                ratios.append(4 * shape[0] * shape[1] / second_pass_s / 1e9 / peak_rate)
    return [(count, statistics.median(times[count])) for count in rows], ratios


def peak_loop() -> Callable[[int], float]:
    from torch.utils.cpp_extension import load_inline

    module = load_inline("specdec_madd_peak", PEAK_SOURCE, functions=["madd_per_ns"],
                         extra_cflags=["-O2", "-march=native"], verbose=False)
    return module.madd_per_ns  # type: ignore[no-any-return]


def grpc_floor_s(calls: int) -> float:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest()
            for _ in range(200):
                stub.Check(request)
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                stub.Check(request)
                times.append(time.perf_counter() - started)
            return statistics.median(times)
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="1536x576", help="outputs x inputs")
    parser.add_argument("--rows", default="1,4,8", help="rows per call, comma-separated")
    parser.add_argument("--codes", choices=("bytes", "nibbles"), default="nibbles",
                        help="the layer's codes: 8-bit, or 4-bit as the embedded target's")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--calls", type=int, default=2000, help="gRPC calls timed")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    outputs, inputs = (int(part) for part in args.layer.split("x"))
    rows = [int(part) for part in args.rows.split(",")]
    timed, ratios = operator_rows((outputs, inputs), rows, args.repeats, args.codes == "nibbles")
    print(f"int8 operator, {outputs} x {inputs}, {args.codes}, one thread, medians of "
          f"{args.repeats}\n")
    print("| rows | us | multiply-adds a ns | us per row beyond the first |")
    print("|---|---|---|---|")
    first = timed[0][1]
    for count, seconds in timed:
        extra = "-" if count == rows[0] else f"{(seconds - first) / (count - rows[0]) * 1e6:.1f}"
        print(f"| {count} | {seconds * 1e6:.1f} | {count * outputs * inputs / seconds / 1e9:.1f} "
              f"| {extra} |")
    if ratios:
        ratios.sort()
        median, low, high = (statistics.median(ratios), ratios[len(ratios) // 4],
                             ratios[3 * len(ratios) // 4])
        print(f"\nA second 4-row pass (8 rows less 4: the same codes, from cache) against this "
              f"core's 16-bit peak (vpmaddwd) timed beside it: median {median:.2f}, quartiles "
              f"{low:.2f}-{high:.2f}")
    else:
        print("\nNo AVX2 here: no 16-bit peak to compare with")
    floor_ms = grpc_floor_s(args.calls) * 1e3
    print(f"\nA bare unary gRPC call between two processes: {floor_ms:.3f} ms "
          f"(median of {args.calls})")


if __name__ == "__main__":
    main()
