"""DFlash 2's settings (draft=dflash2): DFlash's, and its convolutions' and candidate selector's. It keeps the
whole target vocabulary whatever draft_vocab_size says (its selector indexes codebooks with token ids)."""

from __future__ import annotations

from dataclasses import dataclass

from ..dflash.settings import DFlashSettings


@dataclass
class DFlash2Settings(DFlashSettings):
    method: str = "dflash2"
    conv_kernel_size: int = 2  # taps of the convolutions along the block (speculators: 2)
    conv_group_size: int = 16  # channels sharing one convolution kernel (speculators: 16)
    selector_top_k: int = 16  # the draft's top tokens per slot the selector rescores (speculators: 16)
    # the rank of the selector's edge term (speculators' 256 is sized for hidden sizes of thousands)
    selector_rank: int = 64
    selector_weight: float = 1.0  # the selector's cross-entropy weight beside the token loss
