"""The two model-side steps of a round, shared by the in-process path and the services.

A draft proposal (`DraftJob`) runs on the draft's runner: catch the cache up, then sample
up to k tokens autoregressively and keep q, the exact distribution each was drawn from.
With min_confidence it stops after a token the draft itself gave less than that
probability: such a token is usually rejected, so drafting past it wastes draft and
verify time. The stop depends on the draft's side only, so the rejection sampler stays
exact. A verification (`VerifyJob`) runs on the target's runner: one forward over the
pending committed tokens and the k draft tokens, then the rejection sampler next to p,
so p (k+1 rows of the full vocabulary) never crosses the network.

Both are jobs of forward steps: `run_jobs` runs any number of them together, one
`ModelRunner.extend_batch` per step for every job still running (the services' batching
scheduler does the same while jobs join and leave). A job's draws are keyed by its own
(seed, position, purpose) and its rows' logits do not depend on the other rows of a
forward (the runner's row-invariance contract), so a job computes the same result alone
or batched. `draft_step`, `verify_step` and `verify_batch` are the plain entry points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Protocol, TypeVar

import torch

from specdec.errors import InvalidRequest, SpecdecError
from specdec.history import (
    SyncPoint,  # noqa: F401  (re-exported for the services)
    extend_fingerprint,
)
from specdec.rejection import NO_ALTERNATIVES, Alternatives, Verdict, verify
from specdec.runner import ExtendRequest, ExtendResult, ModelRunner
from specdec.sampling import Purpose, SamplingParams, draw, process_logits
from specdec.settings import default
from specdec.shapes import DECODE_ROWS


@dataclass(frozen=True)
class DraftOutput:
    tokens: list[int]  # target ids
    probs: torch.Tensor | None  # [k, usable draft rows] q in draft space; None when greedy
    kv_length: int
    forward_s: float
    alternatives: Alternatives = NO_ALTERNATIVES


# Alternatives per greedy round by default: each is one more row of the target's forward.
DEFAULT_ALTERNATIVES: int = default("draft-alternatives")


def alternatives_budget(num_draft_tokens: int, append_tokens: int = 2) -> int:
    """Most alternatives one verification takes beside k draft tokens: its rows stay
    within a decode-sized forward (DECODE_ROWS), where the row-invariant kernels cost
    about the same for any row count. append_tokens: the committed tokens a round usually
    re-sends (the last token, or an accepted alternative and the next token)."""
    return max(0, DECODE_ROWS - append_tokens - num_draft_tokens)


@dataclass(frozen=True)
class VerifyOutput:
    verdict: Verdict
    kv_length: int
    forward_s: float
    tokens_processed: int
    # The target's hidden states of the tokens this round committed (the sync's append,
    # the accepted draft tokens and a kept alternative), from sync.committed_position;
    # only when asked (a feature draft reads them).
    hidden: torch.Tensor | None = None


def confidence(logits: torch.Tensor, probs: torch.Tensor, model_id: torch.Tensor,
               greedy: bool) -> float:
    """The draft's probability of its proposal: under its T=1 softmax when greedy (the
    processed distribution is one-hot there), else under the distribution it sampled."""
    if greedy:
        return float(torch.softmax(logits[0].float(), dim=-1).max())
    return float(probs[0, model_id.reshape(-1)[0]])


class Job(Protocol):
    """Work of one call as a series of forwards: `request` names the next forward's rows
    for this job, `take` consumes their result and says whether the job is finished."""

    @property
    def session_id(self) -> str: ...

    def request(self) -> ExtendRequest: ...

    def take(self, result: ExtendResult) -> bool: ...


J = TypeVar("J", bound=Job)


def fold_fingerprint(fingerprint: int, tokens: Sequence[int]) -> int:
    return reduce(extend_fingerprint, (int(token) for token in tokens), fingerprint)


class DraftJob:
    """One proposal: a catch-up forward, then one forward per further draft token.

    target_hidden: for a feature draft, the target's hidden state one position before
    each of sync.append's tokens; its own output state stands in for the tokens it drafts.
    num_alternatives (greedy only): also return up to that many of the draft's next-best
    tokens (within alternatives_budget), those most likely to be kept by the draft's own
    estimate: the product of its probabilities of the chain tokens before one and of the
    token itself (the target keeps an alternative only where it rejects the chain's token,
    and mostly where the draft was unsure of it)."""

    def __init__(self, runner: ModelRunner, sync: SyncPoint, num_tokens: int,
                 params: SamplingParams, min_confidence: float = 0.0,
                 target_hidden: torch.Tensor | None = None,
                 num_alternatives: int = 0) -> None:
        if num_alternatives and not params.greedy:
            raise InvalidRequest("alternatives are drafted under greedy decoding only")
        self.runner = runner
        self.sync = sync
        self.num_tokens = num_tokens
        self.params = params
        self.min_confidence = min_confidence
        self.num_alternatives = num_alternatives
        self._hidden_rows = int(runner.needs_target_hidden)
        self._next = ExtendRequest(sync.session_id, sync.committed_position, sync.fingerprint,
                                   list(sync.append), num_logits=1,
                                   hidden_rows=self._hidden_rows, target_hidden=target_hidden)
        # The fingerprint of what the session holds once the pending forward has run.
        self._fingerprint = fold_fingerprint(sync.fingerprint, sync.append)
        self.tokens: list[int] = []
        self._rows: list[torch.Tensor] = []
        self._candidates: list[tuple[float, int, int]] = []  # (estimated chance, depth, token)
        self._reach = 1.0  # the draft's estimate that the target keeps the chain up to here
        self.forward_s = 0.0
        self.kv_length = 0

    @property
    def session_id(self) -> str:
        return self.sync.session_id

    def request(self) -> ExtendRequest:
        return self._next

    def take(self, result: ExtendResult) -> bool:
        self.forward_s += result.forward_s
        self.kv_length = result.kv_length
        if self.num_tokens == 0:  # a catch-up only
            return True
        logits, params, runner = result.logits, self.params, self.runner
        index = len(self.tokens)
        probs = process_logits(logits, params)
        model_id = draw(probs, params, self.sync.next_position + index, Purpose.DRAFT)
        token = int(runner.vocab.model_to_target_ids(model_id)[0])
        self.tokens.append(token)
        self._rows.append(probs[0])
        own_q = None  # the draft's T=1 probability of its proposal, once computed
        if self.num_alternatives:
            draft_q = torch.softmax(logits[0].float(), dim=-1)
            top_q, top_ids = draft_q.topk(min(self.num_alternatives + 1, draft_q.shape[0]))
            for prob, target_id in zip(top_q.tolist(),
                                       runner.vocab.model_to_target_ids(top_ids).tolist(),
                                       strict=True):
                if target_id != token:
                    self._candidates.append((self._reach * prob, index + 1, target_id))
            own_q = float(draft_q[model_id.reshape(-1)[0]])
            self._reach *= own_q
        if index + 1 >= self.num_tokens:  # the last proposal is never fed: verification decides
            return True
        if self.min_confidence > 0:
            # Alternatives are greedy only, where own_q is the gate's confidence too.
            gate = own_q if own_q is not None else confidence(logits, probs, model_id,
                                                              params.greedy)
            if gate < self.min_confidence:
                return True
        self._next = ExtendRequest(self.session_id, result.kv_length, self._fingerprint,
                                   [token], num_logits=1, hidden_rows=self._hidden_rows,
                                   target_hidden=result.hidden)
        self._fingerprint = extend_fingerprint(self._fingerprint, token)
        return False

    def output(self) -> DraftOutput:
        probs_out = None if self.params.greedy else torch.stack(self._rows)
        count = min(self.num_alternatives, alternatives_budget(len(self.tokens)))
        return DraftOutput(self.tokens, probs_out, self.kv_length, self.forward_s,
                           best_alternatives(self._candidates, count))


class VerifyJob:
    """One verification: draft_probs is the dense [k, target vocab] q (ignored when
    greedy); alternatives (greedy only) are verified as branches of the same forward and
    leave the target's cache."""

    def __init__(self, sync: SyncPoint, draft_tokens: list[int],
                 draft_probs: torch.Tensor | None, params: SamplingParams,
                 return_hidden: bool = False,
                 alternatives: Alternatives = NO_ALTERNATIVES) -> None:
        if alternatives and not params.greedy:
            raise InvalidRequest("alternatives are verified under greedy decoding only")
        if any(not 1 <= depth <= len(draft_tokens) for depth in alternatives.depths):
            raise InvalidRequest(f"alternative depths {list(alternatives.depths)} must lie in "
                                 f"[1, {len(draft_tokens)}] (the draft tokens they replace)")
        self.sync = sync
        self.draft_tokens = draft_tokens
        self.draft_probs = draft_probs
        self.params = params
        self.alternatives = alternatives
        self._chain_length = len(sync.append) + len(draft_tokens)
        block = sync.append + draft_tokens + list(alternatives.tokens)
        self._request = ExtendRequest(
            sync.session_id, sync.committed_position, sync.fingerprint, block,
            num_logits=len(draft_tokens) + 1 + len(alternatives),
            hidden_rows=len(block) if return_hidden else 0,
            branch_positions=tuple(sync.next_position + depth - 1
                                   for depth in alternatives.depths),
            prefill_length=sync.prefill_length)
        self._output: VerifyOutput | None = None

    @property
    def session_id(self) -> str:
        return self.sync.session_id

    def request(self) -> ExtendRequest:
        return self._request

    def take(self, result: ExtendResult) -> bool:
        params, sync = self.params, self.sync
        # Greedy needs only argmax, which the raw logits give without a softmax.
        target_probs = result.logits if params.greedy else process_logits(result.logits, params)
        tokens = torch.tensor(self.draft_tokens, dtype=torch.long, device=target_probs.device)
        draft_probs = self.draft_probs
        if draft_probs is not None:
            draft_probs = draft_probs.to(target_probs.device)
        verdict = verify(tokens, draft_probs, target_probs, params, sync.next_position,
                         self.alternatives)
        hidden = None
        if result.hidden is not None:
            hidden = result.hidden[: len(sync.append) + verdict.accepted_len]
            if verdict.alternative >= 0:  # the kept alternative's state follows the chain's
                row = self._chain_length + verdict.alternative
                hidden = torch.cat([hidden, result.hidden[row:row + 1]])
        self._output = VerifyOutput(verdict, result.kv_length, result.forward_s,
                                    result.tokens_processed, hidden)
        return True

    def output(self) -> VerifyOutput:
        assert self._output is not None, "output() before the job's forward ran"
        return self._output


