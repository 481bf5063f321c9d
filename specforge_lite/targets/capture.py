"""THE capture convention: which tensor "aux layer i" is. Every backend, store and exporter uses this.

For a target with L decoder layers:

* aux id ``i`` with ``0 <= i < L`` is the residual stream **entering** decoder layer ``i``
  (equivalently the output of layer ``i - 1``; id 0 is the embedding output as the layers see it);
* aux id ``L`` is the last layer's output **before** the final norm.

This is the tensor vLLM and SGLang hand the draft at serving time (a forward pre-hook on
``layers[i]``), so a draft trained on it sees at serving time exactly what it saw in training. It is
*not* HF's ``output_hidden_states[i]`` in every family: that list's last entry is post-norm, and for
Qwen3-VL the entries are taken before the deepstack injection. Server-specific id conventions
(SGLang's "+1") are translated in the exporters only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

CONVENTION = "input_of_layer"  # recorded in exports, checkpoints and stores
CONVENTION_DOC = "aux id i = residual stream entering decoder layer i; id num_layers = pre-final-norm output"


class AuxIdsOutOfRange(ValueError):
    """Aux ids past the target's layers (``num_layers``): set for another target, or a draft made for one."""

    def __init__(self, num_layers: int, message: str):
        super().__init__(message)
        self.num_layers = num_layers


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE3 reference's choice, which vLLM and SGLang also fall back to: [2, L//2, L-3]."""
    if num_layers < 4:
        raise ValueError(
            f"the target has {num_layers} decoder layers; the default aux ids [2, L//2, L-3] need at least 4. "
            "Set draft.aux_layer_ids explicitly."
        )
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """Validate configured ids (or derive the default) against the target's layer count."""
    if ids is None or len(ids) == 0:
        return default_aux_layer_ids(num_layers)
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise AuxIdsOutOfRange(num_layers,
            f"draft.aux_layer_ids {ids}: {bad} out of range for a target with {num_layers} layers. "
            f"Valid ids are 0..{num_layers} ({CONVENTION_DOC}); e.g. draft.aux_layer_ids="
            f"{default_aux_layer_ids(num_layers) if num_layers >= 4 else [0, num_layers]}"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"draft.aux_layer_ids {ids} repeats an id; each aux state must be a different layer")
    if ids != sorted(ids):
        raise ValueError(f"draft.aux_layer_ids {ids} are not in ascending order: vLLM and SGLang capture the aux "
                         "states in layer order and concatenate them that way, so a draft trained in another order "
                         f"reads its fc columns permuted when served. Use draft.aux_layer_ids={sorted(ids)}")
    return ids


def _hidden_from_call(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise RuntimeError("could not find the hidden states in a decoder layer call (positional or hidden_states=)")


class AuxCapture:
    """Forward pre-hooks that keep only the configured aux states during a target forward.

    ``layers`` are the decoder layers and ``final_norm`` the norm applied after the last one. The hooks
    are registered once and record only inside ``with capture.recording():``.
    """

    def __init__(self, layers: Sequence[nn.Module], final_norm: nn.Module, aux_layer_ids: Sequence[int]):
        self.num_layers = len(layers)
        self.aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, self.num_layers)
        self._states: dict[int, torch.Tensor] = {}
        self._active = False
        self._handles = []
        for layer_id in self.aux_layer_ids:
            module = final_norm if layer_id == self.num_layers else layers[layer_id]
            self._handles.append(module.register_forward_pre_hook(self._make_hook(layer_id), with_kwargs=True))

    def _make_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            if self._active:
                self._states[layer_id] = _hidden_from_call(args, kwargs)
            return None

        return hook

    @contextmanager
    def recording(self) -> Iterator[dict[int, torch.Tensor]]:
        self._states = {}
        self._active = True
        try:
            yield self._states
        finally:
            self._active = False

    def collect(self, states: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        missing = [i for i in self.aux_layer_ids if i not in states]
        if missing:
            raise RuntimeError(f"aux layers {missing} were not reached in the forward pass")
        return [states[i] for i in self.aux_layer_ids]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
