"""Draft and target must tokenize alike: the draft proposes target token ids.

A draft with another tokenizer still gives exact output (every token is the target's
choice) but its proposals mean other strings, so almost none is accepted. The
coordinator checks the pair at start and refuses a mismatched one.

Compared in the target's id space: a draft with its own tokenizer must have the target's
vocabulary (every token string at the same id) and special tokens; a reduced-vocabulary
draft (token_map.json: draft id -> target id) must map into the target's vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from specdec.engine.token_map import has_token_map, read_token_map

log = logging.getLogger(__name__)

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def vocabulary_mismatch(target: Any, draft: Any) -> str | None:
    """Why the draft's tokenizer differs from the target's, or None if they agree."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(token for token in target_vocab.keys() | draft_vocab.keys()
                           if target_vocab.get(token) != draft_vocab.get(token))
        example = differing[0]
        return (f"{len(differing)} of {len(target_vocab | draft_vocab)} token strings differ "
                f"(e.g. {example!r}: target id {target_vocab.get(example)}, draft id "
                f"{draft_vocab.get(example)}); target vocabulary {len(target_vocab)}, draft "
                f"{len(draft_vocab)}")
    for name in SPECIAL:
        ours, theirs = getattr(target, name, None), getattr(draft, name, None)
        if ours is not None and theirs is not None and str(ours) != str(theirs):
            return f"special token {name}: target {ours!r}, draft {theirs!r}"
    if set(target.all_special_tokens) != set(draft.all_special_tokens):
        only = sorted(set(target.all_special_tokens) ^ set(draft.all_special_tokens))
        return f"special tokens differ: {only[:5]}"
    return None


def token_map_mismatch(target_ids: list[int], target_vocab_size: int) -> str | None:
    """Why a reduced-vocabulary draft's map cannot be onto this target, or None."""
    if not target_ids:
        return "token_map.json maps no tokens"
    if max(target_ids) >= target_vocab_size or min(target_ids) < 0:
        return (f"token_map.json maps onto target ids up to {max(target_ids)}, beyond the "
                f"target's vocabulary of {target_vocab_size}")
    if len(set(target_ids)) != len(target_ids):
        return "token_map.json maps two draft tokens onto one target token"
    return None


def check_pair(target_name: str, draft_name: str, target_tokenizer: Any | None,
               target_vocab_size: int) -> None:
    """Raise RuntimeError when the draft cannot share the target's tokens; log and go on
    when it cannot be told (no tokenizer on either side)."""
    from transformers import AutoTokenizer

    from specdec.engine.models import ModelNotFound, resolve

    try:
        source = resolve(draft_name, progress=False)
    except (ModelNotFound, FileNotFoundError) as error:  # the draft service reports it
        log.warning("cannot check the draft's tokenizer: %s", error)
        return
    mapped = source if isinstance(source, Path) and has_token_map(source) else None
    problem = (token_map_mismatch(read_token_map(mapped), target_vocab_size)
               if mapped is not None else None)
    draft_tokenizer = None
    with contextlib.suppress(OSError, ValueError, TypeError):
        draft_tokenizer = AutoTokenizer.from_pretrained(source)
    if problem is None and draft_tokenizer is not None and target_tokenizer is not None:
        problem = vocabulary_mismatch(target_tokenizer, draft_tokenizer)
    if problem is not None:
        raise RuntimeError(
            f"draft {draft_name!r} does not share the target {target_name!r}'s tokenizer: "
            f"{problem}. Draft and target must use the same tokenizer (docs/models.md)")
    if draft_tokenizer is None and mapped is None:
        log.warning("draft %s has no tokenizer to compare with the target's; it must use "
                    "the target's token ids", draft_name)
