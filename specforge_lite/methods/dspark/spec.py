"""DSpark's spec: DFlash's (a block of k slots here) and the rank of its Markov head."""

from __future__ import annotations

from dataclasses import dataclass

from ..dflash.spec import DFlashSpec


@dataclass
class DSparkSpec(DFlashSpec):
    method: str = "dspark"
    markov_rank: int = 0  # the Markov head's previous-token embedding width
