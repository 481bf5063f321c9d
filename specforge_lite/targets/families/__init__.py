"""Family quirks, one module per family, looked up by ``model.family``.

``model.family`` names a family (or an alias: architectures that share a family's layout). Adding a
family means a module here with a TargetFamily subclass and a line in ``FAMILIES``.
"""

from __future__ import annotations

from .base import TargetFamily
from .gemma3 import Gemma3Family
from .gemma4 import Gemma4Family
from .hybrid import HybridLinearAttentionFamily
from .llama import LlamaFamily
from .moe import Llama4Family, MoEFamily
from .qwen3_vl import Qwen3VLFamily

_llama, _moe, _hybrid = LlamaFamily(), MoEFamily(), HybridLinearAttentionFamily()
FAMILIES: dict[str, TargetFamily] = {
    # plain layout
    "llama": _llama, "llama3": _llama, "mistral": _llama, "qwen2": _llama, "qwen2_5": _llama, "qwen3": _llama,
    "phi3": _llama, "phi4": _llama, "smollm": _llama,
    # Gemma
    "gemma3": Gemma3Family(), "gemma4": Gemma4Family(),
    # mixture of experts
    "qwen3_moe": _moe, "gpt_oss": _moe, "llama4": Llama4Family(),
    # vision-language
    "qwen3_vl": Qwen3VLFamily(),
    # hybrid linear attention
    "qwen3_next": _hybrid, "qwen3_5": _hybrid,
}


def get_family(name: str) -> TargetFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family={name!r} is not known; known families: {sorted(FAMILIES)}") from None


__all__ = ["FAMILIES", "TargetFamily", "get_family"]
