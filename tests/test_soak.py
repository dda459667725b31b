"""`specdec soak` for half a minute with tiny models (CI): 2 draft + 2 target replicas, one
killed with SIGKILL and restarted every 8 s, cancellations and expiring deadlines; no
greedy output may differ from its serial reference and nothing may stay held. The same
for 15 s under `specdec ray` on a two-node Ray cluster (`soak --ray`) that loses a node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_pair


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


def run_soak(pair: tuple[Path, Path], tmp_path: Path, *flags: str
             ) -> tuple[dict, subprocess.CompletedProcess[str]]:
    """`specdec soak` with 4 clients on the tiny pair; its report, checked for what every
    soak must hold: no greedy output differing from its reference, every request ended
    with an expected status, nothing held after the TTL."""
    target, draft = pair
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "soak", "--soak-clients", "4", *flags,
         "--soak-ttl-s", "2", "--soak-max-new-tokens", "16", "--target-model", str(target),
         "--draft-model", str(draft), "--serve-arg=--dtype=float32",
         "--serve-arg=--draft-dtype=float32", "--serve-arg=--draft-linear-kernel=torch",
         "--serve-arg=--torch-threads=1", "--log-dir", str(tmp_path / "logs"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["differing_greedy_outputs"] == 0, report["examples"]
    assert report["ended_without_status"] == 0, report["examples"]
    assert report["unexpected_status"] == {}, report["examples"]
    assert report["completed"] > 0
    assert report["held_after_ttl"]["sessions"] == 0
    assert report["held_after_ttl"]["kv_bytes"] == 0
    return report, result


def test_half_minute_soak_with_replica_kills(tiny_pair: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    report, result = run_soak(tiny_pair, tmp_path, "--soak-duration-s", "30",
                              "--kill-every-s", "8")
    assert len(report["kills"]) >= 3 and report["restarted"]
    assert {k["replica"].split("-")[0] for k in report["kills"]} == {"draft", "target"}
    assert report["requests"].get("cancel", 0) + report["requests"].get("deadline", 0) > 0
    assert report["ok"] is True and result.returncode == 0, result.stderr[-3000:]


def test_a_session_released_mid_call_leaves_no_cache() -> None:
    # What the soak found: a Release (the coordinator giving up on a request) that lands
    # while the session's call still runs; the call then builds the cache again, and
    # with the session gone from the table no TTL would ever reclaim it.
    import threading

    from tiny_models import tiny_llama

    from specdec.engine.runner import ExtendRequest, ExtendResult, ModelRunner
    from specdec.serving.model_service import SessionTable

    runner = ModelRunner(tiny_llama(32))
    table = SessionTable(runner)
    started, proceed = threading.Event(), threading.Event()

    class OneForward:  # a call of one forward that starts a session's cache
        session_id = "s"

        def request(self) -> ExtendRequest:
            return ExtendRequest("s", 0, 0, [1, 2, 3])

        def take(self, result: ExtendResult) -> bool:
            return True

    def work() -> OneForward:
        started.set()
        proceed.wait(10)
        return OneForward()

    call = threading.Thread(target=table.call, args=("s", work, lambda job: None))
    call.start()
    assert started.wait(10)
    table.release("s")
    proceed.set()
    call.join(10)
    try:
        assert runner.active_sessions == 0 and runner.total_kv_bytes() == 0
    finally:
        table.close()


def test_ray_soak_loses_a_node_mid_generation(tiny_pair: tuple[Path, Path],
                                              tmp_path: Path) -> None:
    # `specdec ray` on a two-node Ray cluster on this machine; 4.5 s into the load every
    # process of the second node dies, and with them one draft and one target replica.
    pytest.importorskip("ray")
    report, result = run_soak(tiny_pair, tmp_path, "--ray", "--soak-duration-s", "15",
                              "--remove-node-at", "0.3", "--kill-every-s", "0",
                              "--ray-watch-interval-s", "1")
    removal = report["ray"]["node_removal"]
    assert {name.split("-")[0] for name in removal["replicas_lost"]} == {"draft", "target"}
    assert removal["replaced"] == removal["replicas_lost"], report["ray"]
    assert report["after_recovery"] == {"equal": 8}, report["after_recovery"]
    assert report["ray"]["processes_left"] == 0
    assert report["ok"] is True and result.returncode == 0, report["failed_checks"]
