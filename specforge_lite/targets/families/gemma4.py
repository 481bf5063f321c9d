"""Gemma 4 (``gemma4_text``; E2B/E4B/31B dense, 26B-A4B MoE, inside the ``gemma4`` multimodal wrapper).

Quirks handled here and in the shared base:
- Final logits are softcapped (30.0 in every variant): the teacher applies ``tanh(z / 30) * 30`` to the
  draft-vocabulary rows only; softcapping is elementwise, so this equals slicing the full softcapped
  logits, and the 262k vocabulary is never materialised per token.
- Per-layer embeddings (PLE) are computed from ``input_ids`` inside the text model, so capture runs the
  text model on input_ids (never inputs_embeds).
- KV-shared layers reuse earlier layers' keys/values; with ``logits_to_keep`` (as in generate) later
  layers would see only the last position, so capture is a plain full forward with no cache.
- The embedding module scales by sqrt(hidden); the draft takes the raw table like SGLang/vLLM.
The lean backend has no Gemma 4 forward: ``target.backend=lean`` runs the HF modules (said in the preset).
"""

from __future__ import annotations

from typing import Any

from .base import TargetFamily
from .gemma3 import GEMMA_TURNS


class Gemma4Family(TargetFamily):
    name = "gemma4"
    fallback_chat_template = GEMMA_TURNS

    def logit_softcap(self, config: Any) -> float | None:
        # 30.0 in every released variant; read from the config so the teacher matches the model exactly.
        return getattr(self.text_config(config), "final_logit_softcapping", None)
