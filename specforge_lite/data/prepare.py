"""Rows on disk -> tokenised training and held-out sets (cached), with malformed rows counted."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DataConfig, cache_dir
from .builtin import chitchat_path
from .chat import prompt_ids, tokenize_conversation
from .formats import MalformedRow, iter_rows, normalize_conversation

_PREP_VERSION = "1"  # bump when tokenisation or masking changes, so stale caches are not reused
_HELDOUT_SEED = 1234  # fixed: the held-out split does not move with trainer.seed


class DataError(RuntimeError):
    pass


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset with input_ids, loss_mask
    heldout: Any  # datasets.Dataset with input_ids, loss_mask
    heldout_prompts: list[list[int]]  # token ids up to each held-out conversation's first answer
    stats: dict = field(default_factory=dict)


def data_file(cfg: DataConfig) -> Path:
    if cfg.source == "builtin_chitchat":
        return chitchat_path()
    if cfg.source in ("path", "jsonl", "file"):
        if not cfg.path:
            raise DataError(f"data.source={cfg.source} needs data.path=/path/to/data.jsonl")
        path = Path(cfg.path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data.path={str(path)!r} does not exist; give a JSONL/JSON file or folder of them "
                "(ShareGPT 'conversations' or OpenAI 'messages' rows), or data.source=builtin_chitchat")
        return path
    raise DataError(f"data.source={cfg.source!r}: use builtin_chitchat or path (with data.path=...)")


def _fingerprint(path: Path, tokenizer: Any, cfg: DataConfig) -> str:
    h = hashlib.sha256()
    files = sorted(path.rglob("*.json*")) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.name).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    tok_state = json.dumps([tokenizer.name_or_path, len(tokenizer), tokenizer.chat_template,
                            tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), 4096))))])
    h.update(tok_state.encode())
    h.update(json.dumps([_PREP_VERSION, cfg.max_length, cfg.heldout_samples, cfg.max_samples]).encode())
    return h.hexdigest()[:20]


def prepare_data(cfg: DataConfig, tokenizer: Any, log=print) -> PreparedData:
    import datasets

    path = data_file(cfg)
    key = _fingerprint(path, tokenizer, cfg)
    cached = cache_dir() / "prepared" / key
    if (cached / "stats.json").is_file():
        stats = json.loads((cached / "stats.json").read_text())
        prompts = json.loads((cached / "heldout_prompts.json").read_text())
        return PreparedData(datasets.load_from_disk(str(cached / "train")),
                            datasets.load_from_disk(str(cached / "heldout")), prompts, stats)

    conversations, reasons, total = [], Counter(), 0
    for where, row in iter_rows(path):
        total += 1
        try:
            if isinstance(row, Exception):
                raise row
            conversations.append(normalize_conversation(row))
        except MalformedRow as e:
            reasons[str(e)] += 1
    _check_malformed(total, reasons, cfg, path)

    order = list(range(len(conversations)))
    random.Random(_HELDOUT_SEED).shuffle(order)
    n_held = min(cfg.heldout_samples, len(order) // 2)
    held_idx, train_idx = order[:n_held], order[n_held:]
    if cfg.max_samples is not None:
        train_idx = train_idx[: cfg.max_samples]

    def tokenize(batch):
        out = {"input_ids": [], "loss_mask": [], "error": []}
        for messages in batch["messages"]:
            try:
                ids, mask = tokenize_conversation(tokenizer, messages, cfg.max_length)
                out["input_ids"].append(ids), out["loss_mask"].append(mask), out["error"].append("")
            except MalformedRow as e:
                out["input_ids"].append([]), out["loss_mask"].append([]), out["error"].append(str(e))
        return out

    def build(indices):
        ds = datasets.Dataset.from_dict({"messages": [conversations[i] for i in indices]})
        ds = ds.map(tokenize, batched=True, remove_columns=["messages"], num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                    desc="tokenising")
        errors = Counter(e for e in ds["error"] if e)
        return ds.filter(lambda e: not e, input_columns="error").remove_columns("error"), errors

    train, train_err = build(train_idx)
    heldout, held_err = build(held_idx)
    reasons.update(train_err)
    reasons.update(held_err)
    if len(train) == 0:
        raise DataError(
            f"no usable training conversations in {path} after filtering ({dict(reasons)}); check the format "
            f"(ShareGPT 'conversations' or OpenAI 'messages') and data.max_length={cfg.max_length}"
        )
    prompts = [prompt_ids(tokenizer, conversations[i]) for i in held_idx]
    n_tokens = sum(len(x) for x in train["input_ids"])
    stats = {"file": str(path), "rows": total, "conversations": len(conversations), "train": len(train),
             "heldout": len(heldout), "train_tokens": n_tokens,
             "train_loss_tokens": sum(sum(m) for m in train["loss_mask"]), "skipped": dict(reasons)}
    tmp = cached.with_name(cached.name + ".tmp")
    train.save_to_disk(str(tmp / "train"))
    heldout.save_to_disk(str(tmp / "heldout"))
    (tmp / "heldout_prompts.json").write_text(json.dumps(prompts))
    (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
    try:
        tmp.rename(cached)
    except OSError:
        pass  # a concurrent run published the same content first
    skipped = sum(reasons.values())
    log(f"[data] {path.name}: {len(train)} train / {len(heldout)} held-out conversations, {n_tokens} train tokens"
        + (f"; skipped {skipped}: {dict(reasons)}" if skipped else ""))
    return PreparedData(datasets.load_from_disk(str(cached / "train")),
                        datasets.load_from_disk(str(cached / "heldout")), prompts, stats)


def _check_malformed(total: int, reasons: Counter, cfg: DataConfig, path: Path) -> None:
    bad = sum(reasons.values())
    if total == 0:
        raise DataError(f"{path} holds no rows")
    if bad / total > cfg.max_malformed_fraction:
        top = ", ".join(f"{n}x {r}" for r, n in reasons.most_common(3))
        raise DataError(
            f"{bad} of {total} rows in {path} are malformed ({top}); above data.max_malformed_fraction="
            f"{cfg.max_malformed_fraction}. Fix the file or raise the threshold to skip them."
        )
