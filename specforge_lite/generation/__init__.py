"""Generation by the target: the engines that write its answers (engines.py: lean continuous batching, transformers'
generate, a serving engine's OpenAI endpoint) and the generator a run builds on first use (lazy.py)."""

from .engines import HFGenerator, LeanAnswers, ServedAnswers, encode_prompt
from .lazy import GENERATION_ENGINES, LazyGenerator, lean_decoder, stop_ids

__all__ = ["GENERATION_ENGINES", "HFGenerator", "LazyGenerator", "LeanAnswers", "ServedAnswers", "encode_prompt",
           "lean_decoder", "stop_ids"]
