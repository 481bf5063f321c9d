"""Deterministic, resumable micro-batches: the order depends only on (seed, epoch), and the position
in it is two integers saved with every checkpoint. A micro-batch is a number of conversations
(trainer.micro_batch_size), or as many as a token budget holds (trainer.micro_batch_tokens: ``group_end``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 where the token is assistant-produced
    # Modality inputs for the target's capture (vision targets: pixel_values, image_grid_thw); else empty.
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # Packed rows (data.packing): each conversation's positions, restarting at 0 where it starts; else None.
    position_ids: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                     {k: v.to(device) for k, v in self.inputs.items()},
                     None if self.position_ids is None else self.position_ids.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def pack(rows: list[dict], max_length: int) -> list[list[dict]]:
    """The rows grouped into as few packed rows of at most ``max_length`` tokens as first-fit finds, in
    order (a conversation longer than max_length keeps a row of its own)."""
    bins: list[list[dict]] = []
    used: list[int] = []
    for r in rows:
        n = len(r["input_ids"])
        for i, u in enumerate(used):
            if u + n <= max_length:
                bins[i].append(r)
                used[i] += n
                break
        else:
            bins.append([r])
            used.append(n)
    return bins


def collate_packed(rows: list[dict], pad_id: int, max_length: int) -> Batch:
    """Several conversations per row (``pack``), right-padded; ``position_ids`` restart at 0 at each
    conversation, which is how the target and the draft keep attention inside it."""
    if any(r.get("images") for r in rows) or "store_index" in rows[0]:
        raise ValueError("data.packing=true takes text conversations read online; image rows and hidden-state "
                         "store rows are batched unpacked (data.packing=false)")
    merged = []
    for group in pack(rows, max_length):
        merged.append({"input_ids": [t for r in group for t in r["input_ids"]],
                       "loss_mask": [m for r in group for m in r["loss_mask"]],
                       "position_ids": [p for r in group for p in range(len(r["input_ids"]))]})
    batch = collate(merged, pad_id)
    positions = torch.zeros_like(batch.input_ids)
    for i, r in enumerate(merged):
        positions[i, : len(r["position_ids"])] = torch.tensor(r["position_ids"])
    batch.position_ids = positions
    return batch


def collate(rows: list[dict], pad_id: int, images: Any = None) -> Batch:
    """Right-padded rows; ``images`` (data.images.ImageInputs) turns the rows' image files into pixels."""
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), T), dtype=torch.long)
    lm = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        att[i, :n] = 1
        lm[i, :n] = torch.tensor(r["loss_mask"])
    paths = [p for r in rows for p in r.get("images") or []]
    if paths and images is None:
        raise ValueError("these rows hold images but no image processor was given (a vision target's "
                         "family.image_intake)")
    inputs = images.pixels(paths) if paths else {}
    if "store_index" in rows[0]:  # rows of a hidden-state store: which stored samples to read
        inputs["store_index"] = torch.tensor([r["store_index"] for r in rows])
    return Batch(ids, att, lm, inputs)


def conversation_lengths(dataset) -> list[int]:
    """Each row's token count: from the token column alone where the dataset is an Arrow table (a prepared
    split), else row by row."""
    if hasattr(dataset, "with_format") and "input_ids" in getattr(dataset, "column_names", ()):
        import pyarrow.compute as pc

        return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def group_end(lengths: list[int], order: list[int], start: int, budget: int) -> int:
    """Where the token-budget group that starts at ``order[start]`` ends: it takes conversations in order until
    the next one would bring it past ``budget`` tokens (the first is always taken)."""
    end, used = start + 1, lengths[order[start]]
    while end < len(order) and used + lengths[order[end]] <= budget:
        used += lengths[order[end]]
        end += 1
    return end


def group_ends(lengths: list[int], order: list[int], budget: int) -> list[int]:
    """Where each token-budget group of the whole ``order`` ends (``group_end`` from its start to its end)."""
    ends = [0]
    while ends[-1] < len(order):
        ends.append(group_end(lengths, order, ends[-1], budget))
    return ends[1:]


def content_fingerprint(dataset) -> str:
    """A digest of what training reads: every row's token ids and loss mask (a store says its own: its
    shards' checksums). Two datasets of the same size and vocabulary differ here when their text does."""
    own = getattr(dataset, "content_fingerprint", None)
    if own is not None:
        return own()
    digest = hashlib.sha256()
    for i in range(len(dataset)):
        row = dataset[i]
        for key in ("input_ids", "loss_mask"):
            digest.update(np.asarray(row[key], dtype=np.int64).tobytes() + b"|")
    return digest.hexdigest()[:16]


