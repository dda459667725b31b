"""specdec's own runs: target-only and speculative in-process, and over gRPC."""

from __future__ import annotations

import time
from typing import Any

from specdec.bench.configs import GATED, TARGET_ONLY, BenchConfig, RunRecord, SamplingMode
from specdec.core.adaptive import DEFAULT_DRAFT_CONFIDENCE, AdaptiveLength, HeuristicLength
from specdec.core.cost_model import CostModel
from specdec.core.loop import GenerateConfig, GenerationResult, generate
from specdec.core.policy import FixedLength, LengthPolicy
from specdec.core.prompt_lookup import DEFAULT_LOOKUP_TOKENS, PromptLookup
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.shapes import DEFAULT_ALTERNATIVES
from specdec.settings import default

# The first round's length when nothing is known yet (the server default).
ADAPTIVE_START: int = default("num-draft-tokens")


def local_policy(config: BenchConfig, costs: CostModel, greedy: bool,
                 max_length: int) -> LengthPolicy:
    if config.policy == "adaptive":
        return AdaptiveLength(ADAPTIVE_START, max_length, costs=costs,
                              prior_key="greedy" if greedy else "sampled")
    if config.policy == "heuristic":
        return HeuristicLength(ADAPTIVE_START, max_length)
    if config.policy == "confident":
        return FixedLength(max_length)
    return FixedLength(config.fixed_length or 0)


def draft_confidence(config: BenchConfig) -> float:
    """The gate the served coordinator would apply to this configuration's requests."""
    if config.gate is not None:
        return config.gate
    return DEFAULT_DRAFT_CONFIDENCE if config.policy in GATED else 0.0


def alternatives(config: BenchConfig) -> int:
    """A token tree's alternatives per round: the configuration's, else as served (the
    default for adaptive requests, a chain for a fixed length)."""
    if config.alternatives is not None:
        return config.alternatives
    return DEFAULT_ALTERNATIVES if config.policy == "adaptive" else 0


def prompt_lookup(config: BenchConfig, vocab_size: int) -> PromptLookup | None:
    """Prompt lookup as served (or as a "+pN" suffix sets it); None when off."""
    tokens = DEFAULT_LOOKUP_TOKENS if config.lookup_tokens is None else config.lookup_tokens
    return PromptLookup(vocab_size, tokens) if tokens > 0 else None


def _record(config: BenchConfig, mode: SamplingMode, prompt_ids: list[int],
            result: GenerationResult, seconds: float, chosen: list[int]) -> RunRecord:
    stats = result.stats
    return RunRecord(
        config.name, config.system, config.length, mode.name, "", "", 0, len(prompt_ids),
        len(result.token_ids), seconds, rounds=stats.rounds + stats.decoded_tokens,
        num_drafts=stats.num_drafts,
        draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
        draft_s=stats.draft_s, draft_forward_s=stats.draft_forward_s, verify_s=stats.verify_s,
        verify_forward_s=stats.verify_forward_s, wire_bytes=stats.wire_bytes, chosen=chosen,
        lookup_draft_tokens=stats.lookup_draft_tokens,
        lookup_accepted_tokens=stats.lookup_accepted_tokens,
        token_ids=list(result.token_ids) if mode.temperature == 0 else [])


def run_local(config: BenchConfig, mode: SamplingMode, drafter: LocalDrafter,
              verifier: LocalVerifier, prompt_ids: list[int], max_new_tokens: int,
              eos: tuple[int, ...], seed: int, costs: CostModel, max_length: int) -> RunRecord:
    """specdec.core.loop in this process: target-only (k = 0) or with the draft."""
    params = mode.params(seed)
    speculative = config.system != TARGET_ONLY
    policy = local_policy(config, costs, params.greedy, max_length) if speculative else None
    gen_config = GenerateConfig(max_new_tokens=max_new_tokens, sampling=params,
                                num_draft_tokens=0, eos_token_ids=eos,
                                draft_confidence=draft_confidence(config),
                                num_alternatives=alternatives(config),
                                max_alternative_depth=config.alternative_depth,
                                prompt_lookup=prompt_lookup(
                                    config, verifier.runner.vocab.target_vocab_size)
                                if speculative else None)
    started = time.perf_counter()
    result = generate(drafter if speculative else None, verifier, prompt_ids, gen_config,
                      policy=policy)
    seconds = time.perf_counter() - started
    chosen = list(getattr(policy, "chosen", []))
    return _record(config, mode, prompt_ids, result, seconds, chosen)


def grpc_request(config: BenchConfig, mode: SamplingMode, prompt_ids: list[int],
                 max_new_tokens: int, seed: int, max_length: int = 8,
                 cache_salt: str = "") -> Any:
    from specdec.proto.specdec.v1 import coordinator_pb2
    from specdec.serving import wire

    request = coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens,
        sampling=wire.sampling_to_proto(mode.params(seed)), cache_salt=cache_salt)
    adaptive = config.policy == "adaptive"
    if config.policy == "confident":
        request.speculation.num_draft_tokens = max_length
    else:
        request.speculation.num_draft_tokens = ADAPTIVE_START if adaptive else (
            config.fixed_length or 0)
    request.speculation.adaptive = adaptive
    request.speculation.draft_confidence = draft_confidence(config)
    if config.alternatives is not None:
        request.speculation.num_alternatives = config.alternatives
    request.speculation.max_alternative_depth = config.alternative_depth
    if config.lookup_tokens is not None:
        request.speculation.prompt_lookup_tokens = config.lookup_tokens
    if config.suffix_tokens is not None:
        request.speculation.suffix_tokens = config.suffix_tokens
    return request


def run_grpc(config: BenchConfig, mode: SamplingMode, stub: Any, prompt_ids: list[int],
             max_new_tokens: int, seed: int, timeout_s: float = 900.0,
             max_length: int = 8, cache_salt: str = "") -> RunRecord:
    """One Coordinator.Generate call against the three running services. cache_salt: the
    suffix cache partition the request proposes from and adds its answer to."""
    request = grpc_request(config, mode, prompt_ids, max_new_tokens, seed, max_length,
                           cache_salt)
    started = time.perf_counter()
    response = stub.Generate(request, timeout=timeout_s)
    seconds = time.perf_counter() - started
    stats = response.stats
    return RunRecord(
        config.name, config.system, config.length, mode.name, "", "", 0, len(prompt_ids),
        len(response.token_ids), seconds, rounds=stats.rounds + stats.decoded_tokens,
        num_drafts=stats.num_drafts,
        draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
        draft_s=stats.draft_seconds, draft_forward_s=stats.draft_forward_seconds,
        verify_s=stats.verify_seconds, verify_forward_s=stats.verify_forward_seconds,
        wire_bytes=stats.wire_bytes, lookup_draft_tokens=stats.lookup_draft_tokens,
        lookup_accepted_tokens=stats.lookup_accepted_tokens,
        token_ids=list(response.token_ids) if mode.temperature == 0 else [])
