"""In-process Drafter and Verifier: the same steps the services run, without the network."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdec.core.history import FINAL_STATE, HiddenSpec, TokenHistory
from specdec.core.interfaces import CacheMirror, Proposal, Verification, draft_hidden_rows
from specdec.core.sampling import SamplingParams
from specdec.core.tree_acceptance import NO_ALTERNATIVES, Alternatives
from specdec.engine.runner import ModelRunner
from specdec.engine.steps import SyncPoint, draft_step, verify_step
from specdec.errors import CacheSyncError


class LocalDrafter:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._mirrors: dict[str, CacheMirror] = {}

    @property
    def needs_target_hidden(self) -> bool:
        return self.runner.needs_target_hidden

    @property
    def target_hidden_spec(self) -> HiddenSpec:
        reader = self.runner.hidden_reader
        return FINAL_STATE if reader is None else reader.spec

    def propose(self, session_id: str, committed: TokenHistory, num_tokens: int,
                params: SamplingParams, min_confidence: float = 0.0,
                num_alternatives: int = 0, max_alternative_depth: int = 0) -> Proposal:
        started = time.perf_counter()
        mirror = self._mirrors.setdefault(session_id, CacheMirror())
        resyncs = 0
        try:
            sync = mirror.plan(session_id, committed)
            out = draft_step(self.runner, sync, num_tokens, params, min_confidence,
                             self._hidden_for(sync, committed), num_alternatives,
                             max_alternative_depth)
        except CacheSyncError:  # evicted under memory pressure: rebuild from the prefix
            resyncs = 1
            sync = mirror.full_resync(session_id, committed)
            out = draft_step(self.runner, sync, num_tokens, params, min_confidence,
                             self._hidden_for(sync, committed), num_alternatives,
                             max_alternative_depth)
        mirror.record_proposal(committed, out.tokens)
        probs = None if out.probs is None else self.runner.vocab.to_target_probs(out.probs)
        return Proposal(out.tokens, probs, time.perf_counter() - started, out.forward_s, resyncs,
                        alternatives=out.alternatives)

    def _hidden_for(self, sync: SyncPoint, committed: TokenHistory) -> torch.Tensor | None:
        return draft_hidden_rows(committed, sync) if self.needs_target_hidden else None

    def release(self, session_id: str) -> None:
        self._mirrors.pop(session_id, None)
        self.runner.release(session_id)


class LocalVerifier:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._mirrors: dict[str, CacheMirror] = {}

    def verify(self, session_id: str, committed: TokenHistory, draft_tokens: list[int],
               draft_probs: torch.Tensor | None, params: SamplingParams,
               alternatives: Alternatives = NO_ALTERNATIVES, decode_steps: int = 1,
               stop_token_ids: Sequence[int] = ()) -> Verification:
        # In process a round trip costs nothing: one token a round (decode_steps is a hint).
        started = time.perf_counter()
        mirror = self._mirrors.setdefault(session_id, CacheMirror())
        resyncs = 0
        log = committed.target_hidden
        return_hidden, layers = log is not None, () if log is None else log.spec.layers
        try:
            sync = mirror.plan(session_id, committed)
            out = verify_step(self.runner, sync, draft_tokens, draft_probs, params,
                              return_hidden, alternatives, layers)
        except CacheSyncError:
            resyncs = 1
            sync = mirror.full_resync(session_id, committed)
            out = verify_step(self.runner, sync, draft_tokens, draft_probs, params,
                              return_hidden, alternatives, layers)
        mirror.record(committed, draft_tokens)
        return Verification(out.verdict.accepted_len, out.verdict.next_token,
                            time.perf_counter() - started, out.forward_s, resyncs,
                            hidden=out.hidden, hidden_position=sync.committed_position,
                            kept_branches=out.verdict.branch_path,
                            branch_tokens=tuple(alternatives.tokens[index]
                                                for index in out.verdict.branch_path))

    def release(self, session_id: str) -> None:
        self._mirrors.pop(session_id, None)
        self.runner.release(session_id)
