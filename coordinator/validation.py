"""GenerateRequest -> a checked, tokenized request; InvalidRequest names the bad field."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.core.sampling import SamplingParams
from specdec.engine.shapes import DECODE_ROWS
from specdec.errors import InvalidRequest
from specdec.proto.specdec.v1 import coordinator_pb2
from specdec.serving import wire
from specdec.settings import SPECULATION_METHODS

# A cache salt names a partition of the suffix cache; longer ones are not names.
MAX_CACHE_SALT_BYTES = 256


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # the target's
    max_context: int  # the target's
    max_new_tokens: int  # SPECDEC_MAX_NEW_TOKENS_LIMIT
    max_draft_tokens: int
    # Adaptive requests that give no length start from it (SPECDEC_NUM_DRAFT_TOKENS).
    default_draft_tokens: int
    default_draft_confidence: float = 0.0  # adaptive requests that do not set their own
    default_alternatives: int = 0  # greedy requests that do not set their own
    default_lookup_tokens: int = 0  # requests that do not set their own
    max_prompt_tokens: int = 0  # SPECDEC_MAX_PROMPT_TOKENS; 0 = the target's context
    default_suffix_tokens: int = 0  # SPECDEC_SUFFIX_MAX_TOKENS: 0 = suffix decoding off


# SpeculationParams.method: where a round's proposals come from ("" = auto).
METHODS = SPECULATION_METHODS
AUTO, DRAFT, SUFFIX, LOOKUP, NONE = METHODS


@dataclass(frozen=True)
class ValidRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    num_draft_tokens: int
    adaptive: bool
    stop: list[str]
    draft_confidence: float = 0.0
    num_alternatives: int = 0
    prompt_lookup_tokens: int = 0
    max_alternative_depth: int = 0
    method: str = AUTO  # NONE only with num_draft_tokens 0
    suffix_tokens: int = 0


def validate(request: coordinator_pb2.GenerateRequest, limits: Limits,
             tokenizer: Any | None) -> ValidRequest:
    source = prompt_source(request)
    has_text = source in ("prompt", "messages")
    if request.chat and source != "prompt":
        raise InvalidRequest(f"chat applies the chat template to `prompt`; it cannot be used "
                             f"with {source}" + (" (messages are always rendered with it)"
                                                 if source == "messages" else ""))
    if not 0 < request.max_new_tokens <= limits.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens must be in [1, {limits.max_new_tokens}] "
                             f"(SPECDEC_MAX_NEW_TOKENS_LIMIT), got {request.max_new_tokens}")
    sampling = (wire.sampling_from_proto(request.sampling) if request.HasField("sampling")
                else SamplingParams())
    if len(request.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got "
                             f"{len(request.cache_salt.encode())}")
    method = speculation_method(request, limits)
    num_draft_tokens, adaptive = speculation_mode(request, limits)
    if method == NONE:
        num_draft_tokens, adaptive = 0, False
    elif num_draft_tokens == 0 and not adaptive:
        if method != AUTO:
            raise InvalidRequest(f"speculation.method {method!r} speculates, but "
                                 "num_draft_tokens 0 without adaptive asks for target-only "
                                 "decoding; leave num_draft_tokens out or set it above 0")
        method = NONE
    draft_confidence = limits.default_draft_confidence if adaptive else 0.0
    if request.HasField("speculation") and request.speculation.HasField("draft_confidence"):
        draft_confidence = request.speculation.draft_confidence
        if not 0.0 <= draft_confidence <= 1.0:  # NaN fails this too
            raise InvalidRequest(f"speculation.draft_confidence must be in [0, 1], "
                                 f"got {draft_confidence}")
    # Adaptive requests verify token trees; a fixed draft length keeps a chain.
    num_alternatives = limits.default_alternatives if adaptive else 0
    if request.HasField("speculation") and request.speculation.HasField("num_alternatives"):
        num_alternatives = request.speculation.num_alternatives
        if not 0 <= num_alternatives <= DECODE_ROWS:
            raise InvalidRequest(f"speculation.num_alternatives must be in "
                                 f"[0, {DECODE_ROWS}], got {num_alternatives}")
    max_alternative_depth = request.speculation.max_alternative_depth
    if max_alternative_depth < 0:
        raise InvalidRequest(f"speculation.max_alternative_depth must be 0 (no limit) or "
                             f"more, got {max_alternative_depth}")
    lookup_tokens = limits.default_lookup_tokens
    if request.HasField("speculation") and request.speculation.HasField("prompt_lookup_tokens"):
        lookup_tokens = request.speculation.prompt_lookup_tokens
        if not 0 <= lookup_tokens <= limits.max_draft_tokens:
            raise InvalidRequest(f"speculation.prompt_lookup_tokens must be in "
                                 f"[0, {limits.max_draft_tokens}], got {lookup_tokens}")
    suffix_tokens = limits.default_suffix_tokens
    if request.HasField("speculation") and request.speculation.HasField("suffix_tokens"):
        if limits.default_suffix_tokens == 0 and request.speculation.suffix_tokens:
            raise InvalidRequest("speculation.suffix_tokens: suffix decoding is off on this "
                                 "coordinator (SPECDEC_SUFFIX_MAX_TOKENS is 0)")
        suffix_tokens = request.speculation.suffix_tokens
        if not 0 <= suffix_tokens <= limits.default_suffix_tokens:
            raise InvalidRequest(f"speculation.suffix_tokens must be in "
                                 f"[0, {limits.default_suffix_tokens}] "
                                 f"(SPECDEC_SUFFIX_MAX_TOKENS), got {suffix_tokens}")
    if method == NONE:
        check_target_only(request)
    if method == SUFFIX and suffix_tokens == 0:
        raise InvalidRequest("speculation.method \"suffix\" needs suffix_tokens > 0")
    if method == LOOKUP and lookup_tokens == 0:
        raise InvalidRequest("speculation.method \"lookup\" needs prompt_lookup_tokens > 0 "
                             "(the coordinator's SPECDEC_PROMPT_LOOKUP_TOKENS is 0 unless the "
                             "request sets its own)")
    stop = list(request.stop)
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequest(f"stop[{index}] is empty")
    if (stop or has_text) and tokenizer is None:
        field = source if has_text else "stop"
        raise InvalidRequest(f"{field} needs a tokenizer and this coordinator's target has "
                             "none; send prompt_token_ids and no stop strings")
    field = source
    if source == "messages":
        prompt_ids = render_messages(tokenizer, request.messages)
    elif source == "prompt":
        prompt_ids = tokenize(tokenizer, request.prompt, request.chat)
    else:
        prompt_ids = list(request.prompt_token_ids)
    if has_text and not prompt_ids:
        raise InvalidRequest(f"{source} tokenizes to no tokens")
    wire.check_token_ids(prompt_ids, limits.vocab_size, field)
    if limits.max_prompt_tokens and len(prompt_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(f"{field} is {len(prompt_ids)} tokens long; this server accepts "
                             f"at most {limits.max_prompt_tokens} (SPECDEC_MAX_PROMPT_TOKENS)")
    if len(prompt_ids) >= limits.max_context:
        raise InvalidRequest(f"{field} is {len(prompt_ids)} tokens long; the target's context "
                             f"is {limits.max_context} tokens")
    if len(prompt_ids) + request.max_new_tokens > limits.max_context:
        raise InvalidRequest(
            f"max_new_tokens {request.max_new_tokens} after a prompt of {len(prompt_ids)} "
            f"tokens exceeds the target's context of {limits.max_context}; at most "
            f"{limits.max_context - len(prompt_ids)}")
    return ValidRequest(prompt_ids, request.max_new_tokens, sampling, num_draft_tokens,
                        adaptive, stop, draft_confidence, num_alternatives, lookup_tokens,
                        max_alternative_depth, method, suffix_tokens)


def speculation_method(request: coordinator_pb2.GenerateRequest, limits: Limits) -> str:
    """The request's `speculation.method`, "auto" when unset; InvalidRequest naming the
    choices for any other value, or for "suffix" on a coordinator with it off."""
    method = request.speculation.method or AUTO
    if method not in METHODS:
        raise InvalidRequest(f"speculation.method must be one of {', '.join(METHODS)} "
                             f"(empty = auto), got {method!r}")
    if method == SUFFIX and not limits.default_suffix_tokens:
        raise InvalidRequest("speculation.method \"suffix\" is off on this coordinator "
                             "(SPECDEC_SUFFIX_MAX_TOKENS is 0); use auto, draft or lookup")
    return method


def speculation_mode(request: coordinator_pb2.GenerateRequest,
                     limits: Limits) -> tuple[int, bool]:
    """(draft length, adaptive) a request asks for; unset fields are the defaults.

    No `speculation`, or one that sets neither field: adaptive, from the coordinator's
    default length. `adaptive` with num_draft_tokens 0 or unset: the same (0 there means
    "the default length"). num_draft_tokens N > 0 with adaptive false or unset: a fixed
    length of N; adaptive false alone, a fixed default length. num_draft_tokens 0 set
    without adaptive: target-only decoding (check_target_only).
    """
    speculation = request.speculation
    if not speculation.HasField("num_draft_tokens"):
        adaptive = speculation.adaptive if speculation.HasField("adaptive") else True
        return limits.default_draft_tokens, adaptive
    num_draft_tokens = speculation.num_draft_tokens
    adaptive = speculation.adaptive  # unset: False, since a length was given
    if not 0 <= num_draft_tokens <= limits.max_draft_tokens:
        raise InvalidRequest(f"speculation.num_draft_tokens must be in "
                             f"[0, {limits.max_draft_tokens}] (0 = the default length with "
                             f"adaptive, target-only without), got {num_draft_tokens}")
    if adaptive:
        return num_draft_tokens or limits.default_draft_tokens, True
    return num_draft_tokens, False


def check_target_only(request: coordinator_pb2.GenerateRequest) -> None:
    """A target-only request (num_draft_tokens 0 without adaptive, or method none) that
    sets a field only speculative requests use is rejected rather than silently served
    without a draft."""
    speculation = request.speculation
    speculative = [name for name in ("draft_confidence", "num_alternatives",
                                     "prompt_lookup_tokens", "suffix_tokens")
                   if speculation.HasField(name) and getattr(speculation, name) != 0]
    if speculation.max_alternative_depth:
        speculative.append("max_alternative_depth")
    if speculation.method == NONE and (speculation.num_draft_tokens or speculation.adaptive):
        speculative.append("num_draft_tokens" if speculation.num_draft_tokens else "adaptive")
    if speculative:
        asked = ("method none" if speculation.method == NONE
                 else "num_draft_tokens 0 without adaptive")
        raise InvalidRequest(
            f"speculation.{speculative[0]} applies to speculative requests, but "
            f"{asked} asks for target-only decoding; leave it out for the default "
            "(adaptive, method auto), or ask for speculation (adaptive, num_draft_tokens "
            "> 0, or a method other than none)")


PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
CHAT_ROLES = ("system", "user", "assistant")


def prompt_source(request: coordinator_pb2.GenerateRequest) -> str:
    """The one prompt field the request sets; InvalidRequest unless exactly one is set."""
    given = [name for name in PROMPT_FIELDS
             if (request.prompt if name == "prompt" else len(getattr(request, name)))]
    if not given:
        raise InvalidRequest("one of prompt, prompt_token_ids or messages is required "
                             "(all are empty)")
    if len(given) > 1:
        raise InvalidRequest(f"give one of prompt, prompt_token_ids and messages, "
                             f"not both {' and '.join(given)}")
    return given[0]


def render_messages(tokenizer: Any, messages: Sequence[coordinator_pb2.ChatMessage]
                    ) -> list[int]:
    """A conversation -> prompt ids: the target's chat template with the generation prompt
    (the start of the assistant's turn) appended. Empty content is a valid turn."""
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{index}].role must be one of "
                                 f"{', '.join(CHAT_ROLES)}; got {message.role!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages need a chat template and this coordinator's target "
                             "tokenizer has none; send prompt instead")
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as error:  # the template's own checks (jinja raise_exception)
        raise InvalidRequest(f"messages: the target's chat template rejected this "
                             f"conversation: {error}") from error
    # Special tokens come from the template (SmolLM2 adds no BOS of its own).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
    # Special tokens come from the template (SmolLM2 adds no BOS of its own).
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def decoder(tokenizer: Any | None) -> Callable[[list[int]], str] | None:
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
