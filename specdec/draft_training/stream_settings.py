"""The settings of a streaming self-distillation run (stream.py), importable without
torch so the command line reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.settings import default

# What writes the text the target labels (producers.py): the draft (the target scores
# it in one forward) or the target itself, decoding with transformers' generate or with
# the project's batched runner; or batches in turn from the draft and from generate.
PRODUCERS = ("draft-written", "target-generate", "target-runner", "mix")
# The draft a run trains: a token-only draft (train.py) or an EAGLE-3 draft that reads the
# target's layer states (eagle3_train.py; its producer is target-generate).
DRAFT_KINDS = ("token", "eagle3")


@dataclass(frozen=True)
class StreamSettings:
    """One streaming run. The command's flags take their defaults from here."""

    time_budget_s: float = 30 * 60.0
    # PRODUCERS; the target writes: training on the draft's own text lowers acceptance
    # on the target's (docs/models.md)
    producer: str = "target-generate"
    train_batch: int = 16  # records per optimiser step
    produce_batch: int = 16  # contexts asked of the source per producer call
    max_new_tokens: int = 128
    top_k: int = 16
    lr: float = 1e-4  # peak; warm-up, then cosine over the time budget to a tenth
    queue_size: int = 64  # records
    passes: int = 3  # times the trainer may use one record
    checkpoint_every_s: float = 240.0
    progress_every_s: float = 30.0
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)  # of successive producer batches
    held_out_prompts: int = 32  # of each held-out set (heldout.held_out_sets)
    held_out_tokens: int = 64
    max_context: int = 384
    seed: int = 0
    device: str = default("device")  # the target, the draft and the trainer (cuda on a GPU)
    draft_kind: str = "token"  # DRAFT_KINDS
    ttt_steps: int = 4  # EAGLE-3: drafted steps each training-time test runs
    # Weights of the context kinds (stream_prompts.KINDS): prompt-set, magpie, multi-turn.
    # Per unit of weight, the labelled tokens the committed draft's card reports (63/26/11 %
    # at weights 0.4/0.4/0.2) come to 1.6 : 0.65 : 0.55 for the three kinds: prompt-set
    # answers run longer. These weights therefore expect about 69 % of the labelled tokens
    # from user-like contexts (magpie + multi-turn), and over half as long as the source
    # keeps more than half as many of its written turns as that run did.
    mix: tuple[float, float, float] = (0.15, 0.55, 0.30)
