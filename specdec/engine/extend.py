"""What ModelRunner.extend takes and gives, the state it keeps per session, and the
decode-sized forward a backend may give a model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from specdec.core.history import TokenHistory
from specdec.engine.kv_cache import GrowingLayer


@dataclass
class Session:
    history: TokenHistory = field(default_factory=TokenHistory)
    cache: DynamicCache | None = None
    last_used: float = field(default_factory=time.monotonic)

    def kv_bytes(self) -> int:
        """The memory the cache's keys and values hold: their whole storage, which is
        more than the positions in use where a layer grows in place or was cropped."""
        if self.cache is None:
            return 0
        total = 0
        for layer in self.cache.layers:
            if isinstance(layer, GrowingLayer):  # without making views of its buffers
                total += layer.nbytes()
                continue
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.untyped_storage().nbytes()
        return total


@dataclass(frozen=True)
class ExtendRequest:
    """One session's extend (the arguments of `ModelRunner.extend`)."""

    session_id: str
    committed_position: int
    fingerprint: int
    tokens: list[int]
    num_logits: int = 1
    hidden_rows: int = 0
    target_hidden: torch.Tensor | None = None  # [len(tokens), target hidden]
    # The last len(branch_parents) tokens are token-tree branches: each one's parent as
    # an absolute cache slot (see ModelRunner.extend).
    branch_parents: tuple[int, ...] = ()
    prefill_length: int = 0  # at committed_position 0: the tokens to prefill in one piece
    # With hidden_rows: the inputs of these decoder layers side by side (none: the final
    # norm's output; a draft: its own output state).
    hidden_layers: tuple[int, ...] = ()
    # target_hidden holds the model's own output states (a draft reading them back for
    # the tokens it drafted), not the target's.
    own_hidden: bool = False


@dataclass(frozen=True)
class ExtendResult:
    logits: torch.Tensor  # [num_logits, usable_rows] fp32, model space
    kv_length: int
    forward_s: float  # the time of the forwards its rows ran in (shared ones in full)
    tokens_processed: int
    # [hidden_rows, width] the states hidden_layers names of the last hidden_rows tokens
    hidden: torch.Tensor | None = None


# Where a backend leaves a model's decode-sized forward of its own (a FusedForward; the
# cpu-tuned backend's specdec.engine.fused_step), which the runner then calls for
# decode-sized forwards that capture no states.
FUSED_STEP_ATTRIBUTE = "specdec_fused_step"


class FusedForward(Protocol):
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                 logits_to_keep: int | torch.Tensor, attention_mask: torch.Tensor | None,
                 attention_kwargs: dict[str, Any] | None) -> torch.Tensor:
        """Logits [1, kept rows, vocab], the bits the model's own forward gives."""
        ...
