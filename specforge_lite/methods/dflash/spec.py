"""DFlash's spec: the shared fields (draft/model.py ``DraftSpec``), its block and its mask token."""

from __future__ import annotations

from dataclasses import dataclass

from ...draft.model import DraftSpec


@dataclass
class DFlashSpec(DraftSpec):
    method: str = "dflash"
    # positions per block (DFlash: the next token and k mask slots, vLLM's block_size = k + 1; DSpark: the next
    # token and k - 1 mask slots, block_size = k). The block is the draft's input, so it is served at that k only.
    block_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.check_mask_token()