class BatchStream:
    """Endless epochs over a dataset in micro-batches; ``state_dict`` pins the exact position.

    With several data-parallel ranks every ``next()`` takes ``batch_size * world_size`` rows from the
    one shuffled order all ranks share, and this rank keeps its own contiguous slice: the ranks' rows
    are disjoint, and together they are the rows one process with ``world_size`` times the batch (or
    as many accumulation steps) would see. The position is world-independent, so it resumes anywhere.

    With a token budget (``token_budget``) every ``next()`` takes the next ``world_size`` groups of the shared
    order (``group_end``: conversations in order while they fit the budget), rank r the r-th: the groups are the
    same for any world size, each rank's its own, and the position is still the cursor. An epoch's last groups,
    fewer than the ranks, are left to the next epoch's shuffle (as rows fewer than the ranks are without one)."""

    def __init__(self, dataset, batch_size: int, pad_id: int, seed: int, shuffle: bool = True, images: Any = None,
                 rank: int = 0, world_size: int = 1, pack_length: int | None = None, blocks: list[range] | None = None,
                 token_budget: int | None = None):
        """``pack_length``: pack each micro-batch's conversations into rows of at most this many tokens
        (data.packing); the conversations, their order and the checkpointed position stay the same.
        ``blocks`` (a store's shards, data.store_order=shard): each epoch visits the blocks in a shuffled
        order and the rows of each block shuffled, so reads stay inside one shard at a time.
        ``token_budget`` (trainer.micro_batch_tokens): each micro-batch is one token-budget group instead of
        ``batch_size`` conversations, packed into one row of at most that many tokens."""
        self.dataset, self.batch_size, self.pad_id, self.seed, self.shuffle = dataset, batch_size, pad_id, seed, shuffle
        self.images, self.rank, self.world_size, self.pack_length = images, rank, world_size, pack_length
        self.blocks, self.token_budget = blocks, token_budget
        if len(dataset) < world_size:
            raise ValueError(f"{len(dataset)} training samples cannot feed {world_size} data-parallel ranks")
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()
        self._fingerprint: str | None = None  # (computed at the first save or resume)
        self._lengths = conversation_lengths(dataset) if token_budget else None

    def _make_order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        if self.blocks is None:
            return torch.randperm(n, generator=g).tolist()
        order = []
        for b in torch.randperm(len(self.blocks), generator=g).tolist():
            block = self.blocks[b]
            order += [block[i] for i in torch.randperm(len(block), generator=g).tolist()]
        return order

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self.token_budget:
            return self._next_group()
        if len(self._order) - self.cursor < self.world_size:  # the epoch's tail cannot give every rank a row
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._make_order()
        idx = self._order[self.cursor : self.cursor + self.batch_size * self.world_size]
        self.cursor += len(idx)
        n, r, w = len(idx), self.rank, self.world_size
        mine = idx[r * n // w : (r + 1) * n // w]
        rows = [self.dataset[i] for i in mine]
        if self.pack_length:
            return collate_packed(rows, self.pad_id, self.pack_length)
        return collate(rows, self.pad_id, self.images)

    def _group_ends(self) -> list[int] | None:
        """Where the next ``world_size`` groups from the cursor end, or None when the epoch's rest has fewer."""
        ends, start = [], self.cursor
        while len(ends) < self.world_size and start < len(self._order):
            start = group_end(self._lengths, self._order, start, self.token_budget)
            ends.append(start)
        return ends if len(ends) == self.world_size else None

    def _next_group(self) -> Batch:
        ends = self._group_ends()
        if ends is None:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._make_order()
            ends = self._group_ends()
            if ends is None:
                raise ValueError(f"{len(self.dataset)} training conversations fill fewer micro-batches of "
                                 f"{self.token_budget} tokens than the {self.world_size} data-parallel ranks: give "
                                 "more data, or a smaller trainer.micro_batch_tokens")
        starts = [self.cursor, *ends[:-1]]
        mine = self._order[starts[self.rank] : ends[self.rank]]
        self.cursor = ends[-1]
        return collate_packed([self.dataset[i] for i in mine], self.pad_id, self.token_budget)

    def micro_batches_per_epoch(self) -> int | None:
        """The micro-batches one epoch gives all ranks together with a token budget (None without one): the
        groups of the first epoch's order, less the last few fewer than the ranks (another epoch's order makes
        about as many)."""
        if not self.token_budget:
            return None
        epoch, self.epoch = self.epoch, 0
        order, self.epoch = self._make_order(), epoch
        groups = len(group_ends(self._lengths, order, self.token_budget))
        return groups - groups % self.world_size

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = content_fingerprint(self.dataset)
        return self._fingerprint

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.dataset),
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.dataset):
            raise ValueError(f"the checkpoint was taken on {state['size']} training conversations, this run has "
                             f"{len(self.dataset)}: the data settings changed since. Resume with the same data, or "
                             "start anew (a new output_dir, or trainer.resume=never)")
        if state.get("fingerprint", self.fingerprint()) != self.fingerprint():  # (older checkpoints did not record it)
            raise ValueError(f"the checkpoint was taken on other training data: as many conversations "
                             f"({len(self.dataset)}), other content (fingerprint {state['fingerprint']}, now "
                             f"{self.fingerprint()}); the data files or data settings changed since. Resume with "
                             "the same data, or start anew (a new output_dir, or trainer.resume=never)")
        self.epoch, self.cursor, self.seed = state["epoch"], state["cursor"], state["seed"]
        self._order = self._make_order()
