"""Expected T=1 acceptance of the draft in two precisions, on the same texts.

For each bench prompt the bfloat16 target (as served) samples a T=1 continuation; at every
position of it, sum_x min(p(x), q(x)) is the chance a T=1 draft token is accepted
(REFERENCE section 2), for q from the draft in bfloat16 (oneDNN) and in float32
(`F.linear`). Same texts for both, so no sampling noise between them
(docs/benchmarks.md section 4j):

    .venv/bin/python scripts/measure_draft_precision_acceptance.py --prompts-per-category 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdec import models  # noqa: E402
from specdec.bench.prompts import chat_encoder, load_prompts, select  # noqa: E402
from specdec.runner import ModelRunner  # noqa: E402

PRECISIONS = {"bfloat16/onednn": (torch.bfloat16, "auto"),
              "float32/torch": (torch.float32, "torch")}


def target_vocab_probs(loaded: models.LoadedModel, ids: list[int],
                       target_vocab_size: int) -> torch.Tensor:
    """T=1 probabilities after every prefix of ids, in the target's vocabulary."""
    runner = ModelRunner(loaded.model, target_vocab_size=target_vocab_size,
                         token_map=loaded.token_map)
    result = runner.extend("probe", 0, 0, ids, num_logits=len(ids),
                           target_hidden=runner.placeholder_hidden(len(ids)))
    runner.release("probe")
    return runner.vocab.to_target_probs(torch.softmax(result.logits.float(), dim=-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    target = models.load_causal_lm(models.DEFAULT_TARGET, cpu, torch.bfloat16, progress=False)
    drafts = {label: models.load_causal_lm(models.DEFAULT_DRAFT, cpu, dtype, progress=False,
                                           linear_kernel=kernel)
              for label, (dtype, kernel) in PRECISIONS.items()}
    vocab = int(target.model.config.vocab_size)
    encode = chat_encoder(target.tokenizer)
    acceptance: dict[str, list[float]] = {label: [] for label in drafts}
    for prompt in select(load_prompts(), args.prompts_per_category):
        prompt_ids = encode(prompt.text)
        text = list(prompt_ids)
        generator = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for _ in range(args.new_tokens):
                logits = target.model(input_ids=torch.tensor([text])).logits[0, -1].float()
                text.append(int(torch.multinomial(torch.softmax(logits, -1), 1,
                                                  generator=generator)))
        rows = slice(len(prompt_ids) - 1, len(text) - 1)
        target_probs = target_vocab_probs(target, text, vocab)[rows]
        for label, draft in drafts.items():
            draft_probs = target_vocab_probs(draft, text, vocab)[rows]
            acceptance[label].append(
                float(torch.minimum(target_probs, draft_probs).sum(-1).mean()))
    for label, values in acceptance.items():
        print(f"{label:<16} mean expected acceptance {statistics.mean(values):.4f}  "
              f"per prompt {' '.join(f'{value:.3f}' for value in values)}")


if __name__ == "__main__":
    main()
