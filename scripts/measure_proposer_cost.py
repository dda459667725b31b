"""What prompt lookup and a request's own suffix tree cost the coordinator per round.

Both run in the coordinator's Python, once per round of every adaptive request, before the
round's calls. For histories of several lengths (the repetition workload's prompts, encoded
and repeated, with a seeded 5 % of the tokens replaced so that the text is not periodic),
it times the first round (which indexes the history: a request's prompt) and then the
mean of --rounds rounds that each commit 3 more tokens, and reports the request tree's
size, with the default SPECDEC_SUFFIX_PROMPT_TOKENS and without a limit (0):

    .venv/bin/python scripts/measure_proposer_cost.py --lengths 500,2000,8000,32000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.prompts import prompt_encoder  # noqa: E402
from specdec.bench.workloads import repetition_prompts  # noqa: E402
from specdec.core.history import TokenHistory  # noqa: E402
from specdec.core.prompt_lookup import PromptLookup  # noqa: E402
from specdec.core.sampling import SamplingParams  # noqa: E402
from specdec.core.suffix_proposer import SuffixProposer  # noqa: E402
from specdec.engine.models import load_tokenizer  # noqa: E402
from specdec.settings import default  # noqa: E402

COMMITTED_PER_ROUND = 3


def history_of(length: int, text: list[int], vocab_size: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    tokens = (text * (length // len(text) + 1))[:length]
    return [rng.randrange(vocab_size) if rng.random() < 0.05 else token for token in tokens]


def timed(propose: Callable[[TokenHistory], object], tokens: list[int], length: int,
          rounds: int) -> tuple[float, float]:
    """(ms of the first round over tokens[:length], mean ms of the rounds after it, each
    committing COMMITTED_PER_ROUND more tokens)."""
    history = TokenHistory(tokens[:length])
    started = time.perf_counter()
    propose(history)
    first = 1000.0 * (time.perf_counter() - started)
    started = time.perf_counter()
    for round_index in range(rounds):
        start = length + COMMITTED_PER_ROUND * round_index
        history.extend(tokens[start:start + COMMITTED_PER_ROUND])
        propose(history)
    return first, 1000.0 * (time.perf_counter() - started) / rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="500,2000,8000,32000",
                        help="history lengths in tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--target-model", default="smollm2-135m-instruct",
                        help="whose tokenizer encodes the text")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.target_model)
    encode = prompt_encoder(tokenizer)
    text = [token for prompt in repetition_prompts() for token in encode(prompt)]
    vocab_size = len(tokenizer)
    params = SamplingParams()
    print(f"{len(text)} tokens of repetition-workload prompts, repeated; "
          f"{COMMITTED_PER_ROUND} tokens committed a round, {args.rounds} rounds\n")
    limit = default("suffix-prompt-tokens")
    print(f"| history tokens | lookup: first round ms | lookup: ms a round | suffix, limit "
          f"{limit}: first round ms, MiB | ms a round | suffix, no limit: first round ms, "
          "MiB | ms a round |")
    print("|---|---|---|---|---|---|---|")
    for length in (int(value) for value in args.lengths.split(",")):
        tokens = history_of(length + COMMITTED_PER_ROUND * args.rounds, text, vocab_size)
        lookup = PromptLookup(vocab_size)
        first, per_round = timed(partial(lookup.propose, limit=16, params=params,
                                         index=lookup.index()), tokens, length, args.rounds)
        cells = [f"{first:.1f}", f"{per_round:.3f}"]
        for prompt_tokens in (limit, 0):
            suffix = SuffixProposer(vocab_size, max_tokens=16, prompt_tokens=prompt_tokens)
            first, per_round = timed(partial(suffix.draft, limit=16), tokens, length,
                                     args.rounds)
            cells += [f"{first:.0f}, {suffix.tree.bytes / 2**20:.1f}", f"{per_round:.3f}"]
        print(f"| {length} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
