"""DFlash's settings (draft=dflash): the shared ones (config.py ``DraftSettings``; ttt_length is the tokens per
block, served at that k) and its token loss."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import DraftSettings


@dataclass
class DFlashSettings(DraftSettings):
    method: str = "dflash"
    loss: str = "soft_ce"  # soft_ce | acceptance | tv (draft/objective.py token_loss)
