"""A reduced-vocabulary draft's `token_map.json`: the target id of each draft row.

The file is `{"target_ids": [...]}`, row i of the draft standing for target id
target_ids[i]; the row after the last (the UNK input row) stands for every other target id.
A draft without the file shares the target's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

TOKEN_MAP_FILE = "token_map.json"


def has_token_map(folder: Path) -> bool:
    return (folder / TOKEN_MAP_FILE).exists()


def read_token_map(folder: Path) -> list[int]:
    """The draft rows' target ids; FileNotFoundError where the folder has no map."""
    return [int(i) for i in json.loads((folder / TOKEN_MAP_FILE).read_text())["target_ids"]]


def write_token_map(folder: Path, target_ids: Sequence[int]) -> None:
    (folder / TOKEN_MAP_FILE).write_text(json.dumps({"target_ids": list(target_ids)}))
