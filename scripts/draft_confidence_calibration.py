"""How often the draft's greedy guess equals the target's, by the draft's own confidence.

Decodes the bench prompts greedily with the target, runs the draft teacher-forced along
the same text, and buckets every position by the draft's top probability: the evidence
behind the confidence gate's default (SPECDEC_DRAFT_CONFIDENCE). Also prints how often
the target's token is among the draft's m best (m = 1..8): what alternatives verified
beside the chain can add (SPECDEC_DRAFT_ALTERNATIVES); and how often prompt lookup
(specdec.core.prompt_lookup) finds a match and its first token is the target's, by category
and shortest n-gram (SPECDEC_PROMPT_LOOKUP_MIN; docs/performance.md, "What limits
them"):

    .venv/bin/python scripts/draft_confidence_calibration.py --prompts-per-category 10 \
        --max-new-tokens 96 --dtype bfloat16

    .venv/bin/python scripts/draft_confidence_calibration.py --prompts-per-category 2
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.prompts import chat_encoder, load_prompts, select  # noqa: E402
from specdec.core.prompt_lookup import DEFAULT_MAX_NGRAM, find_continuation  # noqa: E402
from specdec.engine.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_causal_lm, parse_dtype  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402

BUCKETS = [(0.0, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (0.6, 0.8), (0.8, 1.01)]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    args = parser.parse_args()
    cpu = torch.device("cpu")
    dtype = parse_dtype(args.dtype)
    target = load_causal_lm(DEFAULT_TARGET, cpu, dtype, progress=False)
    draft = load_causal_lm(args.draft_model, cpu, dtype, progress=False)
    vocab = ModelRunner(draft.model, int(target.model.config.vocab_size), draft.token_map).vocab
    encode = chat_encoder(target.tokenizer)
    generate: Any = target.model.generate
    rows: list[tuple[float, bool]] = []
    ranks: list[int] = []  # the target's token among the draft's choices, 0 = its first
    texts: list[tuple[str, int, list[int], list[int]]] = []  # for the lookup table
    for prompt in select(load_prompts(), args.prompts_per_category):
        ids = encode(prompt.text)
        out = generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                    do_sample=False, attention_mask=torch.ones(1, len(ids),
                                                                               dtype=torch.long),
                                    pad_token_id=0)[0]
        inputs = vocab.to_model_inputs(out.unsqueeze(0))
        logits = vocab.restrict(draft.model(input_ids=inputs).logits[0]).float()
        probs = torch.softmax(logits, dim=-1)
        texts.append((prompt.category, len(ids), out.tolist(),
                      vocab.model_to_target_ids(probs.argmax(-1)).tolist()))
        for position in range(len(ids) - 1, len(out) - 1):
            guess = int(vocab.model_to_target_ids(probs[position].argmax().reshape(1))[0])
            rows.append((float(probs[position].max()), guess == int(out[position + 1])))
            order = vocab.model_to_target_ids(probs[position].argsort(descending=True)[:8])
            hits = (order == out[position + 1]).nonzero()
            ranks.append(int(hits[0]) if len(hits) else 8)
    print(f"{len(rows)} positions, greedy agreement {sum(a for _, a in rows) / len(rows):.2f}")
    print("| draft confidence | positions | agreement with the target |\n|---|---|---|")
    for low, high in BUCKETS:
        bucket = [agree for confidence, agree in rows if low <= confidence < high]
        if bucket:
            print(f"| {low:.1f}-{min(high, 1.0):.1f} | {len(bucket)} | "
                  f"{sum(bucket) / len(bucket):.2f} |")
    print("\n| among the draft's m best, m = | " + " | ".join(map(str, range(1, 9))) + " |")
    print("|---" * 9 + "|")
    print("| share of positions | " + " | ".join(
        f"{sum(rank < m for rank in ranks) / len(ranks):.3f}" for m in range(1, 9)) + " |")
    print_lookup_table(texts)


def print_lookup_table(texts: list[tuple[str, int, list[int], list[int]]]) -> None:
    """texts: (category, prompt length, prompt + greedy tokens, the draft's guess after
    each position)."""
    print("\n| shortest n-gram | category | positions | draft right | lookup proposes | "
          "its first token right | lookup right where the draft is wrong |")
    print("|---" * 7 + "|")
    for min_ngram in (1, 2, 3):
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        for category, prompt_len, tokens, guesses in texts:
            for position in range(prompt_len, len(tokens)):
                proposal = find_continuation(tokens[:position], 1, min_ngram, DEFAULT_MAX_NGRAM)
                draft_right = guesses[position - 1] == tokens[position]
                lookup_right = bool(proposal) and proposal[0] == tokens[position]
                for key in (category, "all"):
                    row = counts[key]
                    row[0] += 1
                    row[1] += draft_right
                    row[2] += bool(proposal)
                    row[3] += lookup_right
                    row[4] += lookup_right and not draft_right
        for key, (positions, draft, has, right, gain) in sorted(counts.items()):
            print(f"| {min_ngram} | {key} | {positions} | {draft / positions:.3f} | "
                  f"{has / positions:.3f} | {right / max(1, has):.3f} | {gain / positions:.3f} |")


if __name__ == "__main__":
    main()
