"""A row shared by the ranks of a sequence-parallel group (DeepSpeed's Ulysses, ``deepspeed.sequence``).

The ranks of a group read the same rows. The frozen target runs on the whole row on each of them (it keeps no
activations); the draft's steps run on this rank's contiguous share of the rows only (``SequenceShard``), and a
method whose objective takes a shard exchanges what is not per row, its attention, with the other ranks (EAGLE3:
methods/eagle3/ulysses.py).

Each rank's loss is its rows' summed loss over the valid tokens of the WHOLE row, so the group's losses
add up to the single-process loss; DeepSpeed sums gradients within the group (and averages across
data-parallel replicas), which makes the update the single-process one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of every row: rank ``rank`` of a group of ``size`` ranks (``group``)."""

    group: Any  # the torch.distributed process group of the ranks sharing each row
    rank: int
    size: int

    def padded_length(self, T: int) -> int:
        """Rows are split evenly: T rounded up to a multiple of the group size."""
        return -(-T // self.size) * self.size

    def bounds(self, T: int) -> tuple[int, int]:
        """This rank's rows [lo, hi) of a row padded to ``padded_length(T)``."""
        share = self.padded_length(T) // self.size
        return self.rank * share, (self.rank + 1) * share


def padded_rows(x: torch.Tensor, length: int, value=0) -> torch.Tensor:
    """[B, T, ...] padded with ``value`` along dim 1 to ``length`` rows."""
    if x.shape[1] == length:
        return x
    pad = x.new_full((x.shape[0], length - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def continued_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [B, T] extended to ``length`` rows, counting on from each row's last position (padding
    rows then belong to the row's last conversation and, being last, are seen by no real row)."""
    extra = length - positions.shape[1]
    if extra == 0:
        return positions
    return torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)], dim=1)
