"""Mixture-of-experts families: Qwen3-MoE (``qwen3_moe``), GPT-OSS (``gpt_oss``), Llama 4 text
(``llama4_text``).

Routing happens inside each decoder layer, after the residual stream that capture reads enters it, and
the HF implementations route every token independently (no capacity limit, no token dropping), so a
sample's captured states do not depend on its batch companions (tested). GPT-OSS attends with learned
sinks and needs ``attn_implementation: eager`` (its presets set it); its chat format is Harmony, and its
loss mask comes from the tokenizer's Harmony template like any other (a historical turn is rendered
differently from the last one, which data/chat.py handles by taking such turns one at a time).
Llama 4 interleaves chunked-attention and NoPE full-attention layers inside the HF modules.
No lean forward: ``target.backend=lean`` runs the HF modules for these.
"""

from __future__ import annotations

from .base import TargetFamily


class MoEFamily(TargetFamily):
    name = "moe"


class Llama4Family(MoEFamily):
    """Llama 4's multimodal wrapper nests a whole causal LM: ``model.language_model.model`` is the decoder."""

    name = "llama4"

    def decoder(self, model):
        lm = getattr(model, "language_model", None)
        if lm is not None and hasattr(lm, "model"):
            return lm.model
        return super().decoder(model)
