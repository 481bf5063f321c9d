"""Run the target once over the prepared training data and write a hidden-state store.

    python -m specforge_lite.offline dump [hydra overrides] store=DIR [store.dtype=bfloat16] [store.batch_size=8]

The data stage, aux ids and draft vocabulary are the ones ``train.py`` with the same overrides would
use, so ``train.py <same overrides> data.source=offline data.store=DIR`` trains on exactly these samples.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..config import Config
from ..data.images import image_inputs
from ..data.loader import collate
from ..targets.capture import CONVENTION
from ..targets.hf import HFTarget
from ..targets.store import Manifest, ShardWriter, StoreError, save_parts, teacher_record

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def with_final_state(target: HFTarget) -> HFTarget:
    """The same model capturing one more state: the last layer's pre-norm output (id num_layers). Close
    it when done (its hooks stay on the shared model)."""
    L = target.num_layers
    if L in target.aux_layer_ids:
        raise StoreError(f"aux id {L} (the pre-norm final state) is stored separately; leave it out of "
                         f"draft.aux_layer_ids")
    return target.with_aux_layer_ids([*target.aux_layer_ids, L])


def data_settings(config: Config) -> dict:
    """The data config the store was made from (evaluation re-creates its held-out prompts from it)."""
    from dataclasses import asdict

    return asdict(config.data)


def store_bytes(tokens: int, n_aux: int, hidden: int, dtype: str, topk: int = 0) -> int:
    """Disk of the shards: aux states and the final state (or top-k values + int32 ids) per token, plus
    ids, mask and flags (6 bytes)."""
    teacher = topk * (_DTYPE_BYTES[dtype] + 4) if topk else hidden * _DTYPE_BYTES[dtype]
    return tokens * (n_aux * hidden * _DTYPE_BYTES[dtype] + teacher + 6)


def open_or_create(folder: Path, target: HFTarget, vocab, aux_ids: list[int], store_cfg, source: dict,
                   log=print, parts: bool = True) -> Manifest:
    """A new store with the target's parts written once (``parts``; a rank's part of a store has none: the
    merged store keeps them), or the existing one made with the same settings (a killed dump or ingest
    resumes after its last complete shard)."""
    manifest = Manifest(convention=CONVENTION, aux_layer_ids=list(aux_ids), num_layers=target.num_layers,
                        hidden_size=target.hidden_size, vocab_size=target.vocab_size, family=target.family.name,
                        target_config=target.config.to_dict(), dtype=store_cfg.dtype, draft_vocab_size=vocab.size,
                        teacher=store_cfg.teacher, topk=store_cfg.topk if store_cfg.teacher == "topk" else 0,
                        source=source)
    if (folder / "manifest.json").is_file():
        old = Manifest.load(folder)
        keys = ("convention", "aux_layer_ids", "num_layers", "hidden_size", "vocab_size", "dtype", "draft_vocab_size",
                "teacher", "topk", "source")
        differ = [k for k in keys if getattr(old, k) != getattr(manifest, k)]
        if differ:
            raise StoreError(f"{folder} holds a store made with other settings ({differ} differ); choose another "
                             "store=DIR or delete it")
        log(f"[store] resuming {folder}: {old.num_samples} samples already stored")
        manifest = old
    else:
        folder.mkdir(parents=True, exist_ok=True)
        if parts:
            rows, bias = target.head_rows(vocab.draft_to_target)
            final_norm = target.family.final_norm(target.model).state_dict()
            save_parts(folder, target.embedding_weight(), final_norm, rows, vocab.d2t, bias)
        manifest.save(folder)
    for stale in folder.glob("*.tmp"):  # a shard a killed run was writing
        stale.unlink()
    return manifest


def store_folder(config: Config, command: str) -> Path:
    """The store folder ``store=DIR`` names, after checking the store settings (before any model loads)."""
    sc = config.store
    if not sc.path:
        raise StoreError(f"give the store folder: python -m specforge_lite.offline {command} ... store=DIR")
    if sc.dtype not in _DTYPE_BYTES:
        raise StoreError(f"store.dtype={sc.dtype!r}: use bfloat16, float16 or float32")
    if sc.teacher not in ("final", "topk") or (sc.teacher == "topk" and sc.topk < 1):
        raise StoreError(f"store.teacher={sc.teacher!r} (store.topk={sc.topk}): use final, or topk with "
                         "store.topk >= 1")
    return Path(sc.path).expanduser()


def rank_folder(rank: int, world_size: int) -> str:
    return f"rank-{rank:03d}-of-{world_size:03d}"


def dump(run, log=print) -> Path:
    """``run``: the online run (run.Run) whose prepared training data, draft vocabulary and teacher the
    store records. Under a launcher with N processes each rank captures its contiguous 1/N of the samples
    into ``DIR/rank-RRR-of-NNN/`` (resumable on its own), and rank 0 then merges them into one store in
    DIR whose manifest lists the ranks' shards in sample order: nothing is copied."""
    folder, ctx = store_folder(run.config, "dump"), run.ctx
    n = len(run.data.train)
    target = with_final_state(run.target)
    try:
        if not ctx.enabled or ctx.world_size == 1:
            return _write(run, target, folder, range(n), log)
        lo, hi = n * ctx.rank // ctx.world_size, n * (ctx.rank + 1) // ctx.world_size
        _write(run, target, folder / rank_folder(ctx.rank, ctx.world_size), range(lo, hi), log, parts=False)
        ctx.barrier()
        if ctx.is_main:
            merge(run, target, folder, ctx.world_size, log)
        ctx.barrier()
        return folder
    finally:
        target.close()


