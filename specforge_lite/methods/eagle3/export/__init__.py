"""EAGLE3's export formats: the Llama-EAGLE3 layout (its config and weight names: layout.py; the rules every server
reading it shares: check.py; the format class the others build on: llama.py) as each server reads it (vllm.py,
sglang.py), speculators' format (speculators.py), and the reading of EAGLE3 drafts another trainer wrote in
speculators' or SGLang's layout (published.py)."""

from .sglang import SGLangFormat
from .speculators import SpeculatorsFormat
from .vllm import VLLMFormat

VLLM, SGLANG, SPECULATORS = VLLMFormat(), SGLangFormat(), SpeculatorsFormat()
# what the method writes (the first: export.format=vllm), and the layouts of folders another trainer wrote that
# it reads, in the order tried: speculators' own format, else a Llama-EAGLE3 folder as SGLang (and SpecForge,
# which writes for SGLang) reads it
EXPORT_FORMATS = (VLLM, SGLANG, SPECULATORS)
PUBLISHED_FORMATS = (SPECULATORS, SGLANG)

__all__ = ["EXPORT_FORMATS", "PUBLISHED_FORMATS", "SGLangFormat", "SpeculatorsFormat", "VLLMFormat"]
