"""The Backend interface: load a target and a draft for one device and dtype."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specdec.engine.draft_precision import Choice as DraftChoice
from specdec.engine.models import LoadedModel

__all__ = ["Backend", "DraftChoice"]


class Backend(ABC):
    name: str

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def configure_process(self) -> None:  # noqa: B027  (optional: most backends set nothing)
        """Process-wide settings (threads); called once, before the first load."""

    @abstractmethod
    def load(self, name_or_path: str, *, progress: bool = False,
             target_model: str = "") -> LoadedModel:
        """A model in this backend's dtype and kernels (the target, or any model);
        target_model: the target a draft drafts for (models.load_pretrained)."""

    @abstractmethod
    def load_draft(self, name_or_path: str, *, target_vocab_size: int | None,
                   progress: bool = False, target_model: str = "") -> DraftChoice:
        """The draft, in the precision this backend chooses for it."""

    def describe(self) -> str:
        return f"{self.name} backend on {self.device}, {str(self.dtype).removeprefix('torch.')}"
