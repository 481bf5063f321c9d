"""DFlash's settings (draft=dflash): the shared ones (config.py ``DraftSettings``), the block every block draft
(DFlash, DSpark, DFlash 2) has (``BlockSettings``), and its token loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import DraftSettings, TokenLoss


@dataclass
class BlockSettings(DraftSettings):
    """The settings of a block draft: the shared ones and its block, the draft's input (a block of another size is
    another input), so the draft is served at the one k its block gives (``draft_tokens``)."""

    # the positions of a block that predict no token (DFlash's: the next token's own slot)
    anchor_slots: ClassVar[int] = 1
    ranges: ClassVar[dict[str, str]] = {"block_size": "[2, inf)"}
    # Positions per block (speculators' and vLLM's block_size): the next token and k mask slots, served at k =
    # block_size - 1 (eval.num_draft_tokens' 3 by default)
    block_size: int = 4

    @property
    def draft_tokens(self) -> int:
        """The k the block proposes, and is evaluated and served at."""
        return self.block_size - self.anchor_slots

    @classmethod
    def saved(cls, fields: dict) -> dict:
        """A config.yaml of an earlier version held the block as draft.ttt_length, its k (a block_size given beside
        it wins)."""
        if "ttt_length" not in fields:
            return fields
        kept = {key: value for key, value in fields.items() if key != "ttt_length"}
        return {"block_size": fields["ttt_length"] + cls.anchor_slots, **kept}


@dataclass
class DFlashSettings(BlockSettings):
    method: str = "dflash"
    loss: TokenLoss = TokenLoss.soft_ce  # soft_ce, acceptance or tv (draft/objective.py token_loss)
