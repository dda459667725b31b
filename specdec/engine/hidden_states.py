"""Which hidden states a forward reads out, and which a draft reads in.

A target returns, per row, either its final norm's output (what a feature draft reads)
or the inputs of some of its decoder layers side by side (an EAGLE-3 draft's auxiliary
states); requests sharing one packed forward may ask for different ones, so a forward
captures the union and each request takes its own. A draft that reads such states
(`StateReader`) also returns its own output state, which it reads back for the tokens it
drafts itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.core.history import FINAL_STATE, HiddenSpec
from specdec.engine.eagle3 import Eagle3DraftForCausalLM, is_eagle3_draft
from specdec.engine.extend import ExtendRequest
from specdec.engine.feature_draft import TARGET_HIDDEN_SIZE_KEY, final_norm, is_feature_draft
from specdec.errors import InvalidRequest

FINAL = -1  # the capture key of the final norm's output (layer ids are >= 0)


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InvalidRequest(f"the target ({type(model).__name__}) has no decoder layers "
                             "named `layers` to read states from")
    return layers


def check_layers(model: PreTrainedModel, layers: Iterable[int]) -> None:
    """InvalidRequest unless every id names one of the model's decoder layers."""
    count = len(decoder_layers(model))
    bad = [layer for layer in layers if not 0 <= layer < count]
    if bad:
        raise InvalidRequest(f"hidden state layers {bad} are not among this target's "
                             f"{count} decoder layers (0..{count - 1})")


def capture_keys(requests: Sequence[ExtendRequest]) -> tuple[int, ...]:
    """The states a forward of these requests captures (Capture's keys)."""
    keys: set[int] = set()
    for request in requests:
        if request.hidden_rows:
            keys.update(request.hidden_layers or (FINAL,))
    return tuple(sorted(keys))


class Capture:
    """Hooks that keep, per key, the states of every row of one forward: FINAL (the final
    norm's output, or an EAGLE-3 draft's own output state) and decoder layer inputs.

    Hooks belong to the module and see every thread's forwards; this_thread_only keeps
    only the forwards of the thread that made the Capture (for a model that another
    thread may run at the same time)."""

    def __init__(self, model: PreTrainedModel, keys: Iterable[int],
                 this_thread_only: bool = False) -> None:
        self.states: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._owner = threading.get_ident() if this_thread_only else None
        for key in sorted(set(keys)):
            if key == FINAL and is_eagle3_draft(model):
                module, output = model.state_module()  # type: ignore[operator]
                self._hook(module, key, output)
            elif key == FINAL:
                self._hook(final_norm(model), key, True)
            else:
                self._hook(decoder_layers(model)[key], key, False)

    def _mine(self) -> bool:
        return self._owner is None or threading.get_ident() == self._owner

    def _hook(self, module: nn.Module, key: int, output: bool) -> None:
        if output:
            def keep_output(_module: nn.Module, _inputs: Any, out: Any) -> None:
                if self._mine():
                    self.states[key] = out[0] if isinstance(out, tuple) else out

            self._handles.append(module.register_forward_hook(keep_output))
        else:
            def keep_input(_module: nn.Module, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> None:
                if self._mine():
                    self.states[key] = args[0] if args else kwargs["hidden_states"]

            self._handles.append(module.register_forward_pre_hook(keep_input, with_kwargs=True))

    def rows(self, layers: tuple[int, ...], begin: int = 0, end: int | None = None
             ) -> torch.Tensor:
        """[rows, width]: the states `layers` names (none: FINAL), side by side, of the
        forward's rows begin:end."""
        parts = [self.states[key][0, begin:end] for key in (layers or (FINAL,))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True)
class StateReader:
    """How a draft reads hidden states: the target's (`spec`, rows `target_width` wide)
    and its own (`own_width` wide, already in its input space)."""

    spec: HiddenSpec
    target_width: int
    own_width: int

    def model_input(self, model: PreTrainedModel, rows: torch.Tensor, own: bool
                    ) -> torch.Tensor:
        """Rows in the model's input space: an EAGLE-3 draft fuses the target's."""
        if own or not is_eagle3_draft(model):
            return rows
        with torch.inference_mode():
            return model.fuse(rows.to(next(model.parameters()).device))  # type: ignore[operator]


def state_reader(model: PreTrainedModel) -> StateReader | None:
    """How `model` reads hidden states; None for a model that reads tokens only."""
    if isinstance(model, Eagle3DraftForCausalLM):
        settings = model.eagle3
        return StateReader(settings.hidden_spec, settings.fused_width,
                           int(model.config.hidden_size))
    if is_feature_draft(model):
        width = int(getattr(model.config, TARGET_HIDDEN_SIZE_KEY))
        return StateReader(FINAL_STATE, width, width)
    return None
