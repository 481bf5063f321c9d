"""Ulysses sequence parallelism for the draft's training step (DeepSpeed's ``deepspeed.sequence``).

The ranks of a sequence-parallel group read the same rows. The frozen target runs on the whole row on
each of them (it keeps no activations); the draft's unroll runs on this rank's contiguous share of the
rows only. Everything in the draft layer is per row except attention: there DeepSpeed's
``DistributedAttention`` exchanges queries, keys and values all-to-all so that each rank holds every
row for its share of the heads, runs the TTT attention (step-0 causal keys, packed-row boundaries,
same-row keys of later steps) over the whole row, and exchanges the output back.

Each rank's loss is its rows' summed loss over the valid tokens of the WHOLE row, so the group's losses
add up to the single-process loss; DeepSpeed sums gradients within the group (and averages across
data-parallel replicas), which makes the update the single-process one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .ttt import TTTCache


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

    def cache(self, segments: torch.Tensor | None, attention: str) -> "UlyssesCache":
        return UlyssesCache(TTTCache(segments, attention), self)


class UlyssesCache:
    """A ``TTTCache`` over whole rows, fed and read through DeepSpeed's all-to-all: ``append`` takes this
    rank's rows of keys and values, ``attend`` this rank's rows of queries, and the wrapped cache holds
    every row of this rank's heads."""

    def __init__(self, inner: TTTCache, shard: SequenceShard):
        from deepspeed.sequence.layer import DistributedAttention

        self.inner, self.shard = inner, shard
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._scale: float | None = None
        # [B, rows, heads, d] in, scatter the heads (dim 2), gather the rows (dim 1)
        self._attention = DistributedAttention(self._local, shard.group, scatter_idx=2, gather_idx=1)
        self._layers = {0: self}

    def layer(self, i: int) -> "UlyssesCache":
        """Draft layer i's cache (multi-layer drafts), exchanged the same way."""
        if i not in self._layers:
            self._layers[i] = UlyssesCache(self.inner.layer(i), self.shard)
        return self._layers[i]

    def truncate(self, steps: int) -> None:
        self.inner.truncate(steps)

    def __len__(self) -> int:
        return len(self.inner)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._pending = (k, v)  # exchanged together with the queries in attend()

    def attend(self, q: torch.Tensor, q_offset: int, scale: float) -> torch.Tensor:
        """q, and the keys and values appended before, [B, heads, rows of this rank, d]."""
        if q_offset:
            raise ValueError("sequence-parallel attention covers whole rows (training); drafting uses TTTCache")
        (k, v), self._pending = self._pending, None
        self._scale = scale
        out = self._attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
        return out.transpose(1, 2)

    def _local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Every row of this rank's heads, [B, rows, heads / size, d]: the TTT attention over whole rows."""
        self.inner.append(k.transpose(1, 2), v.transpose(1, 2))
        return self.inner.attend(q.transpose(1, 2), 0, self._scale).transpose(1, 2)


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
