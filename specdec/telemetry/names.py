"""Span names, attribute keys and event names shared by the writers and `specdec traces`.

One module so the tracer that writes an attribute and the reader that shows it cannot
drift apart. Keys follow OpenTelemetry's dotted lower-case style under `specdec.`.
"""

from __future__ import annotations

# Span names.
GENERATE_SPAN = "specdec.generate"  # one per request, in the coordinator
ROUND_SPAN = "specdec.round"  # one per speculative round, child of the request span
PROPOSE_STEP_SPAN = "specdec.propose"  # in-process runs only (gRPC runs get client spans)
VERIFY_STEP_SPAN = "specdec.verify"
REJECTION_EVENT = "specdec.core.rejection"

# Resource attribute naming the role, so files join even under a custom service.name.
ROLE = "specdec.role"

# Request span.
REQUEST_ID = "specdec.request_id"
SESSION_ID = "specdec.session_id"
PROMPT_TOKENS = "specdec.prompt_tokens"
NEW_TOKENS = "specdec.new_tokens"
MAX_NEW_TOKENS = "specdec.max_new_tokens"
NUM_DRAFT_TOKENS = "specdec.num_draft_tokens"
TEMPERATURE = "specdec.temperature"
ROUNDS = "specdec.rounds"
NUM_DRAFTS = "specdec.num_drafts"
DRAFT_TOKENS = "specdec.draft_tokens"
ACCEPTED_TOKENS = "specdec.accepted_tokens"
ACCEPTANCE_RATE = "specdec.acceptance_rate"
MEAN_ACCEPTED_LENGTH = "specdec.mean_accepted_length"
FINISH_REASON = "specdec.finish_reason"
DEGRADED = "specdec.degraded"
RESYNCS = "specdec.resyncs"
TTFT_MS = "specdec.time_to_first_token_ms"
DRAFT_MS = "specdec.propose_ms"  # time the loop waited on Propose
VERIFY_MS = "specdec.verify_ms"  # time the loop waited on Verify
DRAFT_FORWARD_MS = "specdec.draft_forward_ms"  # model time inside the draft
VERIFY_FORWARD_MS = "specdec.verify_forward_ms"  # model time inside the target
WIRE_BYTES = "specdec.wire_bytes"

# Round span (timing keys above are reused per round).
ROUND_INDEX = "specdec.round.index"
POSITION_BEFORE = "specdec.round.position_before"
POSITION_AFTER = "specdec.round.position_after"
ASKED = "specdec.round.asked"
PROPOSED = "specdec.round.proposed"
ACCEPTED = "specdec.round.accepted"  # the accepted path's length, alternatives included
ALTERNATIVES = "specdec.round.alternatives"  # token-tree nodes verified beside the chain
ALTERNATIVE_KEPT = "specdec.round.alternative_kept"  # the accepted path left the chain
TREE_DEPTH = "specdec.round.tree_depth"  # the proposal's deepest node (the chain's length
# for a chain)
KEPT_RANKS = "specdec.round.kept_ranks"  # per depth of the accepted path, the kept
# child's rank among its siblings (0: the chain's token or a first child)
# Who proposed: "draft" (the draft model), "prompt_lookup" (copied from earlier text, no
# Propose call), "suffix" (the suffix cache's token tree, no Propose call), "" (a
# target-only round); ACCEPTED says how many of its tokens were kept.
SOURCE = "specdec.round.source"
EMITTED = "specdec.round.emitted"
EMITTED_TOKEN_IDS = "specdec.round.emitted_token_ids"
NEXT_TOKEN_KIND = "specdec.round.next_token_kind"  # "bonus", "correction" or "target"
# The forward each call of the round ran in (BatchInfo; absent when the service does
# not report it), and the load-aware policy's view of the load.
PROPOSE_BATCH_SESSIONS = "specdec.round.propose_batch.sessions"
PROPOSE_BATCH_ROWS = "specdec.round.propose_batch.rows"
PROPOSE_QUEUE_WAIT_MS = "specdec.round.propose_batch.queue_wait_ms"
VERIFY_BATCH_SESSIONS = "specdec.round.verify_batch.sessions"
VERIFY_BATCH_ROWS = "specdec.round.verify_batch.rows"
VERIFY_QUEUE_WAIT_MS = "specdec.round.verify_batch.queue_wait_ms"
VERIFY_BATCH_QUEUED = "specdec.round.verify_batch.queued"
LOAD_SESSIONS = "specdec.round.load.sessions"  # expected sharers of the forward, itself too
LOAD_OTHER_ROWS = "specdec.round.load.other_rows"
LOAD_RUNNING = "specdec.round.load.running"  # the coordinator's running generations
# True when the load made the round draft fewer tokens than the session alone would
# have (ALONE_LENGTH); a load-limited round with ASKED = 0 is speculation turned off.
LOAD_LIMITED = "specdec.round.load_limited"
ALONE_LENGTH = "specdec.round.alone_length"
# True when the deployment's speculation gate turned drafting off for the round.
GATED_OFF = "specdec.round.gated_off"
# What the gate allowed the round: "target-only", "model-free" or "draft" (Arm.label).
GATE_ARM = "specdec.round.gate_arm"

# Rejection event.
REJECT_POSITION = "specdec.position"  # absolute position of the rejected token
REJECT_DRAFT_INDEX = "specdec.draft_index"  # 0-based index within the proposal
REJECTED_TOKEN = "specdec.rejected_token"
CORRECTION_TOKEN = "specdec.correction_token"

# Server spans (draft Propose, target Verify), set by the servicers.
FORWARD_MS = "specdec.forward_ms"
TOKENS_PROCESSED = "specdec.tokens_processed"
KV_LENGTH = "specdec.kv_length"
COMMITTED_POSITION = "specdec.committed_position"
CATCH_UP_TOKENS = "specdec.catch_up_tokens"  # committed tokens the service lacked
STEPS = "specdec.steps"  # forwards a Verify ran one after another (1 + its decoded tokens)
# The batch a Propose/Verify ran in (specdec.serving.model_service.BatchInfo).
BATCH_SESSIONS = "specdec.batch.sessions"
BATCH_ROWS = "specdec.batch.rows"
QUEUE_WAIT_MS = "specdec.batch.queue_wait_ms"
BATCH_QUEUED = "specdec.batch.queued"
