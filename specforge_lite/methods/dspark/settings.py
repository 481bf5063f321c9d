"""DSpark's settings (draft=dspark): the shared ones (config.py ``DraftSettings``; ttt_length is the tokens per
block) and its two heads'. Its token loss is its own (0.1 x soft_ce + 0.9 x tv)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import DraftSettings


@dataclass
class DSparkSettings(DraftSettings):
    method: str = "dspark"
    # the rank of the Markov head's previous-token embedding (target vocab x rank, rank x draft vocab;
    # speculators' default 256 is sized for 100k+ vocabularies and hidden sizes of thousands)
    markov_rank: int = 64
    confidence_weight: float = 1.0  # the confidence head's BCE weight beside the token loss (speculators: 1)
