"""Generation by the target: the engines that write its answers (engines.py: lean continuous batching, transformers'
generate, a serving engine's OpenAI endpoint), the generator a run builds on first use (lazy.py), and the data
stage with the target as its writer (prepare.py)."""

from .engines import HFGenerator, LeanAnswers, ServedAnswers, encode_prompt
from .lazy import LazyGenerator, lean_decoder, stop_ids
from .prepare import prepare_with_target, vllm_server

__all__ = ["HFGenerator", "LazyGenerator", "LeanAnswers", "ServedAnswers", "encode_prompt",
           "lean_decoder", "prepare_with_target", "stop_ids", "vllm_server"]
