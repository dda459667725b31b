"""Map a model's output rows onto the target vocabulary.

Two cases keep speculative decoding exact when draft and target vocabularies differ:
- padding rows (a model whose embedding matrix is larger than the tokenizer): only the
  shared range is used, so the draft never proposes a token the target cannot emit;
- a reduced-vocabulary draft (token_map: draft row -> target id, plus an UNK input row):
  q is 0 outside the mapped ids, which min(1, p/q) and max(0, p - q) handle exactly.
"""

from __future__ import annotations

import torch

from specdec.engine.token_map import input_rows


class VocabAdapter:
    def __init__(self, model_rows: int, target_vocab_size: int,
                 token_map: torch.Tensor | None = None, map_inputs: bool = True) -> None:
        """map_inputs: whether the model's inputs are draft ids too (an UNK row for the
        target ids outside the map); False for a model that embeds target ids (EAGLE-3),
        whose token_map names its output rows only."""
        self.target_vocab_size = target_vocab_size
        self.token_map = token_map
        if token_map is None:
            self.usable_rows = min(model_rows, target_vocab_size)
            self._input_map: torch.Tensor | None = None
        else:
            rows = input_rows(token_map, target_vocab_size)  # checks the ids
            # Rows beyond the map (the UNK input row, padding) are never proposed.
            self.usable_rows = token_map.shape[0]
            self._input_map = None
            if not map_inputs:
                return
            unk_row = token_map.shape[0]
            if model_rows <= unk_row:
                raise ValueError(f"reduced-vocab draft needs an UNK row at {unk_row}")
            self._input_map = rows

    def to_model_inputs(self, target_ids: torch.Tensor) -> torch.Tensor:
        if self._input_map is None:
            return target_ids
        return self._input_map.to(target_ids.device)[target_ids]

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the rows that correspond to target tokens (model space)."""
        return logits[..., : self.usable_rows]

    def model_to_target_ids(self, model_ids: torch.Tensor) -> torch.Tensor:
        if self.token_map is None:
            return model_ids
        return self.token_map.to(model_ids.device)[model_ids]

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Dense [N, target_vocab] probabilities from [N, usable_rows] model-space ones."""
        dense = probs.new_zeros(probs.shape[0], self.target_vocab_size)
        if self.token_map is None:
            dense[:, : self.usable_rows] = probs
        else:
            dense[:, self.token_map.to(probs.device)] = probs
        return dense