def step_jobs(runner: ModelRunner, jobs: Sequence[J]) -> list[Exception | None | bool]:
    """One forward for every job: per job True (finished), False (wants another step) or
    the error that ends it (a bad cache sync fails its own job only)."""
    results = runner.extend_batch([job.request() for job in jobs])
    outcomes: list[Exception | None | bool] = []
    for job, result in zip(jobs, results, strict=True):
        if isinstance(result, SpecdecError):
            outcomes.append(result)
            continue
        try:
            outcomes.append(job.take(result))
        except Exception as error:  # noqa: BLE001 - one job's failure is its caller's
            outcomes.append(error)
    return outcomes


def run_jobs(runner: ModelRunner, jobs: Sequence[J]) -> list[Exception | None]:
    """Run the jobs to their end together, one forward per step for those still running.
    Per job: None when it finished, or the error that ended it."""
    errors: list[Exception | None] = [None] * len(jobs)
    running = list(range(len(jobs)))
    while running:
        outcomes = step_jobs(runner, [jobs[index] for index in running])
        still = []
        for index, outcome in zip(running, outcomes, strict=True):
            if isinstance(outcome, Exception):
                errors[index] = outcome
            elif outcome is False:
                still.append(index)
        running = still
    return errors


def draft_batch(runner: ModelRunner, jobs: Sequence[DraftJob]) -> list[DraftOutput | Exception]:
    errors = run_jobs(runner, jobs)
    return [job.output() if error is None else error for job, error in zip(jobs, errors,
                                                                            strict=True)]


