"""`specdec soak` for one minute with tiny models (CI): 2 draft + 2 target replicas, one
killed with SIGKILL and restarted every 15 s, cancellations and expiring deadlines; no
greedy output may differ from its serial reference and nothing may stay held."""

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


def test_one_minute_soak_with_replica_kills(tiny_pair: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    target, draft = tiny_pair
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "soak", "--soak-clients", "4",
         "--soak-duration-s", "60", "--kill-every-s", "15", "--soak-ttl-s", "2",
         "--soak-max-new-tokens", "16", "--target-model", str(target),
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
    assert len(report["kills"]) >= 3 and report["restarted"]
    assert {k["replica"].split("-")[0] for k in report["kills"]} == {"draft", "target"}
    assert report["held_after_ttl"]["sessions"] == 0
    assert report["held_after_ttl"]["kv_bytes"] == 0
    assert report["requests"].get("cancel", 0) + report["requests"].get("deadline", 0) > 0
    assert report["ok"] is True and result.returncode == 0, result.stderr[-3000:]
