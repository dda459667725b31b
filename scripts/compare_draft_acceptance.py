"""Greedy acceptance of several drafts on the bench prompts, on the same target text.

The bfloat16 target decodes each bench prompt greedily (transformers' `generate`); each
draft then reads that text once. Under greedy verification a draft token is accepted
exactly when the draft's argmax after the committed text equals the target's next token,
so the share of positions where they agree is the draft's per-token acceptance alpha at
T=0, free of timing noise. The same pass gives the expected T=1 acceptance sum_x min(p(x), q(x))
along that text (docs/design.md, "The exactness contract"). Drafts run in float32 with
`F.linear`, one of the precisions the draft service chooses from (docs/configuration.md,
SPECDEC_DRAFT_DTYPE). The target runs transformers' bfloat16 kernels, not the served
row-invariant ones, so its text can leave the served greedy text at a near-tie; every
draft reads the same text:

    .venv/bin/python scripts/compare_draft_acceptance.py specdec-draft /path/to/new-draft
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdec.bench.prompts import chat_encoder, load_prompts, select  # noqa: E402
from specdec.engine import models  # noqa: E402
from specdec.engine.vocab import VocabAdapter  # noqa: E402


def teacher_forced_probs(loaded: models.LoadedModel, ids: list[int],
                         target_vocab_size: int) -> torch.Tensor:
    """T=1 probabilities after every prefix of ids, in the target's vocabulary, from one
    plain forward (no KV cache: rounding differs slightly from served decoding, the same
    way for every draft)."""
    vocab = VocabAdapter(int(loaded.model.config.vocab_size), target_vocab_size,
                         loaded.token_map)
    inputs = vocab.to_model_inputs(torch.tensor([ids]))
    with torch.inference_mode():
        logits = vocab.restrict(loaded.model(input_ids=inputs).logits[0]).float()
    return vocab.to_target_probs(torch.softmax(logits, dim=-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafts", nargs="+", help="draft names or folders")
    parser.add_argument("--prompts-per-category", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    # transformers' own kernels: the row-invariant decode kernels are slow for whole-text
    # forwards, and the comparison needs the same text for every draft, not the served bits.
    target = models.load_causal_lm(models.DEFAULT_TARGET, cpu, torch.bfloat16, progress=False,
                                   linear_kernel="torch", attention_kernel="sdpa")
    drafts = {name: models.load_causal_lm(name, cpu, torch.float32, progress=False,
                                          linear_kernel="torch", attention_kernel="sdpa")
              for name in args.drafts}
    vocab = int(target.model.config.vocab_size)
    assert target.tokenizer is not None
    encode = chat_encoder(target.tokenizer)
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # [draft][category] -> (greedy matches, positions, summed T=1 acceptance)
    totals: dict[str, dict[str, list[float]]] = {
        name: defaultdict(lambda: [0.0, 0.0, 0.0]) for name in drafts}
    for prompt in select(load_prompts(), args.prompts_per_category):
        prompt_ids = encode(prompt.text)
        with torch.inference_mode():
            out = target.model.generate(  # type: ignore[operator]  # transformers' stub
                torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=args.new_tokens,
                eos_token_id=eos, pad_token_id=eos)
        text = out[0].tolist()
        rows = slice(len(prompt_ids) - 1, len(text) - 1)
        following = torch.tensor(text[len(prompt_ids):])
        target_probs = teacher_forced_probs(target, text, vocab)[rows]
        for name, draft in drafts.items():
            draft_probs = teacher_forced_probs(draft, text, vocab)[rows]
            entry = totals[name][prompt.category]
            entry[0] += float((draft_probs.argmax(-1) == following).sum())
            entry[1] += len(following)
            entry[2] += float(torch.minimum(target_probs, draft_probs).sum(-1).sum())
    categories = sorted(next(iter(totals.values())))
    print("| draft | alpha T=0, all | " + " | ".join(categories)
          + " | expected T=1 acceptance on the same text |")
    print("|---|---|" + "---|" * len(categories) + "---|")
    for name, by_category in totals.items():
        matches = sum(e[0] for e in by_category.values())
        positions = sum(e[1] for e in by_category.values())
        soft = sum(e[2] for e in by_category.values())
        cells = " | ".join(f"{by_category[c][0] / by_category[c][1]:.3f}" for c in categories)
        print(f"| {name} | {matches / positions:.4f} ({int(positions)} positions) | {cells} | "
              f"{soft / positions:.4f} |")


if __name__ == "__main__":
    main()
