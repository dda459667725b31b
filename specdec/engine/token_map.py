"""A reduced-vocabulary draft's `token_map.json`: the target id of each draft row.

The file is `{"target_ids": [...]}`, row i of the draft standing for target id
target_ids[i]; the row after the last (the UNK input row) stands for every other target id.
A draft without the file shares the target's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

TOKEN_MAP_FILE = "token_map.json"


def has_token_map(folder: Path) -> bool:
    return (folder / TOKEN_MAP_FILE).exists()


def read_token_map(folder: Path) -> list[int]:
    """The draft rows' target ids; FileNotFoundError where the folder has no map."""
    return [int(i) for i in json.loads((folder / TOKEN_MAP_FILE).read_text())["target_ids"]]


def write_token_map(folder: Path, target_ids: Sequence[int]) -> None:
    (folder / TOKEN_MAP_FILE).write_text(json.dumps({"target_ids": list(target_ids)}))


def input_rows(target_ids: Sequence[int] | torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Target id -> the draft's input row, for every id of the target's vocabulary: row i
    for target_ids[i], the UNK row (len(target_ids)) for the rest."""
    ids = torch.as_tensor(target_ids, dtype=torch.long)
    if ids.numel() and (int(ids.max()) >= target_vocab_size or int(ids.min()) < 0):
        raise ValueError("token_map names ids outside the target vocabulary")
    rows = torch.full((target_vocab_size,), ids.shape[0], dtype=torch.long)
    rows[ids] = torch.arange(ids.shape[0])
    return rows
