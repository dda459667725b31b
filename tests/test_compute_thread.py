"""specdec.serving.compute: a served model's forwards run on the main thread (real gRPC server,
real tiny model), and a stop lets the calls in flight finish there; where the main
thread cannot serve (a Ray actor), on the compute thread that loaded the model."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future

import grpc
import pytest
import torch
from service_harness import DelayInterceptor
from tiny_models import tiny_llama

from coordinator.clients import GrpcDrafter
from draft_service.servicer import DraftServicer
from specdec.core.history import TokenHistory
from specdec.core.sampling import SamplingParams
from specdec.engine.runner import ModelRunner
from specdec.serving.compute import MainThreadExecutor, on_own_compute_thread
from specdec.serving.grpc_server import ServerHandle, build_server, serve_until_signal


def on_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def on_helper_thread(fn: Callable[[], object]) -> BaseException | None:
    """Run fn on another thread and wait; what it raised, if anything."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised.append(error)

    helper = threading.Thread(target=run)
    helper.start()
    helper.join()
    return raised[0] if raised else None


def submit_from_helper(work: MainThreadExecutor, jobs: list) -> list[Future]:
    futures: list[Future] = []
    assert on_helper_thread(lambda: futures.extend(work.submit(job) for job in jobs)) is None
    return futures


def test_work_from_other_threads_runs_on_the_main_thread_in_order() -> None:
    work = MainThreadExecutor()
    ran: list[tuple[int, bool]] = []

    def job(index: int) -> int:
        ran.append((index, on_main()))
        return index * 10

    futures = submit_from_helper(work, [lambda i=i: job(i) for i in range(5)])
    assert ran == []  # nothing runs until the main thread serves the queue
    work.run_until(lambda: all(future.done() for future in futures), poll_s=0.01)
    assert ran == [(i, True) for i in range(5)]
    assert [future.result() for future in futures] == [0, 10, 20, 30, 40]


def test_an_error_reaches_its_caller_and_the_queue_goes_on() -> None:
    work = MainThreadExecutor()

    def fail() -> None:
        raise ValueError("bad request")

    failing, after = submit_from_helper(work, [fail, lambda: "next"])
    work.run_until(lambda: after.done(), poll_s=0.01)
    with pytest.raises(ValueError, match="bad request"):
        failing.result()
    assert after.result() == "next"


def test_work_submitted_on_the_main_thread_runs_at_once() -> None:
    # Queued, it would wait for the thread that is waiting for it.
    assert MainThreadExecutor().submit(on_main).result(timeout=0) is True


def test_shutdown_refuses_new_work_and_cancels_what_is_queued() -> None:
    work = MainThreadExecutor()
    queued = submit_from_helper(work, [lambda: 1, lambda: 2])
    work.shutdown(wait=False, cancel_futures=True)
    assert all(future.cancelled() for future in queued)
    with pytest.raises(CancelledError):
        queued[0].result()
    refused = on_helper_thread(lambda: work.submit(lambda: 3))
    assert isinstance(refused, RuntimeError) and "stopping" in str(refused)


def test_only_the_main_thread_serves_the_queue() -> None:
    refused = on_helper_thread(lambda: MainThreadExecutor().run_until(lambda: True))
    assert isinstance(refused, RuntimeError) and "main thread" in str(refused)


def test_served_forwards_run_on_the_main_thread_and_a_stop_lets_calls_in_flight_finish(
        ) -> None:
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=16, seed=1)
    forward_threads: set[str] = set()
    model.register_forward_hook(
        lambda *_: forward_threads.add(threading.current_thread().name))
    work = MainThreadExecutor()
    servicer = DraftServicer(ModelRunner(model, target_vocab_size=16), executor=work)
    # Each Propose waits 0.5 s before it reaches the servicer: the stop below arrives
    # while the second one is in flight.
    handle = build_server([servicer.service()],
                          interceptors=[DelayInterceptor("Propose", 0.5)])
    handle.on_stop.append(servicer.sessions.close)
    proposals: list[list[int]] = []
    errors: list[BaseException] = []
    # What SIGINT does now (default, or ignored where CI runs in the background).
    before = signal.getsignal(signal.SIGINT)

    def client() -> None:
        try:
            channel = grpc.insecure_channel(handle.address)
            drafter = GrpcDrafter(channel, handle.address, vocab_size=16, timeout_s=30)
            committed = TokenHistory([1, 2, 3, 4])
            proposals.append(drafter.propose("s", committed, 3, SamplingParams()).tokens)
            while signal.getsignal(signal.SIGINT) is before:
                time.sleep(0.01)  # serve_until_signal has not installed its handler yet
            stopper = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            stopper.start()
            committed.extend(proposals[0])
            proposals.append(drafter.propose("s", committed, 3, SamplingParams()).tokens)
            stopper.join()
            channel.close()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    caller = threading.Thread(target=client)
    caller.start()
    serve_until_signal(handle, grace_s=10, work=work)
    caller.join(timeout=30)
    assert not errors, errors
    assert [len(tokens) for tokens in proposals] == [3, 3]
    assert forward_threads == {threading.main_thread().name}
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_server_built_on_its_own_compute_thread_runs_its_forwards_there() -> None:
    loaded_on: list[str] = []
    forward_threads: set[str] = set()

    def create(compute: Executor) -> ServerHandle:
        loaded_on.append(threading.current_thread().name)
        model = tiny_llama(vocab_size=16, seed=1)
        model.register_forward_hook(
            lambda *_: forward_threads.add(threading.current_thread().name))
        servicer = DraftServicer(ModelRunner(model, target_vocab_size=16), executor=compute)
        handle = build_server([servicer.service()])
        handle.on_stop.append(servicer.sessions.close)
        return handle

    handle = on_own_compute_thread(create)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            drafter = GrpcDrafter(channel, handle.address, vocab_size=16, timeout_s=30)
            committed = TokenHistory([1, 2, 3, 4])
            for _ in range(2):
                committed.extend(drafter.propose("s", committed, 3, SamplingParams()).tokens)
    finally:
        handle.stop(0)
    assert loaded_on != [threading.current_thread().name]
    assert forward_threads == set(loaded_on)


def test_a_failed_build_on_its_own_compute_thread_reaches_the_caller() -> None:
    def create(compute: Executor) -> None:
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        on_own_compute_thread(create)


def test_a_service_freezes_what_it_loaded_out_of_the_collectors_sight() -> None:
    """`specdec serve` and Ray replicas call freeze_loaded_objects once loaded: the objects
    alive then are frozen, so a full collection no longer walks them (run in a child:
    freezing is process-wide)."""
    import subprocess
    import sys

    child = (
        "import gc\n"
        "from specdec.serving.grpc_server import freeze_loaded_objects\n"
        "loaded = [[i] for i in range(100_000)]  # lists: the collector tracks them\n"
        "before = gc.get_freeze_count()\n"
        "freeze_loaded_objects()\n"
        "print(gc.get_freeze_count() - before)\n")
    frozen = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                            check=True, timeout=120).stdout
    assert int(frozen) >= 100_000
