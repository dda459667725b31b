"""The coordinator says when requests run target-only because the draft does not answer
(a draft still loading, or down), once per change, and when it answers again."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from service_harness import Services
from tiny_models import tiny_llama

from specdec.proto.specdec.v1 import coordinator_pb2


def test_target_only_while_the_draft_is_down_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(1)
    stack = Services(tiny_llama(16, seed=2, layers=1), tiny_llama(16, seed=1))
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=12)
    try:
        stack.stop_draft()
        with caplog.at_level(logging.INFO, logger="coordinator.clients"):
            for _ in range(2):
                assert stack.stub.Generate(request, timeout=30).stats.degraded
            warnings = [r.getMessage() for r in caplog.records if "target-only" in
                        r.getMessage()]
            assert len(warnings) == 1, warnings
            assert stack.draft_endpoint in warnings[0]
            stack.start_draft()
            deadline = time.monotonic() + 30
            while stack.stub.Generate(request, timeout=30).stats.degraded:
                assert time.monotonic() < deadline
        assert any("speculative again" in r.getMessage() for r in caplog.records)
    finally:
        stack.close()
