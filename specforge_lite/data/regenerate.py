"""Train on what the target actually says: rebuild conversations with the target's own answers.

A draft trained on human answers learns how people talk; the served model answers in its own voice.
Here every assistant turn (up to ``max_turns`` per conversation) is replaced by the target's answer:

* ``context=all``: each answer is conditioned on the conversation so far, with the earlier answers
  already regenerated (the EAGLE recipe). Turns are generated in order, batched across conversations.
* ``context=last``: each answer sees only the user turn before it (single-turn samples, fully parallel).

Results are cached under a key of (data, model, settings) in shards written atomically, so a killed
run resumes at the first unfinished shard and a finished one is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from ..config import GenerationConfig, cache_dir

Messages = list[dict[str, str]]
Generate = Callable[[list[Messages]], list[str]]


def regeneration_key(source_fingerprint: str, model_fingerprint: str, cfg: GenerationConfig) -> str:
    # max_conversations is not part of the key: shards are prefix-stable, so a larger cap reuses them.
    settings = {k: getattr(cfg, k) for k in ("context", "max_turns", "temperature", "top_p", "max_new_tokens", "seed",
                                             "batch_size")}
    blob = json.dumps([source_fingerprint, model_fingerprint, settings], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _units(conversations: list[Messages], cfg: GenerationConfig) -> list[Messages]:
    """What gets regenerated: whole conversations (context=all) or single (user) prompts (context=last)."""
    if cfg.context == "all":
        return conversations
    if cfg.context != "last":
        raise ValueError(f"data.generation.context={cfg.context!r}: use all or last")
    singles = []
    for messages in conversations:
        users = [i for i, m in enumerate(messages) if m["role"] == "user" and i + 1 < len(messages)
                 and messages[i + 1]["role"] == "assistant"]
        for i in users[: cfg.max_turns]:
            singles.append([messages[i], messages[i + 1]])
    return singles


def _regenerate_batch(batch: list[Messages], generate: Generate, max_turns: int | None) -> tuple[list[Messages], int]:
    """Replace assistant turns in order; returns the rebuilt conversations and how many answers came back empty."""
    done: list[Messages] = [[] for _ in batch]
    pending = list(range(len(batch)))
    cursor = [0] * len(batch)  # index in the original conversation
    turns = [0] * len(batch)
    empty = 0
    while pending:
        prompts, owners = [], []
        for b in pending:
            src = batch[b]
            while cursor[b] < len(src) and src[cursor[b]]["role"] != "assistant":
                done[b].append(src[cursor[b]])
                cursor[b] += 1
            if cursor[b] < len(src) and (max_turns is None or turns[b] < max_turns):
                prompts.append(list(done[b]))
                owners.append(b)
        if not prompts:
            break
        answers = generate(prompts)
        still = []
        for b, answer in zip(owners, answers):
            if not answer:
                empty += 1
                continue  # stop this conversation at the last good turn
            done[b].append({"role": "assistant", "content": answer})
            cursor[b] += 1
            turns[b] += 1
            still.append(b)
        pending = still
    rebuilt = []
    for conv in done:
        while conv and conv[-1]["role"] != "assistant":  # end on an answer
            conv.pop()
        if any(m["role"] == "assistant" for m in conv):
            rebuilt.append(conv)
    return rebuilt, empty


def regenerate(conversations: list[Messages], generate: Generate, cfg: GenerationConfig, key: str,
               log=print) -> tuple[list[Messages], dict]:
    units = _units(conversations, cfg)
    if cfg.max_conversations is not None:
        units = units[: cfg.max_conversations]
    root = cache_dir() / "regenerated" / key
    root.mkdir(parents=True, exist_ok=True)
    shards = [units[i : i + cfg.batch_size] for i in range(0, len(units), cfg.batch_size)]
    turns = 1 if cfg.context == "last" else cfg.max_turns

    def shard_path(i: int) -> Path:
        return root / f"part-{i:05d}-of-{len(shards[i])}.jsonl"

    todo = [i for i in range(len(shards)) if not shard_path(i).is_file()]
    bar = None
    if todo:
        from tqdm import tqdm

        log(f"[regenerate] {len(units)} {'conversations' if cfg.context == 'all' else 'prompts'} in {len(shards)} "
            f"batches of {cfg.batch_size} ({len(shards) - len(todo)} already cached in {root})")
        bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc="regenerate", dynamic_ncols=True)
    tokens_before, elapsed = getattr(generate, "tokens_generated", 0), 0.0
    for i in todo:
        t0 = time.perf_counter()
        # Seeded by shard, not by call order: a resumed run samples exactly what an uninterrupted one would.
        torch.manual_seed(cfg.seed * 1_000_003 + i)
        rebuilt, empty = _regenerate_batch(shards[i], generate, turns)
        elapsed += time.perf_counter() - t0
        path = shard_path(i)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in rebuilt)
                       + json.dumps({"_empty_answers": empty}) + "\n")
        os.replace(tmp, path)  # a killed run never leaves a half-written shard behind
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    out, empty_total = [], 0
    for i in range(len(shards)):
        for line in shard_path(i).read_text().splitlines():
            row = json.loads(line)
            if "_empty_answers" in row:
                empty_total += row["_empty_answers"]
            else:
                out.append(row["messages"])
    stats = {"regenerated": len(out), "empty_answers": empty_total, "cache": str(root)}
    if todo and elapsed > 0 and hasattr(generate, "tokens_generated"):
        stats["generated_tokens"] = generate.tokens_generated - tokens_before
        stats["generated_tokens_per_s"] = stats["generated_tokens"] / elapsed
        stats["seconds"] = elapsed
    return out, stats
