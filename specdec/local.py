"""In-process Drafter and Verifier: the same steps the services run, without the network."""

from __future__ import annotations

import time

import torch

from specdec.errors import CacheSyncError
from specdec.history import TokenHistory
from specdec.interfaces import CacheMirror, Proposal, Verification
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.steps import draft_step, verify_step


class LocalDrafter:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._mirrors: dict[str, CacheMirror] = {}

    def propose(self, session_id: str, committed: TokenHistory, num_tokens: int,
                params: SamplingParams, min_confidence: float = 0.0) -> Proposal:
        started = time.perf_counter()
        mirror = self._mirrors.setdefault(session_id, CacheMirror())
        resyncs = 0
        try:
            out = draft_step(self.runner, mirror.plan(session_id, committed), num_tokens, params,
                             min_confidence)
        except CacheSyncError:  # evicted under memory pressure: rebuild from the prefix
            resyncs = 1
            out = draft_step(self.runner, mirror.full_resync(session_id, committed),
                             num_tokens, params, min_confidence)
        mirror.record(committed, out.tokens[:-1])
        probs = None if out.probs is None else self.runner.vocab.to_target_probs(out.probs)
        return Proposal(out.tokens, probs, time.perf_counter() - started, out.forward_s, resyncs)

    def release(self, session_id: str) -> None:
        self._mirrors.pop(session_id, None)
        self.runner.release(session_id)


class LocalVerifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._mirrors: dict[str, CacheMirror] = {}

    def verify(self, session_id: str, committed: TokenHistory, draft_tokens: list[int],
               draft_probs: torch.Tensor | None, params: SamplingParams) -> Verification:
        started = time.perf_counter()
        mirror = self._mirrors.setdefault(session_id, CacheMirror())
        resyncs = 0
        try:
            out = verify_step(self.runner, mirror.plan(session_id, committed), draft_tokens,
                              draft_probs, params)
        except CacheSyncError:
            resyncs = 1
            out = verify_step(self.runner, mirror.full_resync(session_id, committed),
                              draft_tokens, draft_probs, params)
        mirror.record(committed, draft_tokens)
        return Verification(out.verdict.accepted_len, out.verdict.next_token,
                            time.perf_counter() - started, out.forward_s, resyncs)

    def release(self, session_id: str) -> None:
        self._mirrors.pop(session_id, None)
        self.runner.release(session_id)
