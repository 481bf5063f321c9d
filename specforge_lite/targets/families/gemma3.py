"""Gemma 3 (``gemma3_text``, and the ``gemma3`` multimodal wrapper for 4B and up).

Quirks: the embedding module multiplies by sqrt(hidden) (the servers hand the draft the raw table and
do a plain lookup, so the draft takes ``embed_tokens.weight`` unscaled); RMSNorm scales by (1 + w);
four norms per layer; 5 sliding : 1 full attention layers with a rope base per layer type; tied head;
optional final logit softcapping. Base checkpoints ship no chat template: the Gemma turn format below
is used then.
"""

from __future__ import annotations

from typing import Any

from .base import TargetFamily

# Gemma's documented turn format: system text is folded into the first user turn; the model's turns
# are labelled "model" and end with <end_of_turn>.
GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- set sys = '' -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set sys = m['content'] ~ '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\n' }}"
    "{{- (sys if loop.index0 == 1 and messages[0]['role'] == 'system' else '') ~ m['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class Gemma3Family(TargetFamily):
    name = "gemma3"
    lean_forward = "gemma3"
    fallback_chat_template = GEMMA_TURNS

    def logit_softcap(self, config: Any) -> float | None:
        return getattr(self.text_config(config), "final_logit_softcapping", None)
