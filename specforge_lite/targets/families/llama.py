"""The plain decoder-only layout: Llama 3, Mistral, Qwen2/2.5, Qwen3 dense, Phi-3/Phi-4, SmolLM.

Their differences (Qwen2's q/k/v bias, Qwen3's per-head q/k norm, Phi-3's fused qkv and gate_up
projections, Llama 3's rope scaling) live inside the layers; capture and the teacher see the same parts,
and the lean forward in targets/lean/llama.py covers all of them.
"""

from __future__ import annotations

from .base import TargetFamily


class LlamaFamily(TargetFamily):
    name = "llama"
    lean_forward = "llama"
