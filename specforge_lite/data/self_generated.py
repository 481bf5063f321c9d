"""User requests written by the target itself (the "Magpie" technique), for training data beyond chit-chat.

An instruct model given only its chat template up to the start of a user turn (the system prompt and the
user-turn opening, nothing else) continues with something a user would plausibly ask. Sampled at a high
temperature, a small model writes explanations, advice, writing tasks, everyday questions, code and
arithmetic requests. Each kept request is then answered by the same model like any training prompt, so
the draft learns the target's voice on the kind of traffic a general assistant serves.

Requests are sampled in shards of ``data.generation.batch_size``, cached atomically under a key of (model,
settings, template prefix), and filtered in order (empty, unfinished, too short, repetitive, duplicate,
not a request), so a run that asks for more requests reuses every shard already made and the kept list
for a smaller count is a prefix of the list for a larger one.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..config import SelfGeneratedConfig, cache_dir
from ..files import write_jsonl
from .regenerate import FailedAnswer, PromptQueue, answer_stream, counters

_MARK = "\u2063SFL-USER-TURN\u2063"  # an invisible separator around a word no template contains
# Openings of a reply, not a request: the model wrote the assistant's side.
_REPLY_OPENINGS = ("sure", "certainly", "of course", "absolutely", "here is", "here's", "here are", "as an ai",
                   "i'm sorry", "i am sorry", "i'm an ai", "i am an ai", "great question", "thank you for")
_MAX_ROUNDS_FACTOR = 4  # candidates tried at most: this many times the requests asked for (plus a shard)


class SelfGenerationError(RuntimeError):
    pass


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template rendered up to where a user's words begin (its default system prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if _MARK not in text:
        raise SelfGenerationError("the chat template does not render a user turn's text; self-generated requests "
                                  "need a template with user turns (set model.chat_template=FILE)")
    return text[: text.index(_MARK)]


def rejection(text: str, n_tokens: int, cfg: SelfGeneratedConfig) -> str | None:
    """Why a sampled request is dropped (None: kept). Duplicates are found by the caller."""
    words = text.split()
    if not words:
        return "empty"
    if n_tokens >= cfg.max_new_tokens - 1:
        return "unfinished (max_new_tokens reached)"
    if len(words) < cfg.min_words:
        return f"shorter than {cfg.min_words} words"
    if "<|" in text or "|>" in text or re.search(r"^(user|assistant|system)\s*:", text, re.I | re.M):
        return "holds chat-template markup"
    lowered = text.lower()
    if lowered.startswith(_REPLY_OPENINGS):
        return "an assistant's reply, not a request"
    trigrams = Counter(zip(words, words[1:], words[2:]))
    if len(words) >= 9 and (trigrams.most_common(1)[0][1] >= 3 or len(set(words)) < 0.5 * len(words)):
        return "repetitive"
    return None


def normalized(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def write_requests(writer: Any, tokenizer: Any, count: int, cfg: SelfGeneratedConfig, model_fingerprint: str,
                   batch_size: int, log=print) -> tuple[list[str], dict]:
    """``count`` filtered requests sampled from ``writer`` (an answer generator whose sampling settings are
    cfg's: data.regenerate.AnswerStream or a batch callable), and stats with the drop reasons."""
    if count <= 0:
        return [], {"requested": 0}
    prefix = user_turn_prefix(tokenizer)
    settings = {k: getattr(cfg, k) for k in ("temperature", "top_p", "max_new_tokens", "seed")}
    key = hashlib.sha256(json.dumps([model_fingerprint, settings, prefix, batch_size]).encode()).hexdigest()[:20]
    root = cache_dir() / "self_generated" / key
    root.mkdir(parents=True, exist_ok=True)
    max_shards = (_MAX_ROUNDS_FACTOR * count) // batch_size + 1
    shards, started, generated = 0, time.perf_counter(), 0
    while True:
        kept, reasons, seen_total = _filter(root, shards, batch_size, tokenizer, cfg)
        if len(kept) >= count or shards >= max_shards:
            break
        # enough new shards for what is missing at the pass rate so far (one at least)
        rate = max(len(kept) / seen_total, 0.2) if seen_total else 0.7
        more = min(max_shards - shards, max(1, -(-int((count - len(kept)) / rate) // batch_size)))
        generated += _sample_shards(writer, root, range(shards, shards + more), prefix, batch_size, cfg.seed, log)
        shards += more
    stats = {"requested": count, "kept": min(len(kept), count), "candidates": seen_total, "dropped": dict(reasons),
             "cache": str(root)}
    if generated:
        seconds = time.perf_counter() - started
        stats.update({"generated_tokens": generated, "seconds": seconds, "generated_tokens_per_s": generated / seconds})
    if len(kept) < count:
        log(f"[self-generated] only {len(kept)} of {count} requests passed the filters after {seen_total} candidates "
            f"({dict(reasons)}); training goes on with what was kept")
    return kept[:count], stats


def _shard_path(root: Path, i: int, batch_size: int) -> Path:
    return root / f"part-{i:05d}-of-{batch_size}.jsonl"


def _filter(root: Path, shards: int, batch_size: int, tokenizer: Any, cfg: SelfGeneratedConfig
            ) -> tuple[list[str], Counter, int]:
    kept, reasons, seen, total = [], Counter(), set(), 0
    for i in range(shards):
        for line in _shard_path(root, i, batch_size).read_text().splitlines():
            row = json.loads(line)
            total += 1
            if "failed" in row:
                reasons["request failed after the retries"] += 1
                continue
            text = row["text"].strip()
            why = rejection(text, len(tokenizer(text, add_special_tokens=False)["input_ids"]), cfg)
            if why is None and normalized(text) in seen:
                why = "duplicate"
            if why is None:
                seen.add(normalized(text))
                kept.append(text)
            else:
                reasons[why] += 1
    return kept, reasons, total


def _sample_shards(writer: Any, root: Path, todo: range, prefix: str, batch_size: int, seed: int, log) -> int:
    """Sample the missing shards of ``todo`` through one stream (each written when complete); tokens made."""
    todo = [i for i in todo if not _shard_path(root, i, batch_size).is_file()]
    if not todo:
        return 0
    log(f"[self-generated] sampling {len(todo) * batch_size} user requests ({len(todo)} shards of {batch_size})")
    stream = answer_stream(writer, batch_size)
    before = counters(stream).get("tokens_generated", 0)
    queue, texts = PromptQueue(), {i: {} for i in todo}
    for i in todo:
        for j in range(batch_size):
            # seeded per request: a resumed or larger run samples the same requests
            queue.push((i, j), prefix, seed * 1_000_003 + i * 10_007 + j)
    for (i, j), text in stream.stream(queue):
        # a request whose sampling failed for good (a serving engine, after its retries) is one candidate fewer,
        # counted by the filter
        texts[i][j] = {"failed": text.reason} if isinstance(text, FailedAnswer) else {"text": text}
        if len(texts[i]) == batch_size:
            write_jsonl(_shard_path(root, i, batch_size), [texts[i][k] for k in range(batch_size)])
    return counters(stream).get("tokens_generated", 0) - before
