"""Ulysses sequence parallelism for EAGLE3's training-time-test attention (DeepSpeed's ``deepspeed.sequence``).

Everything in the draft layer is per row except attention: there DeepSpeed's ``DistributedAttention`` exchanges
queries, keys and values all-to-all so that each rank holds every row for its share of the heads, runs the TTT
attention (step-0 causal keys, packed-row boundaries, same-row keys of later steps) over the whole row, and
exchanges the output back. Which rows a rank holds: draft/sequence_parallel.py."""

from __future__ import annotations

import torch

from ...draft.sequence_parallel import SequenceShard
from .ttt import TTTCache


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
