"""``target.backend=lean``: our own lean forward for the families that have one.

It reads the same HF weights in place (the HF modules own them) and differs from the HF modules in
what it computes, not in the result:
- a right-padded batch is unpadded into one row, so no matmul runs on pad tokens;
- attention is plain causal per sequence (no [T, T] mask on full layers), no KV cache, no output objects;
- ``layers_to_output_hidden_states`` keeps only the requested states and the final-norm state.
Families without a lean forward (``TargetFamily.lean_forward is None``; their presets say so) run the
HF modules. The continuous-batching answer generator (decode.py) runs the same layer code over a KV cache.
"""

from __future__ import annotations

from .gemma3 import Gemma3LeanForward
from .llama import LlamaLeanForward

LEAN_FORWARDS = {"llama": LlamaLeanForward, "gemma3": Gemma3LeanForward}


def build_lean_forward(family, model):
    """The family's lean forward over ``model``'s weights (in place), or None if the family has none."""
    impl = LEAN_FORWARDS.get(family.lean_forward or "")
    return impl(family, model) if impl else None


__all__ = ["LEAN_FORWARDS", "build_lean_forward"]
