"""DFlash 2's spec: DFlash's, the convolutions' taps and channels per kernel, the candidate selector's rank and
top-k."""

from __future__ import annotations

from dataclasses import dataclass

from ..dflash.spec import DFlashSpec


@dataclass
class DFlash2Spec(DFlashSpec):
    method: str = "dflash2"
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
