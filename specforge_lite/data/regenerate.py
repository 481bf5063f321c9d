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
import time
from pathlib import Path
from collections import deque
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch

from ..config import GenerationConfig, cache_dir
from ..files import write_jsonl

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


class PromptQueue:
    """Prompts waiting for the target: ``(key, prompt, seed)``, the prompt a conversation to answer or a
    text to continue as it is (self-generated requests). A follow-up turn is pushed to the front,
    so conversations, and the shards they belong to, finish in order."""

    def __init__(self):
        self._items: deque = deque()

    def push(self, key: Any, messages: Messages, seed: int, first: bool = False) -> None:
        (self._items.appendleft if first else self._items.append)((key, messages, seed))

    def pop(self) -> tuple[Any, Messages, int]:
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


@runtime_checkable
class AnswerStream(Protocol):
    """A generator of the target's answers: ``stream(queue)`` yields ``(key, answer)`` as answers finish,
    taking prompts from the queue as it has room (prompts pushed meanwhile included), until it is empty."""

    def stream(self, queue: PromptQueue) -> Iterator[tuple[Any, str]]: ...


class BatchedAnswers:
    """A plain ``generate(list of conversations) -> answers`` as an AnswerStream: ``batch_size`` prompts per
    call, in queue order, torch's generator seeded from the first prompt of each call."""

    def __init__(self, generate: Generate, batch_size: int):
        self.generate, self.batch_size = generate, batch_size

    def counters(self) -> dict:
        return counters(self.generate)

    def stream(self, queue: PromptQueue) -> Iterator[tuple[Any, str]]:
        while len(queue):
            batch = [queue.pop() for _ in range(min(self.batch_size, len(queue)))]
            torch.manual_seed(batch[0][2])
            yield from zip((key for key, _, _ in batch), self.generate([messages for _, messages, _ in batch]))


# What a generator may count: answer tokens (stop token included), decode row-steps computed (answers plus
# rows that had already stopped), prompt tokens and the padding added to them.
COUNTERS = ("tokens_generated", "decode_rows", "prompt_tokens", "prompt_pad_tokens")


def counters(generator: Any) -> dict:
    if hasattr(generator, "counters"):
        return generator.counters()
    return {k: getattr(generator, k) for k in COUNTERS if hasattr(generator, k)}


def compute_shares(done: dict) -> dict:
    """Tokens generated and the shares of compute spent on padding or past the end of an answer."""
    out = {"generated_tokens": done.get("tokens_generated", 0)}
    if done.get("decode_rows"):
        out["decode_past_end_share"] = 1 - done["tokens_generated"] / done["decode_rows"]
    if done.get("prompt_tokens"):
        out["prompt_padding_share"] = done["prompt_pad_tokens"] / (done["prompt_tokens"] + done["prompt_pad_tokens"])
    return out


def answer_stream(generate: Generate | AnswerStream, batch_size: int) -> AnswerStream:
    return generate if isinstance(generate, AnswerStream) else BatchedAnswers(generate, batch_size)


class ConversationJob:
    """One conversation being rebuilt: its assistant turns replaced in order by the target's answers."""

    def __init__(self, source: Messages, max_turns: int | None):
        self.source, self.max_turns = source, max_turns
        self.done: Messages = []
        self.cursor = self.turns = 0  # index in the source conversation; answers taken
        self.empty = False  # an answer came back empty: the conversation ends at its last good turn

    def next_prompt(self) -> Messages | None:
        """The conversation so far, ready for the next answer; None when there is nothing left to answer."""
        if self.empty:
            return None
        while self.cursor < len(self.source) and self.source[self.cursor]["role"] != "assistant":
            self.done.append(self.source[self.cursor])
            self.cursor += 1
        if self.cursor < len(self.source) and (self.max_turns is None or self.turns < self.max_turns):
            return list(self.done)
        return None

    def take(self, answer: str) -> None:
        if not answer:
            self.empty = True
            return
        self.done.append({"role": "assistant", "content": answer})
        self.cursor += 1
        self.turns += 1

    def result(self) -> Messages | None:
        """The rebuilt conversation, ending on an answer (None if it holds no answer)."""
        conv = list(self.done)
        while conv and conv[-1]["role"] != "assistant":
            conv.pop()
        return conv if any(m["role"] == "assistant" for m in conv) else None


def _write_shard(path: Path, jobs: list[ConversationJob]) -> None:
    rebuilt = [{"messages": c} for c in (job.result() for job in jobs) if c is not None]
    write_jsonl(path, rebuilt + [{"_empty_answers": sum(job.empty for job in jobs)}])


def regenerate(conversations: list[Messages], generate: Generate | AnswerStream, cfg: GenerationConfig, key: str,
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
    stream = answer_stream(generate, cfg.batch_size)
    before, t0 = counters(stream), time.perf_counter()
    # Every unfinished shard's conversations go through one stream: the generator keeps its batch full
    # across shard boundaries, and each shard is written (atomically) the moment its last answer is in.
    jobs = {(i, j): ConversationJob(unit, turns) for i in todo for j, unit in enumerate(shards[i])}
    left = {i: len(shards[i]) for i in todo}
    queue = PromptQueue()

    def advance(key) -> None:
        prompt = jobs[key].next_prompt()
        if prompt is not None:
            i, j = key
            # Seeded per conversation and turn, not by call order: a resumed run samples what an
            # uninterrupted one would.
            queue.push(key, prompt, cfg.seed * 1_000_003 + i * 10_007 + j * 101 + jobs[key].turns, first=True)
            return
        i = key[0]
        left[i] -= 1
        if left[i] == 0:
            _write_shard(shard_path(i), [jobs[(i, j)] for j in range(len(shards[i]))])
            if bar is not None:
                bar.update(1)

    for key in reversed(list(jobs)):  # advance() pushes to the front: reversed, the queue is in shard order
        advance(key)
    for key, answer in stream.stream(queue):
        jobs[key].take(answer)
        advance(key)
    elapsed = time.perf_counter() - t0
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
    if todo and elapsed > 0:
        after = counters(stream)
        stats.update(compute_shares({k: after[k] - before.get(k, 0) for k in after}))
        stats["generated_tokens_per_s"] = stats["generated_tokens"] / elapsed
        stats["seconds"] = elapsed
    return out, stats