def draft_step(runner: ModelRunner, sync: SyncPoint, num_tokens: int,
               params: SamplingParams, min_confidence: float = 0.0,
               target_hidden: torch.Tensor | None = None,
               num_alternatives: int = 0) -> DraftOutput:
    """One proposal alone (see DraftJob)."""
    out = draft_batch(runner, [DraftJob(runner, sync, num_tokens, params, min_confidence,
                                        target_hidden, num_alternatives)])[0]
    if isinstance(out, Exception):
        raise out
    return out


def best_alternatives(candidates: list[tuple[float, int, int]], count: int) -> Alternatives:
    """The count (chance, depth, token) candidates of highest chance, by depth."""
    chosen = sorted(sorted(candidates, key=lambda c: -c[0])[:count], key=lambda c: c[1])
    return Alternatives(tuple(token for _, _, token in chosen),
                        tuple(depth for _, depth, _ in chosen))


def verify_batch(runner: ModelRunner, items: Sequence[VerifyJob]
                 ) -> list[VerifyOutput | Exception]:
    """Every verification in one forward, the rejection sampler per session."""
    errors = run_jobs(runner, items)
    return [job.output() if error is None else error for job, error in zip(items, errors,
                                                                            strict=True)]


def verify_step(runner: ModelRunner, sync: SyncPoint, draft_tokens: list[int],
                draft_probs: torch.Tensor | None, params: SamplingParams,
                return_hidden: bool = False,
                alternatives: Alternatives = NO_ALTERNATIVES) -> VerifyOutput:
    """One verification alone (see VerifyJob)."""
    out = verify_batch(runner, [VerifyJob(sync, draft_tokens, draft_probs, params,
                                          return_hidden, alternatives)])[0]
    if isinstance(out, Exception):
        raise out
    return out
