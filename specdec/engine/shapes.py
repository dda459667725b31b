"""The shape every layer agrees on: a decode-sized forward.

A forward of at most DECODE_ROWS query rows per session is decode-sized: a round's
catch-up tokens, draft chain and alternatives fit in one. The attention kernels choose
their path by it, the runner runs longer extends as one prefill plus decode-sized
pieces, the batch scheduler treats a longer call as a prefill, and the services cap a
request's alternatives by it.
"""

from __future__ import annotations

from specdec.settings import default

DECODE_ROWS = 16

# Alternatives per greedy round by default: each is one more row of the target's forward.
DEFAULT_ALTERNATIVES: int = default("draft-alternatives")

# Most tokens one verification decodes (VerifyJob's decode_steps): its forwards run
# within one call's deadline.
MAX_DECODE_STEPS = 64
