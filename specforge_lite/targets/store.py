"""The hidden-state store: what offline training reads instead of running the target.

Layout of a store folder:

    manifest.json            target config, aux ids and their convention, dtypes, shards (sha256, counts)
    target_parts.safetensors the target's weights training needs, kept once: the embedding table (the
                             draft reads it), the final norm, and the draft-vocabulary rows of the lm_head
                             (plus d2t, the draft vocabulary)
    shard_00000.safetensors  samples concatenated along tokens: input_ids [N], loss_mask [N],
                             aux [N, n_aux, H], final [N, H] (pre-norm last layer) or, with
                             store.teacher=topk, topk_values/topk_ids [N, k] (the teacher's top-k
                             draft-vocabulary logits), in_vocab [N] (target argmax inside the draft
                             vocabulary), offsets [n_samples + 1]

A shard is written under a temporary name and renamed when complete, and the manifest lists only
complete shards, so a killed dump leaves nothing half-written visible and resumes at the next shard.
The teacher is recomputed at train time: final norm, then the draft rows (exact, no full logits).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UserError
from ..files import sha256_file

FORMAT = "specforge_lite.store"
VERSION = 1
MANIFEST = "manifest.json"
PARTS = "target_parts.safetensors"


class StoreError(UserError):
    pass


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


@dataclass
class Manifest:
    convention: str
    aux_layer_ids: list[int]  # in the convention below; the last layer's pre-norm state is stored as "final"
    num_layers: int
    hidden_size: int
    vocab_size: int
    family: str
    target_config: dict
    dtype: str  # of aux and final
    draft_vocab_size: int
    teacher: str = "final"  # final (pre-norm last state) | topk (the teacher's top-k logits)
    topk: int = 0
    num_samples: int = 0
    shards: list[dict] = field(default_factory=list)  # {"file", "sha256", "samples", "tokens"}
    source: dict = field(default_factory=dict)  # what made it: dump (data fingerprint) or ingest (format, path)
    format: str = FORMAT
    version: int = VERSION

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def save(self, folder: Path) -> None:
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=1))
        os.replace(tmp, folder / MANIFEST)

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise StoreError(f"{folder} is not a hidden-state store (no {MANIFEST}); make one with "
                             "python -m specforge_lite.offline dump ... store=DIR (or ingest)")
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise StoreError(f"{path}: format {data.get('format')} v{data.get('version')}, "
                             f"expected {FORMAT} v{VERSION}")
        return cls(**data)


class ShardWriter:
    """Buffers samples and writes a shard atomically every ``samples_per_shard`` samples."""

    def __init__(self, folder: Path, manifest: Manifest, samples_per_shard: int):
        self.folder, self.manifest, self.per_shard = Path(folder), manifest, samples_per_shard
        self._rows: list[dict[str, torch.Tensor]] = []

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, teacher: dict[str, torch.Tensor],
            in_vocab: torch.Tensor) -> None:
        """``teacher``: {"final": [T, H]} or {"topk_values": [T, k], "topk_ids": [T, k]} (teacher_record)."""
        dtype = getattr(torch, self.manifest.dtype)
        row = {"input_ids": input_ids.to(torch.int32).cpu(), "loss_mask": loss_mask.to(torch.uint8).cpu(),
               "aux": aux.to(dtype).cpu(), "in_vocab": in_vocab.to(torch.uint8).cpu()}
        for k, v in teacher.items():
            row[k] = v.to(torch.int32 if k == "topk_ids" else dtype).cpu()
        self._rows.append(row)
        if len(self._rows) >= self.per_shard:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        index = len(self.manifest.shards)
        lengths = torch.tensor([0] + [r["input_ids"].numel() for r in self._rows])
        tensors = {k: torch.cat([r[k] for r in self._rows]).contiguous() for k in self._rows[0]}
        tensors["offsets"] = lengths.cumsum(0).to(torch.int64)
        name = shard_name(index)
        tmp = self.folder / (name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        os.replace(tmp, self.folder / name)
        self.manifest.shards.append({"file": name, "sha256": sha256_file(self.folder / name),
                                     "samples": len(self._rows), "tokens": int(lengths.sum())})
        self.manifest.num_samples += len(self._rows)
        self.manifest.save(self.folder)
        self._rows = []


def teacher_fields(manifest: Manifest) -> tuple[str, ...]:
    return ("final",) if manifest.teacher == "final" else ("topk_values", "topk_ids")


def teacher_record(kind: str, k: int, prenorm: torch.Tensor, draft_logits) -> dict[str, torch.Tensor]:
    """What a sample keeps of the teacher: the pre-norm final state, or the top-k of the draft-vocabulary
    logits (``draft_logits()`` computes them [T, Vd] from the target)."""
    if kind == "final":
        return {"final": prenorm}
    values, ids = draft_logits().topk(k, dim=-1)
    return {"topk_values": values, "topk_ids": ids}


def save_parts(folder: Path, embedding: torch.Tensor, final_norm: dict[str, torch.Tensor], draft_rows: torch.Tensor,
               d2t: torch.Tensor, draft_bias: torch.Tensor | None = None) -> None:
    tensors = {"embedding": embedding, "draft_rows": draft_rows, "d2t": d2t,
               **{f"final_norm.{k}": v for k, v in final_norm.items()}}
    if draft_bias is not None:
        tensors["draft_bias"] = draft_bias
    tmp = Path(folder) / (PARTS + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, Path(folder) / PARTS)


class StoreReader:
    """Samples by index across shards; each shard is checked against its checksum on first use."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder).expanduser()
        self.manifest = Manifest.load(self.folder)
        self.verify = verify
        self._index: list[tuple[int, int]] = []  # sample -> (shard, row)
        for s, shard in enumerate(self.manifest.shards):
            self._index += [(s, r) for r in range(shard["samples"])]
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._index)

    def content_fingerprint(self) -> str:
        """What its shards hold, from the checksums the manifest keeps (no shard is read)."""
        joined = "|".join(shard["sha256"] for shard in self.manifest.shards)
        return hashlib.sha256(joined.encode()).hexdigest()[:16]

    def shard_ranges(self) -> list[range]:
        """The sample indices of each shard."""
        starts = [0]
        for shard in self.manifest.shards:
            starts.append(starts[-1] + shard["samples"])
        return [range(a, b) for a, b in zip(starts, starts[1:])]

    def _shard(self, s: int):
        if s not in self._open:
            info = self.manifest.shards[s]
            path = self.folder / info["file"]
            if not path.is_file():
                raise StoreError(f"store shard {path} is missing (listed in {MANIFEST}); re-run the dump to rewrite it")
            if self.verify and sha256_file(path) != info["sha256"]:
                raise StoreError(f"store shard {path} is corrupted (sha256 differs from {MANIFEST}); delete it and "
                                 "its manifest entry and re-run the dump, or restore the file")
            self._open[s] = safe_open(str(path), framework="pt")
            self._offsets[s] = self._open[s].get_tensor("offsets").tolist()
        return self._open[s], self._offsets[s]

    def sample(self, i: int, keys=None) -> dict[str, torch.Tensor]:
        """Sample i's tensors (every field when ``keys`` is None)."""
        keys = keys or ("input_ids", "loss_mask", "aux", "in_vocab", *teacher_fields(self.manifest))
        s, r = self._index[i]
        f, offsets = self._shard(s)
        a, b = offsets[r], offsets[r + 1]
        return {k: f.get_slice(k)[a:b] for k in keys}

    def __getitem__(self, i: int) -> dict:
        """A dataset row for the batch stream: token ids and loss mask, and which stored sample it is."""
        row = self.sample(i, ("input_ids", "loss_mask"))
        return {"input_ids": row["input_ids"].tolist(), "loss_mask": row["loss_mask"].tolist(), "store_index": i}

    def parts(self) -> dict[str, torch.Tensor]:
        path = self.folder / PARTS
        if not path.is_file():
            raise StoreError(f"{path} is missing: the store is incomplete; re-run the dump")
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