def _source(run, target: HFTarget, samples: range | None = None) -> dict:
    source = {"kind": "dump", "model": run.config.model.name, "location": str(target.location),
              "train_samples": len(run.data.train), "data": data_settings(run.config)}
    return source if samples is None else {**source, "samples": [samples.start, samples.stop]}


def merge(run, target: HFTarget, folder: Path, world_size: int, log=print) -> Manifest:
    """The store in ``folder`` made of the ranks' parts (each complete), in sample order."""
    aux_ids = list(run.target.aux_layer_ids)
    manifest = open_or_create(folder, target, run.vocab, aux_ids, run.config.store, _source(run, target), log)
    shards, samples = [], 0
    for rank in range(world_size):
        part = Manifest.load(folder / rank_folder(rank, world_size))
        lo, hi = part.source["samples"]
        if lo != samples or part.num_samples != hi - lo:
            raise StoreError(f"{folder / rank_folder(rank, world_size)} holds {part.num_samples} of its samples "
                             f"{lo}..{hi}: that rank did not finish; re-run the dump with the same launcher")
        shards += [{**shard, "file": f"{rank_folder(rank, world_size)}/{shard['file']}"} for shard in part.shards]
        samples = hi
    manifest.shards, manifest.num_samples = shards, samples
    manifest.save(folder)
    log(f"[store] merged {world_size} ranks' parts into {folder}: {samples} samples in {len(shards)} shards")
    return manifest


def _write(run, target: HFTarget, folder: Path, samples: range, log, parts: bool = True) -> Path:
    """The store of ``run``'s training ``samples``, captured by ``target`` (the run's aux ids plus id L)."""
    from ..data import pad_id

    config, data, teacher, aux_ids = run.config, run.data, run.teacher, list(run.target.aux_layer_ids)
    sc = config.store
    whole = samples == range(len(data.train))
    manifest = open_or_create(folder, target, run.vocab, aux_ids, sc, _source(run, target, None if whole else samples),
                              log, parts)
    tokens = sum(len(x) for x in data.train[samples.start : samples.stop]["input_ids"])
    need = store_bytes(tokens, len(aux_ids), target.hidden_size, sc.dtype, sc.topk if sc.teacher == "topk" else 0)
    free = shutil.disk_usage(folder).free
    log(f"[store] {len(samples)} samples, {tokens} tokens -> about {need / 2**30:.2f} GiB in {sc.dtype} "
        f"({free / 2**30:.1f} GiB free at {folder})")
    if need > free:
        raise StoreError(f"the store needs about {need / 2**30:.1f} GiB and {folder} has {free / 2**30:.1f} GiB free; "
                         "free space, choose another store=DIR, or store.dtype=bfloat16")

    writer = ShardWriter(folder, manifest, sc.samples_per_shard)
    n = samples.stop
    pad = pad_id(run.tokenizer)
    with torch.no_grad():
        for start in range(samples.start + manifest.num_samples, n, sc.batch_size):
            rows = [data.train[i] for i in range(start, min(start + sc.batch_size, n))]
            batch = collate(rows, pad, image_inputs(target)).to(target.device)
            captured = target.capture(batch.input_ids, batch.attention_mask, **batch.inputs)
            _, in_vocab = teacher(captured, batch.attention_mask.bool())
            for r, row in enumerate(rows):
                k = len(row["input_ids"])
                aux = torch.stack([a[r, :k] for a in captured.aux[:-1]], dim=1)
                record = teacher_record(sc.teacher, sc.topk, captured.aux[-1][r, :k],
                                        lambda: teacher.logits(captured.final_hidden[r, :k]))
                writer.add(batch.input_ids[r, :k], batch.loss_mask[r, :k], aux, record, in_vocab[r, :k])
            if ((start - samples.start) // sc.batch_size) % 20 == 0:
                log(f"[store] {min(start + sc.batch_size, n) - samples.start}/{len(samples)} samples")
        writer.flush()
    log(f"[store] {folder}: {manifest.num_samples} samples, {manifest.tokens} tokens in {len(manifest.shards)} shards")
    return folder
