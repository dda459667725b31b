"""The torch backend: transformers' stock kernels in the configured dtype (CUDA, and any
device without a tuned backend)."""

from __future__ import annotations

from specdec.engine.backends.base import Backend, DraftChoice
from specdec.engine.draft_precision import Precision
from specdec.engine.models import LoadedModel, load_pretrained


class TorchBackend(Backend):
    name = "torch"

    def load(self, name_or_path: str, *, progress: bool = False,
             target_model: str = "") -> LoadedModel:
        return load_pretrained(name_or_path, self.device, self.dtype, progress, target_model)

    def load_draft(self, name_or_path: str, *, target_vocab_size: int | None,
                   progress: bool = False, target_model: str = "") -> DraftChoice:
        return DraftChoice(self.load(name_or_path, progress=progress,
                                     target_model=target_model),
                           Precision(self.dtype, "torch"), {})
