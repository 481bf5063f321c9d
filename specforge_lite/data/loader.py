"""Deterministic, resumable micro-batches: the order depends only on (seed, epoch), and the position
in it is two integers saved with every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 where the token is assistant-produced

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(rows: list[dict], pad_id: int) -> Batch:
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), T), dtype=torch.long)
    lm = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        att[i, :n] = 1
        lm[i, :n] = torch.tensor(r["loss_mask"])
    return Batch(ids, att, lm)


class BatchStream:
    """Endless epochs over a dataset in micro-batches; ``state_dict`` pins the exact position."""

    def __init__(self, dataset, batch_size: int, pad_id: int, seed: int, shuffle: bool = True):
        self.dataset, self.batch_size, self.pad_id, self.seed, self.shuffle = dataset, batch_size, pad_id, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.cursor >= len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._make_order()
        idx = self._order[self.cursor : self.cursor + self.batch_size]
        self.cursor += len(idx)
        return collate([self.dataset[i] for i in idx], self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.dataset):
            raise RuntimeError(f"the checkpoint was taken on {state['size']} training conversations, this run has "
                               f"{len(self.dataset)}: resume with the same data settings")
        self.epoch, self.cursor, self.seed = state["epoch"], state["cursor"], state["seed"]
        self._order = self._make_order()
