"""specforge_lite: train EAGLE3 speculative-decoding drafts that SGLang, vLLM and speculators load as they are.

Stages (data flows one way): config -> data -> targets (capture) -> draft -> training -> export / evaluate.
"""

__version__ = "0.1.0"
