"""DSpark's settings (draft=dspark): a block draft's (methods/dflash/settings.py ``BlockSettings``; every slot of
its block predicts a token) and its two heads'. Its token loss is its own (0.1 x soft_ce + 0.9 x tv)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..dflash.settings import BlockSettings


@dataclass
class DSparkSettings(BlockSettings):
    anchor_slots: ClassVar[int] = 0
    ranges: ClassVar[dict[str, str]] = {"block_size": "[1, inf)"}
    method: str = "dspark"
    # Positions per block (speculators' and vLLM's block_size): the next token and k - 1 mask slots, each slot
    # predicting the token after it, served at k = block_size (eval.num_draft_tokens' 3 by default)
    block_size: int = 3
    # the rank of the Markov head's previous-token embedding (target vocab x rank, rank x draft vocab;
    # speculators' default 256 is sized for 100k+ vocabularies and hidden sizes of thousands)
    markov_rank: int = 64
    confidence_weight: float = 1.0  # the confidence head's BCE weight beside the token loss (speculators: 1)
