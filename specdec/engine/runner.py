"""A causal LM with one KV cache per session: extend, roll back, release, LRU-evict.

Rollback is a crop of the session's cache to the committed position (a slice, no copy;
where the fused step runs, a kv_cache.GrowingCache, which writes new rows in place); its
TokenHistory says what the cache holds, so a request naming a committed position and its
fingerprint is checked before anything is computed.

`extend_batch` serves many sessions per forward: every session's decode-sized rows are
packed into one sequence, each at its own positions over its own cache (PackedBatch in
specdec.engine.attention). Under the row-invariant kernels (CPU: oneDNN or int8 linears
and rowwise attention) a row's logits are then the bits it gets when its session runs
alone, up to the linear kernel's measured row cap (`max_invariant_rows`; larger batches
are split into forwards of whole sessions); under the others (float32, CUDA) within
float tolerance only.

Prefills do not share forwards: a catch-up longer than a decode-sized forward runs its
prefix alone first (the prefill a target-only run of the prompt makes), and only its
decode-sized rows join the packed forward. Chunking a long prompt would change its last
row and with it greedy equality, so no chunked prefill is offered.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.engine.attention import PACKABLE, PACKING_KWARG, PackedBatch
from specdec.engine.eagle3 import is_eagle3_draft
from specdec.engine.extend import (
    FUSED_STEP_ATTRIBUTE,
    ExtendRequest,
    ExtendResult,
    FusedForward,
    Session,
)
from specdec.engine.hidden_states import Capture, capture_keys, check_layers, state_reader
from specdec.engine.kv_cache import GrowingCache
from specdec.engine.shapes import DECODE_ROWS
from specdec.engine.vocab import VocabAdapter
from specdec.errors import CacheSyncError, InvalidRequest, KVBudgetExhausted, SpecdecError


@dataclass(frozen=True)
class _Admitted:
    """A request that passed its checks, with its session rolled back to its position."""

    index: int
    request: ExtendRequest
    session: Session


@dataclass
class _Job:
    """An admitted request on its way through one or more forwards."""

    entry: _Admitted
    start: int  # tokens the session holds before this extend
    positions: list[int]  # each new token's absolute position
    chain_length: int  # tokens that stay (the rest are token-tree branches)
    pieces: list[tuple[int, int]]  # its forwards, as [begin, end) token ranges
    # The request's target_hidden in the model's input space (StateReader.model_input).
    hidden_input: torch.Tensor | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)
    forward_s: float = 0.0

    @staticmethod
    def rows(piece: tuple[int, int]) -> int:
        return piece[1] - piece[0]

    def logit_rows(self, piece: tuple[int, int]) -> int:
        """How many of the piece's rows are among the request's last num_logits."""
        first = len(self.entry.request.tokens) - self.entry.request.num_logits
        return max(0, piece[1] - max(piece[0], first))

    def target_hidden(self, piece: tuple[int, int]) -> torch.Tensor | None:
        hidden = self.hidden_input
        return None if hidden is None else hidden[piece[0]:piece[1]]


class ModelRunner:
    """Serialises forwards on one model; sessions are keyed by the caller's session id."""

    def __init__(self, model: PreTrainedModel, target_vocab_size: int | None = None,
                 token_map: torch.Tensor | None = None, kv_budget_bytes: int | None = None,
                 max_context: int | None = None,
                 row_invariance: tuple[bool, int | None] | None = None) -> None:
        """row_invariance: the backend's (row_invariant, max_invariant_rows) for this
        model (LoadedModel's); None: asked from specdec.engine.backends.row_invariance."""
        self.model = model
        config = model.config
        self.device = next(model.parameters()).device
        model_rows = int(config.vocab_size)
        # An EAGLE-3 draft embeds target ids and maps its rows onto them itself (d2t).
        eagle3 = is_eagle3_draft(model)
        if eagle3:
            token_map = model.draft_to_target().cpu()  # type: ignore[operator]
        self.vocab = VocabAdapter(model_rows, target_vocab_size or model_rows, token_map,
                                  map_inputs=not eagle3)
        self.max_context = max_context or int(getattr(config, "max_position_embeddings", 2048))
        self.kv_budget_bytes = kv_budget_bytes
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.RLock()
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # A backend's decode-sized forward of the model (same bits; specdec.engine.fused_step).
        self._fused_step: FusedForward | None = getattr(model, FUSED_STEP_ATTRIBUTE, None)
        # How the model reads hidden states (None: it reads tokens only).
        self.hidden_reader = state_reader(model)
        self.needs_target_hidden = self.hidden_reader is not None
        if row_invariance is None:  # not stated by the caller: ask the backends' seam
            from specdec.engine.backends.row_invariance import row_invariance as facts

            row_invariance = facts(model)
        # Whether a row's result is independent of the forward it is in, and then the
        # most rows a forward may hold with every row getting the bits it gets alone;
        # None otherwise, where batching is correct within float tolerance and only the
        # caller's batch-size setting limits it.
        self._row_invariant, max_invariant_rows = row_invariance
        self.max_invariant_rows = max_invariant_rows if self._row_invariant else None
        # The most rows one packed forward holds; a larger batch is split by sessions.
        self.max_batch_rows = self.max_invariant_rows
        # Width of the target's rows the model reads (0: none).
        self.target_hidden_size = (self.hidden_reader.target_width
                                   if self.hidden_reader is not None else 0)

    def placeholder_hidden(self, num_tokens: int) -> torch.Tensor | None:
        """Zero target states for the timing and warm-up calls of a draft that reads them
        (None for other models): the cost of a forward does not depend on their values."""
        if not self.needs_target_hidden:
            return None
        return torch.zeros(num_tokens, self.target_hidden_size)

    # -- session bookkeeping -------------------------------------------------------------
    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    def total_kv_bytes(self) -> int:
        with self._lock:
            return sum(session.kv_bytes() for session in self._sessions.values())

    def session_bytes(self, session_id: str) -> int:
        with self._lock:
            session = self._sessions.get(session_id)
            return session.kv_bytes() if session else 0

    def kv_length(self, session_id: str) -> int:
        with self._lock:
            session = self._sessions.get(session_id)
            return len(session.history) if session else 0

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def _bytes_per_token(self) -> int:
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        dtype_bytes = next(self.model.parameters()).element_size()
        return 2 * int(config.num_hidden_layers) * int(heads) * int(head_dim) * dtype_bytes

    # -- the one operation -----------------------------------------------------------------
    def extend(self, session_id: str, committed_position: int, fingerprint: int,
               tokens: list[int], num_logits: int = 1, *, hidden_rows: int = 0,
               target_hidden: torch.Tensor | None = None,
               branch_parents: Sequence[int] = (), hidden_layers: Sequence[int] = (),
               own_hidden: bool = False) -> ExtendResult:
        """Roll the session back to committed_position, append tokens, run one forward.

        committed_position == 0 (re)starts the session. Raises CacheSyncError when the
        cache does not hold the named prefix, so the caller can re-sync from scratch.
        hidden_rows: also return the hidden states of the last hidden_rows tokens: the
        final norm's output, or the inputs of the decoder layers hidden_layers names side
        by side (a draft that reads states: its own output state). target_hidden:
        [len(tokens), width], what such a draft reads: the target's states, or with
        own_hidden its own.
        branch_parents: the last len(branch_parents) tokens are branches of a token tree,
        not a continuation. Token i of the request goes to cache slot committed_position
        + i; branch j's parent is the slot branch_parents[j], a chain slot (the session's
        tokens and this request's other tokens, where slot s holds position s) or an
        earlier branch of the request. A branch sits one position after its parent and
        sees what its parent sees plus itself: the tokens of its path, as a decode of
        that path would. Branches get logits like any row and leave the cache after the
        forward; the session then holds the other tokens.
        """
        result = self.extend_batch([ExtendRequest(
            session_id, committed_position, fingerprint, list(tokens), num_logits,
            hidden_rows, target_hidden, tuple(branch_parents),
            hidden_layers=tuple(hidden_layers), own_hidden=own_hidden)])[0]
        if isinstance(result, SpecdecError):
            raise result
        return result

    def append(self, session_id: str, tokens: list[int], *, hidden_rows: int = 0,
               target_hidden: torch.Tensor | None = None) -> ExtendResult:
        """Extend a live session at its current end (speculative draft steps)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise CacheSyncError(f"session {session_id!r} was evicted while drafting")
            held = len(session.history)
            return self.extend(session_id, held, session.history.fingerprint(), tokens,
                               hidden_rows=hidden_rows, target_hidden=target_hidden)

    def extend_batch(self, requests: Sequence[ExtendRequest]
                     ) -> list[ExtendResult | SpecdecError]:
        """What `extend` does for each request, with every request's rows in one forward.

        Each request's new rows run at their own positions over their own session's
        cache. Results come back in request order; a request that fails validation
        (CacheSyncError, InvalidRequest, KVBudgetExhausted) gets its error in its slot,
        is left out of the forward and leaves every cache as it was. Two requests for one
        session are a caller bug: the second is refused. A batch of more rows than
        max_batch_rows runs as several forwards of whole sessions, in request order.
        """
        results: list[ExtendResult | SpecdecError | None] = [None] * len(requests)
        with self._lock:
            admitted = self._admit(requests, results)
            if admitted:
                self._run(admitted, results)
        return [result for result in results if result is not None]

    def _validate(self, request: ExtendRequest) -> None:
        tokens, committed_position = request.tokens, request.committed_position
        if not tokens:
            raise InvalidRequest("extend needs at least one new token")
        if committed_position < 0:
            raise InvalidRequest(f"committed position must be >= 0, got {committed_position}")
        chain_length = len(tokens) - len(request.branch_parents)
        first_branch = committed_position + chain_length
        if chain_length < 1 or any(not 0 <= parent < first_branch + branch
                                   for branch, parent in enumerate(request.branch_parents)):
            raise InvalidRequest(
                f"branch parents {list(request.branch_parents)} must be cache slots before "
                f"each branch (branch j at slot {first_branch} + j), after at least one "
                "token of the chain")
        if not 1 <= request.num_logits <= len(tokens):
            raise InvalidRequest(
                f"num_logits must be in [1, {len(tokens)}], got {request.num_logits}")
        if not 0 <= request.hidden_rows <= len(tokens):
            raise InvalidRequest(
                f"hidden_rows must be in [0, {len(tokens)}], got {request.hidden_rows}")
        if request.hidden_rows and request.hidden_layers:
            check_layers(self.model, request.hidden_layers)
        target_hidden = request.target_hidden
        if self.hidden_reader is not None:
            reader = self.hidden_reader
            width = reader.own_width if request.own_hidden else reader.target_width
            if target_hidden is None or tuple(target_hidden.shape) != (len(tokens), width):
                shape = None if target_hidden is None else tuple(target_hidden.shape)
                raise InvalidRequest(
                    f"this draft reads the target's hidden states: expected "
                    f"[{len(tokens)}, {width}] for {len(tokens)} tokens, got {shape}")
        elif target_hidden is not None:
            raise InvalidRequest("target hidden states given to a model that does not read them")
        new_length = committed_position + len(tokens)
        if new_length > self.max_context:
            raise InvalidRequest(
                f"sequence of {new_length} tokens exceeds the model context of "
                f"{self.max_context}")

    def _admit(self, requests: Sequence[ExtendRequest],
               results: list[ExtendResult | SpecdecError | None]) -> list[_Admitted]:
        """Check every request, fit the survivors in the KV budget (evicting LRU sessions
        outside the batch), then roll their sessions back. Nothing is touched until a
        request has passed every check."""
        checked: list[tuple[int, ExtendRequest, Session | None]] = []
        seen: set[str] = set()
        per_token = self._bytes_per_token()
        for index, request in enumerate(requests):
            try:
                if request.session_id in seen:
                    raise InvalidRequest(
                        f"session {request.session_id!r} appears twice in one batch; a "
                        "session runs one extend at a time")
                seen.add(request.session_id)
                self._validate(request)
                session = self._checked_session(request.session_id,
                                                request.committed_position, request.fingerprint)
                if self.kv_budget_bytes is not None:
                    held = session.kv_bytes() if session is not None else 0
                    needed = len(request.tokens) * per_token
                    if min(held, request.committed_position * per_token) + needed \
                            > self.kv_budget_bytes:
                        # Evicting others cannot help, so refuse before touching any cache.
                        raise KVBudgetExhausted(
                            f"KV cache budget of {self.kv_budget_bytes} bytes cannot hold "
                            f"this session ({held} bytes held + {needed} bytes for "
                            f"{len(request.tokens)} new tokens); raise SPECDEC_KV_BUDGET_MB "
                            "or shorten the request")
            except SpecdecError as error:
                results[index] = error
                continue
            checked.append((index, request, session))
        checked = self._fit_budget(checked, results, per_token)
        admitted: list[_Admitted] = []
        for index, request, maybe_session in checked:
            session = maybe_session
            if session is None:
                session = Session()
                self._sessions[request.session_id] = session
            elif request.committed_position == 0:
                session.history.truncate(0)
                session.cache = None
            self._sessions.move_to_end(request.session_id)
            session.last_used = time.monotonic()
            if session.cache is not None and len(session.history) > request.committed_position:
                session.cache.crop(request.committed_position - len(session.history))
            session.history.truncate(request.committed_position)
            admitted.append(_Admitted(index, request, session))
        return admitted

    def _fit_budget(self, checked: list[tuple[int, ExtendRequest, Session | None]],
                    results: list[ExtendResult | SpecdecError | None], per_token: int
                    ) -> list[tuple[int, ExtendRequest, Session | None]]:
        """Evict least recently used sessions outside the batch until the batch's sessions
        fit after the forward; requests that still do not fit (the batch's own sessions
        exceed the budget together) are refused, last first."""
        if self.kv_budget_bytes is None or not checked:
            return checked
        budget = self.kv_budget_bytes
        in_batch = {request.session_id for _, request, _ in checked}

        def batch_bytes(entries: list[tuple[int, ExtendRequest, Session | None]]) -> int:
            return sum((request.committed_position + len(request.tokens)) * per_token
                       for _, request, _ in entries)

        def others_bytes() -> int:
            return sum(session.kv_bytes() for session_id, session in self._sessions.items()
                       if session_id not in in_batch)

        need = batch_bytes(checked)
        while others_bytes() + need > budget:
            victim = next((sid for sid in self._sessions if sid not in in_batch), None)
            if victim is None:
                break
            del self._sessions[victim]
        while len(checked) > 1 and batch_bytes(checked) > budget:
            index, request, _ = checked.pop()
            results[index] = KVBudgetExhausted(
                f"KV cache budget of {budget} bytes cannot hold this session beside the "
                f"{len(checked)} others sharing its forward; retry, or raise "
                "SPECDEC_KV_BUDGET_MB")
        return checked

    def _run(self, admitted: list[_Admitted],
             results: list[ExtendResult | SpecdecError | None]) -> None:
        """The admitted requests' forwards: each session's prefill pieces alone, then
        the sessions' decode-sized rows packed into as few forwards as the row cap
        allows (whole sessions per forward)."""
        jobs = [self._job(entry) for entry in admitted]
        packable = len(jobs) > 1 and self.can_pack()
        batched: list[_Job] = []
        try:
            with torch.inference_mode():
                for job in jobs:
                    join = packable and job.rows(job.pieces[-1]) <= DECODE_ROWS
                    for piece in job.pieces[:-1] if join else job.pieces:
                        self._run_alone(job, piece)
                    if join:
                        batched.append(job)
                for group in self._groups(batched):
                    if len(group) == 1:
                        self._run_alone(group[0], group[0].pieces[-1])
                    else:
                        self._run_packed(group)
        except BaseException:
            for job in jobs:  # a forward failed part-way: these caches are in doubt
                self._sessions.pop(job.entry.request.session_id, None)
            raise
        for job in jobs:
            results[job.entry.index] = self._finish(job)

    def can_pack(self) -> bool:
        """Whether several sessions' rows can share a forward: the model's attention is
        one of specdec's registered kernels (they read the packed layout: grouped,
        rowwise, or transformers' SDPA under specdec's name); otherwise extend_batch runs
        one forward per session."""
        implementation = getattr(self.model.config, "_attn_implementation", None)
        return implementation in PACKABLE

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Consecutive jobs, whole, in forwards of at most max_batch_rows rows."""
        groups: list[list[_Job]] = []
        rows = 0
        for job in jobs:
            count = job.rows(job.pieces[-1])
            if not groups or (self.max_batch_rows is not None
                              and rows + count > self.max_batch_rows):
                groups.append([])
                rows = 0
            groups[-1].append(job)
            rows += count
        return groups

    def _job(self, entry: _Admitted) -> _Job:
        request, session = entry.request, entry.session
        if session.cache is None:  # the fused step writes into a cache that grows in place
            kind = GrowingCache if self._fused_step is not None else DynamicCache
            session.cache = kind(config=self.model.config)
        start = len(session.history)
        chain_length = len(request.tokens) - len(request.branch_parents)
        positions = list(range(start, start + chain_length))
        for parent in request.branch_parents:  # a branch sits one after its parent
            positions.append((positions[parent - start] if parent >= start else parent) + 1)
        hidden_input = None
        if request.target_hidden is not None and self.hidden_reader is not None:
            hidden_input = self.hidden_reader.model_input(self.model, request.target_hidden,
                                                          request.own_hidden)
        return _Job(entry, start, positions, chain_length,
                    self._pieces(len(request.tokens), request.num_logits,
                                 request.prefill_length if start == 0 else 0), hidden_input)

    def _run_alone(self, job: _Job, piece: tuple[int, int]) -> None:
        request = job.entry.request
        begin, end = piece
        piece_logits = job.logit_rows(piece)
        started = time.perf_counter()
        out, states = self._model_forward(
            job.entry.session.cache, request.tokens[begin:end], job.positions[begin:end],
            max(1, piece_logits), capture_keys([request]), job.target_hidden(piece),
            self._tree_mask(job, begin, end))
        job.forward_s += time.perf_counter() - started
        if piece_logits > 0:
            job.logits.append(out[-piece_logits:])
        if states is not None:
            job.states.append(states.rows(request.hidden_layers))

    def _run_packed(self, jobs: list[_Job]) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        hidden: list[torch.Tensor] = []
        masks: list[torch.Tensor | None] = []
        for job in jobs:
            begin, end = piece = job.pieces[-1]
            keep.extend(range(len(tokens) + job.rows(piece) - job.logit_rows(piece),
                              len(tokens) + job.rows(piece)))
            tokens.extend(job.entry.request.tokens[begin:end])
            positions.extend(job.positions[begin:end])
            piece_hidden = job.target_hidden(piece)
            if piece_hidden is not None:
                hidden.append(piece_hidden)
            masks.append(self._tree_mask(job, begin, end))
        packed = PackedBatch([job.entry.session.cache for job in jobs],
                             [job.rows(job.pieces[-1]) for job in jobs], masks)
        started = time.perf_counter()
        out, states = self._model_forward(
            packed, tokens, positions, torch.tensor(keep, device=self.device),
            capture_keys([job.entry.request for job in jobs]),
            torch.cat(hidden) if hidden else None,
            # A 4-D mask is used as given, so transformers builds none: each sequence's
            # attention builds its own from the packed layout.
            torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=self.device),
            {PACKING_KWARG: packed})
        forward_s = time.perf_counter() - started
        row = logit = 0
        for job in jobs:
            piece = job.pieces[-1]
            rows, logit_rows = job.rows(piece), job.logit_rows(piece)
            job.logits.append(out[logit:logit + logit_rows])
            if states is not None and job.entry.request.hidden_rows:
                job.states.append(states.rows(job.entry.request.hidden_layers, row, row + rows))
            job.forward_s += forward_s
            row += rows
            logit += logit_rows

    def _finish(self, job: _Job) -> ExtendResult:
        request, session = job.entry.request, job.entry.session
        if request.branch_parents and session.cache is not None:
            session.cache.crop(-len(request.branch_parents))
        session.history.extend(request.tokens[:job.chain_length])
        logits = self.vocab.restrict(torch.cat(job.logits)).float()
        hidden = (torch.cat(job.states)[-request.hidden_rows:].float()
                  if request.hidden_rows else None)
        return ExtendResult(logits[-request.num_logits:], len(session.history), job.forward_s,
                            len(request.tokens), hidden)

    def _checked_session(self, session_id: str, committed_position: int,
                         fingerprint: int) -> Session | None:
        """The session a request names, if its cache holds the named prefix (position 0:
        any or none, to be restarted). Changes nothing."""
        session = self._sessions.get(session_id)
        if committed_position == 0:
            return session
        if session is None:
            raise CacheSyncError(
                f"session {session_id!r} has no KV cache here (new replica, restart or "
                f"eviction); re-send it from position 0")
        held = len(session.history)
        if held < committed_position:
            raise CacheSyncError(
                f"session {session_id!r} holds {held} tokens, fewer than the committed "
                f"position {committed_position}; re-send it from position 0")
        if session.history.fingerprint(committed_position) != fingerprint:
            raise CacheSyncError(
                f"session {session_id!r} diverges from the committed prefix before position "
                f"{committed_position} (fingerprint mismatch); re-send it from position 0")
        return session

    def _pieces(self, num_tokens: int, num_logits: int,
                prefill_length: int = 0) -> list[tuple[int, int]]:
        """The forwards one extend runs, as [begin, end) token ranges.

        One forward, except under the row-invariant kernels (attention "rowwise") when
        the tokens exceed a decode-sized forward: then everything up to the first row
        with logits goes as one prefill and the other rows with logits in decode-sized
        forwards. The first round of a verification (prompt + draft) then runs the same
        prefill as target-only decoding and transformers' `generate` (the prompt), and
        every later token a decode-sized forward, which gives a row the same result
        whatever the row count: greedy output equals the target's own in reduced
        precision too. A session re-sent from position 0 (prefill_length > 0) replays
        its first forward's prefill (the prompt) and then decode-sized forwards, which
        rebuilds the cache its rounds built, bit for bit.
        """
        if not self._row_invariant or num_tokens <= DECODE_ROWS:
            return [(0, num_tokens)]
        prefix = num_tokens - num_logits + 1
        if 0 < prefill_length < prefix:
            prefix = prefill_length
        pieces = [(0, prefix)]
        for begin in range(prefix, num_tokens, DECODE_ROWS):
            pieces.append((begin, min(begin + DECODE_ROWS, num_tokens)))
        return pieces

    def _tree_mask(self, job: _Job, begin: int, end: int) -> torch.Tensor | None:
        """The attention mask of tokens[begin:end] when branch rows are among them (None:
        plain causal). Token i sits in cache slot start + i; a chain token sees every slot
        up to its own, a branch what its parent sees and its own slot."""
        chain_length, start = job.chain_length, job.start
        if end <= chain_length:
            return None
        slots = start + end
        mask = torch.zeros(1, 1, end - begin, slots, dtype=torch.bool, device=self.device)
        seen: dict[int, torch.Tensor] = {}  # a branch's visible slots, by its index

        def visible(slot: int) -> torch.Tensor:
            index = slot - start
            if index < chain_length:
                row = torch.zeros(slots, dtype=torch.bool, device=self.device)
                row[: slot + 1] = True
                return row
            if index not in seen:
                row = visible(job.entry.request.branch_parents[index - chain_length]).clone()
                row[slot] = True
                seen[index] = row
            return seen[index]

        for row, index in enumerate(range(begin, end)):
            mask[0, 0, row] = visible(start + index)
        return mask

    def _model_forward(self, cache: Any, tokens: list[int], token_positions: list[int],
                       logits_to_keep: int | torch.Tensor, capture_keys: tuple[int, ...],
                       target_hidden: torch.Tensor | None,
                       attention_mask: torch.Tensor | None = None,
                       extra: dict[str, object] | None = None
                       ) -> tuple[torch.Tensor, Capture | None]:
        """One model forward of tokens at token_positions over cache: the logits of the
        rows logits_to_keep names (the last n, or these indices), and the states of every
        row that capture_keys names (hidden_states.Capture; none: no capture)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        ids = self.vocab.to_model_inputs(ids)
        positions = torch.tensor([token_positions], dtype=torch.long, device=self.device)
        # Only the kept rows go through the LM head (a prefill needs one, not every row).
        kwargs: dict[str, object] = dict(extra or {})
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if target_hidden is not None:
            kwargs["target_hidden"] = target_hidden.to(self.device).unsqueeze(0)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if self._fused_step is not None and not capture_keys and target_hidden is None \
                and (PACKING_KWARG in kwargs or len(tokens) <= DECODE_ROWS):
            packing = {PACKING_KWARG: kwargs[PACKING_KWARG]} if PACKING_KWARG in kwargs else None
            return self._fused_step(ids, positions, cache, logits_to_keep, attention_mask,
                                    packing)[0], None
        # The final norm and the layers see every position, the LM head the kept rows.
        capture = Capture(self.model, capture_keys) if capture_keys else None
        try:
            out = self.model(input_ids=ids, cache=cache, position_ids=positions,
                             use_cache=True, **kwargs)
        finally:
            if capture is not None:
                capture.remove()
        logits = out.logits[0]
        if not self._logits_to_keep:
            logits = logits[-logits_to_keep:] if isinstance(logits_to_keep, int) \
                else logits[logits_to_keep]
        return logits, capture
