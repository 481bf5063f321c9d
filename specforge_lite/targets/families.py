"""Family quirks, one class per family, looked up by ``model.family``.

The spine ships the plain decoder-only layout (Llama, Qwen2/3, Phi-3, SmolLM, ...). A family with a
quirk (Gemma's scaled embedding and softcapped logits, Qwen3-VL's deepstack, hybrid linear attention)
gets its own subclass in its own module and registers it here; the trainer never branches on family.
"""

from __future__ import annotations

import torch
from torch import nn


class TargetFamily:
    """How to find the parts of an HF causal LM that capture and the teacher need."""

    name = "llama"

    def decoder(self, model: nn.Module) -> nn.Module:
        """The module that runs embeddings -> layers -> final norm and returns the post-norm state."""
        return model.model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.decoder(model).layers

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).norm

    def embedding(self, model: nn.Module) -> nn.Embedding:
        return model.get_input_embeddings()

    def lm_head_weight(self, model: nn.Module) -> torch.Tensor:
        return model.get_output_embeddings().weight

    def lm_head_bias(self, model: nn.Module) -> torch.Tensor | None:
        return getattr(model.get_output_embeddings(), "bias", None)

    def postprocess_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Elementwise transform of raw logits (identity; Gemma softcaps). Safe on a vocab subset."""
        return logits


FAMILIES: dict[str, TargetFamily] = {f.name: f for f in [TargetFamily()]}
# Architectures that share the plain layout use the same class.
for _alias in ("qwen2", "qwen3", "phi3", "mistral", "smollm"):
    FAMILIES[_alias] = FAMILIES["llama"]


def get_family(name: str) -> TargetFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family={name!r} is not known; known families: {sorted(FAMILIES)}") from None
