"""The two model-side steps of a round, shared by the in-process path and the services.

A draft proposal (`DraftJob`) runs on the draft's runner: catch the cache up, then sample
up to k tokens autoregressively and keep q, the exact distribution each was drawn from.
With min_confidence it stops after a token the draft itself gave less than that
probability: such a token is usually rejected, so drafting past it wastes draft and
verify time. The stop depends on the draft's side only, so the rejection sampler stays
exact. With alternatives the proposal is a token tree (one draft forward per depth). A
verification (`VerifyJob`) runs on the target's runner: one forward over the pending
committed tokens, the k draft tokens and the tree's other nodes, then the rejection
sampler next to p, so p (a row of the full vocabulary per node) never crosses the
network.

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

from specdec.core.history import (
    SyncPoint,  # noqa: F401  (re-exported for the services)
    extend_fingerprint,
)
from specdec.core.rejection import Verdict
from specdec.core.sampling import Purpose, SamplingParams, draw, process_logits
from specdec.core.tree_acceptance import NO_ALTERNATIVES, Alternatives, draw_siblings, verify
from specdec.engine.runner import ExtendRequest, ExtendResult, ModelRunner
from specdec.engine.shapes import DECODE_ROWS
from specdec.errors import InvalidRequest, SpecdecError


@dataclass(frozen=True)
class DraftOutput:
    tokens: list[int]  # target ids
    probs: torch.Tensor | None  # [k, usable draft rows] q in draft space; None when greedy
    kv_length: int
    forward_s: float
    alternatives: Alternatives = NO_ALTERNATIVES


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
    # With decode_steps: the target's tokens after the verdict's next_token.
    decoded: tuple[int, ...] = ()


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


@dataclass
class _Branch:
    """A token-tree node beside the chain, while the draft builds the tree."""

    token: int  # target id
    model_id: int
    parent: int  # a chain node (-1: the committed prefix), or BRANCH + a branch index
    depth: int
    level: int  # levels below the chain: 1 for a chain node's branch
    score: float  # the draft's probability of the node's path
    q: torch.Tensor | None = None  # the row its children were drawn from, once it has any


BRANCH = 1 << 20  # parent ids at or above this are branches (BRANCH + index)
# A branch is drafted only where the draft's estimate that the target keeps its path
# reaches this: rarer ones cost a row and almost never pay.
MIN_BRANCH_SCORE = 0.02
# Most branches a depth adds, and most branches a depth expands (drafts children for).
BRANCHES_PER_DEPTH = 4
EXPANDED_PER_DEPTH = 2


class DraftJob:
    """One proposal: a catch-up forward, then one forward per further depth.

    The chain (rank 0 at each depth) is drawn as a plain draft does. With
    num_alternatives the proposal is a token tree (EAGLE-2 style, one forward per depth
    for every node expanded there): at each depth the draft gives the nodes it expands up
    to num_alternatives branches in all, where its estimate that the target keeps them (the
    draft's probability of the path) is highest. A node's branches are drawn beside its
    chain child without replacement (specdec.core.tree_acceptance.draw_siblings; greedy: its
    next-best tokens), and how many a node gets is fixed before they are drawn, from the
    node's distribution and its path alone: the contract that keeps sampled trees exact.
    The most promising branches of a depth are expanded at the next one; their ancestors
    ride along in that forward and leave the cache after it. max_alternative_depth caps
    how many levels below the chain branches go (1: every branch follows a chain token;
    0: no cap).

    target_hidden: for a draft that reads states (a feature or EAGLE-3 draft), the
    target's state one position before each of sync.append's tokens; its own output
    state stands in for the tokens it drafts (such a draft proposes chains: its branches
    would need states it does not have).
    """

    def __init__(self, runner: ModelRunner, sync: SyncPoint, num_tokens: int,
                 params: SamplingParams, min_confidence: float = 0.0,
                 target_hidden: torch.Tensor | None = None,
                 num_alternatives: int = 0, max_alternative_depth: int = 0) -> None:
        self.runner = runner
        self.sync = sync
        self.num_tokens = num_tokens
        self.params = params
        self.min_confidence = min_confidence
        self.num_alternatives = 0 if runner.needs_target_hidden else min(
            num_alternatives, alternatives_budget(num_tokens))
        self.max_alternative_depth = max_alternative_depth
        self._hidden_rows = int(runner.needs_target_hidden)
        self._next = ExtendRequest(sync.session_id, sync.committed_position, sync.fingerprint,
                                   list(sync.append), num_logits=1,
                                   hidden_rows=self._hidden_rows, target_hidden=target_hidden)
        # The fingerprint of what the session holds once the pending forward has run.
        self._fingerprint = fold_fingerprint(sync.fingerprint, sync.append)
        self.tokens: list[int] = []
        self._rows: list[torch.Tensor] = []
        self._chain_score = 1.0  # the draft's probability of the chain so far
        self.branches: list[_Branch] = []
        self._fed: list[int] = []  # branches whose logits rows follow the chain's row
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
        logits, params = result.logits, self.params
        depth = len(self.tokens) + 1  # of the tokens drawn now
        position = self.sync.next_position + depth - 1
        chain_row = logits[0]  # the catch-up's last row, or the chain token's
        fed_rows = logits[len(logits) - len(self._fed):] if self._fed else logits[:0]
        nodes: list[tuple[int, torch.Tensor]] = [(depth - 2, chain_row)]
        nodes += [(BRANCH + index, row) for index, row in zip(self._fed, fed_rows, strict=True)]
        rows = torch.stack([row for _, row in nodes])
        probs = process_logits(rows, params)
        scored = torch.softmax(rows.float(), dim=-1) if params.greedy else probs
        counts = self._branch_counts(nodes, scored)
        model_id = draw(probs[:1], params, position, Purpose.DRAFT)
        token = int(self.runner.vocab.model_to_target_ids(model_id)[0])
        chain_q = float(scored[0, int(model_id[0])])
        new: list[int] = []  # branches drawn at this depth
        for slot, (node, _) in enumerate(nodes):
            chain_bearing = node < BRANCH
            drawn = self._siblings(probs[slot], scored[slot], position,
                                   counts[slot] + chain_bearing)
            if chain_bearing:
                drawn = drawn[1:]  # rank 0 is the chain's token, drawn above
            score = self._chain_score if chain_bearing else self.branches[node - BRANCH].score
            if drawn and not chain_bearing:
                self.branches[node - BRANCH].q = probs[slot]
            level = 1 if chain_bearing else self.branches[node - BRANCH].level + 1
            for sibling in drawn:
                new.append(len(self.branches))
                self.branches.append(_Branch(
                    int(self.runner.vocab.model_to_target_ids(torch.tensor([sibling]))[0]),
                    sibling, node, depth, level, score * float(scored[slot, sibling])))
        self.tokens.append(token)
        self._rows.append(probs[0])
        self._chain_score *= chain_q
        if depth >= self.num_tokens:  # the last proposal is never fed: verification decides
            return True
        if self.min_confidence > 0 and chain_q < self.min_confidence:
            return True
        self._next = self._next_request(result, token, new)
        self._fingerprint = extend_fingerprint(self._fingerprint, token)
        return False

    def _branch_counts(self, nodes: list[tuple[int, torch.Tensor]],
                       scored: torch.Tensor) -> list[int]:
        """How many branches each node gets at this depth, before any is drawn: the
        candidates whose expected path probability (the node's path times the draft's
        r-th most likely token) is highest, within the budget."""
        budget = min(BRANCHES_PER_DEPTH, self.num_alternatives - len(self.branches))
        counts = [0] * len(nodes)
        if budget <= 0:
            return counts
        candidates: list[tuple[float, int]] = []
        for slot, (node, _) in enumerate(nodes):
            first = 1 if node < BRANCH else 0  # a chain node's rank 0 is the chain's
            score = self._chain_score if node < BRANCH else self.branches[node - BRANCH].score
            top = scored[slot].topk(min(first + budget, scored.shape[1])).values.tolist()
            candidates += [(score * value, slot) for value in top[first:]]
        for value, slot in sorted(candidates, key=lambda c: -c[0])[:budget]:
            if value >= MIN_BRANCH_SCORE:
                counts[slot] += 1
        return counts

    def _siblings(self, probs: torch.Tensor, scored: torch.Tensor, position: int,
                  count: int) -> list[int]:
        """count children of one node (model ids), rank 0 first."""
        if count <= 0:
            return []
        if self.params.greedy:  # the draft's most likely tokens (its choice is rank 0)
            return [int(i) for i in scored.topk(min(count, scored.shape[0])).indices]
        return draw_siblings(probs, self.params, position, count)

    def _next_request(self, result: ExtendResult, token: int, new: list[int]
                      ) -> ExtendRequest:
        """The chain's new token, then the branches to expand at the next depth (the
        most promising of this depth's) after the ancestors they need in the cache."""
        room = self.num_alternatives - len(self.branches)
        cap = self.max_alternative_depth
        expand = sorted((index for index in new if self.branches[index].score
                         >= MIN_BRANCH_SCORE and not 0 < cap <= self.branches[index].level),
                        key=lambda i: -self.branches[i].score)
        self._fed = sorted(expand[:EXPANDED_PER_DEPTH] if room > 0 else [])
        context: set[int] = set()
        for index in self._fed:
            parent = self.branches[index].parent
            while parent >= BRANCH:
                context.add(parent - BRANCH)
                parent = self.branches[parent - BRANCH].parent
        rows = sorted(context, key=lambda i: (self.branches[i].depth, i)) + self._fed
        chain_slot = result.kv_length  # the new chain token's slot
        slot_of = {index: chain_slot + 1 + row for row, index in enumerate(rows)}
        root_slot = self.sync.next_position - 1
        parents = []
        for index in rows:
            parent = self.branches[index].parent
            parents.append(slot_of[parent - BRANCH] if parent >= BRANCH
                           else root_slot + 1 + parent)
        tokens = [token] + [self.branches[index].token for index in rows]
        return ExtendRequest(self.session_id, result.kv_length, self._fingerprint, tokens,
                             num_logits=len(tokens) if rows else 1,
                             hidden_rows=self._hidden_rows, target_hidden=result.hidden,
                             branch_parents=tuple(parents),
                             own_hidden=result.hidden is not None)

    def output(self) -> DraftOutput:
        k = len(self.tokens)
        expanded = [branch.q for branch in self.branches if branch.q is not None]
        probs_out = None if self.params.greedy else torch.stack(self._rows + expanded)
        alternatives = Alternatives(
            tuple(branch.token for branch in self.branches),
            tuple(branch.parent - BRANCH + k if branch.parent >= BRANCH else branch.parent
                  for branch in self.branches))
        return DraftOutput(self.tokens, probs_out, self.kv_length, self.forward_s,
                           alternatives)


class VerifyJob:
    """One verification: draft_probs is the dense q over the target vocabulary, one row
    per draft token and per alternative with children (ignored when greedy); the
    alternatives (a token tree's other nodes) are verified in the same forward and leave
    the target's cache. hidden_layers: with return_hidden, return the inputs of these
    decoder layers side by side instead of the final norm's output.

    decode_steps: without draft tokens, decode up to this many target tokens, one forward
    each, ending after a token of stop_token_ids. Step i feeds the token step i - 1 drew
    and draws at the next position with the same rule and key, so the tokens are those
    as many one-token rounds would commit, without the round trips between them."""

    def __init__(self, sync: SyncPoint, draft_tokens: list[int],
                 draft_probs: torch.Tensor | None, params: SamplingParams,
                 return_hidden: bool = False,
                 alternatives: Alternatives = NO_ALTERNATIVES,
                 hidden_layers: tuple[int, ...] = (), decode_steps: int = 1,
                 stop_token_ids: tuple[int, ...] = ()) -> None:
        try:
            alternatives.check(len(draft_tokens))
        except ValueError as error:
            raise InvalidRequest(str(error)) from None
        if decode_steps > 1 and (draft_tokens or return_hidden):
            raise InvalidRequest("decode_steps above 1 is for a round without draft tokens "
                                 "or hidden states")
        k = len(draft_tokens)
        if draft_probs is not None and not params.greedy and draft_tokens:
            rows = len(alternatives.q_nodes(k))
            if draft_probs.shape[0] != rows:
                raise InvalidRequest(
                    f"draft probabilities have {draft_probs.shape[0]} rows; {rows} expected "
                    f"(one per node of the token tree with children)")
        self.sync = sync
        self.draft_tokens = draft_tokens
        self.draft_probs = draft_probs
        self.params = params
        self.alternatives = alternatives
        self._chain_length = len(sync.append) + k
        block = sync.append + draft_tokens + list(alternatives.tokens)
        # Node n of the tree sits in slot base + n (the committed prefix's last token at
        # base - 1); alternative i's node id is k + i.
        base = sync.next_position
        self._request = ExtendRequest(
            sync.session_id, sync.committed_position, sync.fingerprint, block,
            num_logits=k + 1 + len(alternatives),
            hidden_rows=len(block) if return_hidden else 0,
            branch_parents=tuple(base + parent for parent in alternatives.parents),
            prefill_length=sync.prefill_length, hidden_layers=hidden_layers)
        self._output: VerifyOutput | None = None
        self._decode_steps = max(1, decode_steps)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._position = sync.next_position  # where the next token is drawn
        self._drawn: list[int] = []  # tokens drawn by the steps so far
        self._forward_s = 0.0
        self._tokens_processed = 0

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
        try:
            verdict = verify(tokens, draft_probs, target_probs, params, self._position,
                             self.alternatives)
        except ValueError as error:  # a tree the rule cannot walk: the caller's input
            raise InvalidRequest(str(error)) from None
        self._forward_s += result.forward_s
        self._tokens_processed += result.tokens_processed
        if self._decode_steps > 1:
            return self._decode_step(verdict, result)
        hidden = None
        if result.hidden is not None:
            hidden = result.hidden[: len(sync.append) + verdict.accepted_len]
            if verdict.branch_path:  # the kept alternatives' states follow the chain's
                rows = [self._chain_length + index for index in verdict.branch_path]
                hidden = torch.cat([hidden, result.hidden[rows]])
        self._output = VerifyOutput(verdict, result.kv_length, self._forward_s,
                                    self._tokens_processed, hidden)
        return True

    def _decode_step(self, verdict: Verdict, result: ExtendResult) -> bool:
        """Keep the drawn token; feed it next unless the steps or a stop token end here."""
        token = verdict.next_token
        self._drawn.append(token)
        if len(self._drawn) < self._decode_steps and token not in self._stop_token_ids:
            request = self._request
            self._request = ExtendRequest(
                request.session_id, request.committed_position + len(request.tokens),
                fold_fingerprint(request.fingerprint, request.tokens), [token])
            self._position += 1
            return False
        first, *decoded = self._drawn
        self._output = VerifyOutput(Verdict(0, first), result.kv_length, self._forward_s,
                                    self._tokens_processed, decoded=tuple(decoded))
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
               num_alternatives: int = 0, max_alternative_depth: int = 0) -> DraftOutput:
    """One proposal alone (see DraftJob)."""
    out = draft_batch(runner, [DraftJob(runner, sync, num_tokens, params, min_confidence,
                                        target_hidden, num_alternatives,
                                        max_alternative_depth)])[0]
    if isinstance(out, Exception):
        raise out
    return out


def verify_batch(runner: ModelRunner, items: Sequence[VerifyJob]
                 ) -> list[VerifyOutput | Exception]:
    """Every verification in one forward, the rejection sampler per session."""
    errors = run_jobs(runner, items)
    return [job.output() if error is None else error for job, error in zip(items, errors,
                                                                            strict=True)]


def verify_step(runner: ModelRunner, sync: SyncPoint, draft_tokens: list[int],
                draft_probs: torch.Tensor | None, params: SamplingParams,
                return_hidden: bool = False,
                alternatives: Alternatives = NO_ALTERNATIVES,
                hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
    """One verification alone (see VerifyJob)."""
    out = verify_batch(runner, [VerifyJob(sync, draft_tokens, draft_probs, params,
                                          return_hidden, alternatives, hidden_layers)])[0]
    if isinstance(out, Exception):
        raise out
    return out
