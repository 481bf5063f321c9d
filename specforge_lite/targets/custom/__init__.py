"""``target.backend=custom``: our own lean forward for the families that have one.

It loads the same HF weights (the HF modules own them; the lean forward reads them in place) and
differs from the HF backend in what it computes, not in the result:
- a right-padded batch is unpadded into one row, so no matmul runs on pad tokens;
- attention is plain causal per sequence (no [T, T] mask on full layers), no KV cache, no output objects;
- ``layers_to_output_hidden_states`` keeps only the requested states and the final-norm state;
- the teacher is computed over the draft vocabulary only, and only at positions that carry a loss.
Families without a lean forward (``TargetFamily.custom_forward is None``; their presets say so) run the
HF modules. Evaluation (incremental decoding with a KV cache) always runs the HF modules.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hf import Captured, HFTarget
from .gemma3 import Gemma3LeanForward
from .llama import LlamaLeanForward

LEAN_FORWARDS = {"llama": LlamaLeanForward, "gemma3": Gemma3LeanForward}


def lean_forward(family, model):
    """The family's lean forward over ``model``'s weights (in place), or None if the family has none."""
    impl = LEAN_FORWARDS.get(family.custom_forward or "")
    return impl(family.decoder(model), family.text_config(model.config)) if impl else None


class CustomTarget(HFTarget):
    backend = "custom"

    def __init__(self, model, family, aux_layer_ids, location: str = ""):
        super().__init__(model, family, aux_layer_ids, location)
        self.lean = lean_forward(family, model)

    @property
    def delegates_to_hf(self) -> bool:
        return self.lean is None

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **inputs: Any) -> Captured:
        if self.lean is None or inputs:
            return super().capture(input_ids, attention_mask, position_ids, **inputs)
        states, final = self.lean(input_ids, attention_mask, layers_to_output_hidden_states=self.aux_layer_ids,
                                  position_ids=position_ids)
        return Captured(aux=[states[i] for i in self.aux_layer_ids], final_hidden=final)

    @torch.no_grad()
    def teacher(self, final_hidden: torch.Tensor, needed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As HFTarget.teacher, but logits are computed only where ``needed`` (zeros elsewhere: never read)."""
        if needed is None:
            return super().teacher(final_hidden, needed)
        where = needed.nonzero(as_tuple=True)
        rows_logits, rows_in_vocab = self.teacher_rows(final_hidden[where])
        B, T = needed.shape
        logits = rows_logits.new_zeros(B, T, rows_logits.shape[-1])
        logits[where] = rows_logits
        in_vocab = torch.zeros(B, T, dtype=torch.bool, device=needed.device)
        in_vocab[where] = rows_in_vocab
        return logits, in_vocab


__all__ = ["CustomTarget", "LEAN_FORWARDS", "lean_forward"]
