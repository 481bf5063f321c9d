"""Train on what the target actually says: rebuild conversations with the target's own answers.

A draft trained on human answers learns how people talk; the served model answers in its own voice.
Here every assistant turn (up to ``max_turns`` per conversation) is replaced by the target's answer:

* ``context=all``: each answer is conditioned on the conversation so far, with the earlier answers
  already regenerated (the EAGLE recipe). Turns are generated in order, batched across conversations.
* ``context=last``: each answer sees only the user turn before it (single-turn samples, fully parallel).

Results are cached under a key of (data, model, settings) in shards written atomically, and every answer of an
unfinished shard is journaled as it arrives, with a digest of the prompt it answered: a killed run resumes without
asking for any answer it was given, a finished one is reused as is, and a larger cap (the next round of a
``max_minutes`` run) reads back the answers of the shorter last shard it extends. A request that fails for good
(a serving engine, after its client's retries) leaves its conversation out, counted and named, and its shard
unwritten: the same call asks for that conversation again (and for no other). Above ``max_failed_fraction`` of the
conversations of a FailureBudget (one run's training and held-out splits together) the run stops.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch

from ..config import GenerationConfig, cache_dir
from ..errors import UserError
from ..files import write_jsonl

Messages = list[dict[str, str]]
Generate = Callable[[list[Messages]], list[str]]


def regeneration_key(source_fingerprint: str, model_fingerprint: str, cfg: GenerationConfig) -> str:
    # max_conversations is not part of the key: shards are prefix-stable, so a larger cap reuses them.
    settings = {k: getattr(cfg, k) for k in ("context", "max_turns", "temperature", "top_p", "max_new_tokens", "seed",
                                             "batch_size")}
    blob = json.dumps([source_fingerprint, model_fingerprint, settings], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def regeneration_units(conversations: list[Messages], cfg: GenerationConfig) -> int:
    """How many conversations (context=all) or prompts (context=last) regenerate() asks for, its cap applied."""
    units = len(_units(conversations, cfg))
    return units if cfg.max_conversations is None else min(units, cfg.max_conversations)


def _units(conversations: list[Messages], cfg: GenerationConfig) -> list[Messages]:
    """What gets regenerated: whole conversations (context=all) or single (user) prompts (context=last)."""
    if cfg.context == "all":
        return conversations
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
    taking prompts from the queue as it has room (prompts pushed meanwhile included), until it is empty. An
    answer is the text, or a FailedAnswer where the request failed for good."""

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
        self.failed: str | None = None  # why a request failed for good: the conversation is left out

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
        """The rebuilt conversation, ending on an answer (None if it holds no answer or failed)."""
        if self.failed:
            return None
        conv = list(self.done)
        while conv and conv[-1]["role"] != "assistant":
            conv.pop()
        return conv if any(m["role"] == "assistant" for m in conv) else None


class RegenerationFailed(UserError):
    """More requests failed for good than data.generation.max_failed_fraction allows."""


class FailureBudget:
    """The conversations whose requests may fail for good across the regenerations of one run: more than
    ``fraction`` of ``total`` (data.prepare: the training and held-out conversations together) stops it. Holds
    the failures so far, of every split, and where each split lists its own."""

    def __init__(self, total: int, fraction: float, shared: bool = False):
        self.total, self.fraction, self.shared = total, fraction, shared
        self.failed: list[dict] = []
        self.files: list[Path] = []

    def over(self) -> bool:
        return len(self.failed) > self.fraction * self.total


@dataclass(frozen=True)
class FailedAnswer:
    """What an answer stream yields for a prompt whose request failed for good (a serving engine, after its
    client's retries): the conversation is left out of this run's data, and a rerun asks for it again."""

    reason: str


def prompt_digest(prompt: Messages | str) -> str:
    """What identifies the prompt an answer was given to, in the journal."""
    return hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:16]


class AnswerJournal:
    """The answers of unfinished shards as they arrive, one JSON line each, appended and flushed at once: a
    killed run keeps every answer it was given. A line cut short (the machine went down while writing) is
    dropped when read back, and that one answer is asked for again."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def read(self) -> dict[tuple[int, int], tuple[str, str | None]]:
        """The answers so far and their prompts' digests by (unit, turn) (a journal written before digests: None).
        A torn last line is cut off, so the next append starts a line."""
        if not self.path.is_file():
            return {}
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            os.truncate(self.path, len(whole))
        answers = {}
        for line in whole.splitlines():
            try:
                row = json.loads(line)
                answers[(row["unit"], row["turn"])] = (row["answer"], row.get("prompt"))
            except (ValueError, KeyError, TypeError):
                continue  # garbled (two writers crashed mid-line): that answer is asked for again
        return answers

    def append(self, unit: int, turn: int, answer: str, prompt: str) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps({"unit": unit, "turn": turn, "answer": answer, "prompt": prompt}) + "\n")
        self._file.flush()

    def keep(self, units: range) -> None:
        """Only these units' answers (rewritten atomically, line by line), or no journal when they have none."""
        self.close()
        if not units or not self.path.is_file():
            self.path.unlink(missing_ok=True)
            return
        staging, kept = self.path.with_suffix(".tmp"), 0
        with open(self.path, encoding="utf-8") as lines, open(staging, "w", encoding="utf-8") as out:
            for line in lines:
                try:
                    if json.loads(line)["unit"] in units:
                        out.write(line)
                        kept += 1
                except (ValueError, KeyError, TypeError):
                    continue
        if kept:
            os.replace(staging, self.path)
        else:
            staging.unlink()
            self.path.unlink()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _opening(messages: Messages, width: int = 40) -> str:
    text = next((m["content"] for m in messages if m["role"] == "user"), "")
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _named(failed: list[dict], shown: int = 5) -> str:
    named = "; ".join(f"{f['split'] + ' ' if 'split' in f else ''}#{f['conversation']} {f['opening']!r} ({f['reason']})"
                      for f in failed[:shown])
    return named + (f"; and {len(failed) - shown} more" if len(failed) > shown else "")


def _write_shard(path: Path, jobs: list[ConversationJob]) -> None:
    rebuilt = [{"messages": c} for c in (job.result() for job in jobs) if c is not None]
    write_jsonl(path, rebuilt + [{"_empty_answers": sum(job.empty for job in jobs)}])


def _read_shard(path: Path) -> tuple[list[Messages], int]:
    conversations, empty = [], 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "_empty_answers" in row:
            empty += row["_empty_answers"]
        else:
            conversations.append(row["messages"])
    return conversations, empty


class _Rebuild:
    """The unfinished shards of one regeneration. Every conversation's prompts go through one answer stream (the
    generator keeps its batch full across shard boundaries); each answer is journaled as it arrives, answers the
    journal already holds are not asked for again, and a shard is written (atomically) the moment its last
    conversation is complete. A conversation whose request failed for good is counted and named, and its shard
    stays unwritten, so that a rerun asks for that conversation alone."""

    def __init__(self, shards: list[list[Messages]], paths: list[Path], todo: list[int], cfg: GenerationConfig,
                 journal: AnswerJournal, budget: FailureBudget, split: str | None = None):
        self.shards, self.paths, self.cfg, self.journal = shards, paths, cfg, journal
        self.budget, self.split = budget, split
        turns = 1 if cfg.context == "last" else cfg.max_turns
        self.jobs = {(i, j): ConversationJob(unit, turns) for i in todo for j, unit in enumerate(shards[i])}
        self.left = {i: len(shards[i]) for i in todo}
        known = journal.read() if todo else {}
        # the answers of shards still to write (the journal also holds those of shards a killed run had written)
        self.known = {(unit, turn): a for (unit, turn), a in known.items() if unit // cfg.batch_size in self.left}
        self.replayed = len(self.known)
        self.answered = 0  # answers the stream gave this call (not those read back from the journal)
        self.stale = 0  # journaled answers given to another prompt than this data's (asked again)
        self.asked: dict[tuple[int, int], str] = {}  # the digest of each conversation's prompt in flight
        self.failed: list[dict] = []
        self.queue = PromptQueue()
        self.bar = None

    def run(self, stream: AnswerStream) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=len(self.shards), initial=len(self.shards) - len(self.left), desc="regenerate",
                        dynamic_ncols=True)
        try:
            for key in reversed(list(self.jobs)):  # advance() pushes to the front: reversed, the queue is in order
                self.advance(key)
            answers = stream.stream(self.queue)
            try:
                for key, answer in answers:
                    self.take(key, answer)
            finally:
                getattr(answers, "close", lambda: None)()  # a stop here ends the requests in flight at once
        finally:
            self.journal.close()
            self.bar.close()
        if not self.failed:  # every shard is written: kept are the answers a larger cap's last shard extends
            last = self.shards[-1]
            partial = len(last) < self.cfg.batch_size
            start = (len(self.shards) - 1) * self.cfg.batch_size
            self.journal.keep(range(start, start + len(last)) if partial else range(0))

    def unit(self, key: tuple[int, int]) -> int:
        return key[0] * self.cfg.batch_size + key[1]

    def advance(self, key: tuple[int, int]) -> None:
        """Queue the conversation's next prompt (answers the journal holds are taken instead), or count it done."""
        job = self.jobs[key]
        while (prompt := job.next_prompt()) is not None:
            answer, asked = self.known.pop((self.unit(key), job.turns), (None, None))
            if answer is not None and asked not in (None, prompt_digest(prompt)):
                answer, self.stale = None, self.stale + 1  # (the data before this turn changed since)
            if answer is None:
                i, j = key
                # Seeded per conversation and turn, not by call order: a resumed run samples what an
                # uninterrupted one would.
                seed = self.cfg.seed * 1_000_003 + i * 10_007 + j * 101 + job.turns
                self.asked[key] = prompt_digest(prompt)
                self.queue.push(key, prompt, seed, first=True)
                return
            job.take(answer)
        self._done(key[0])

    def take(self, key: tuple[int, int], answer: str | FailedAnswer) -> None:
        if isinstance(answer, FailedAnswer):
            self._fail(key, answer.reason)
            self._done(key[0])
            return
        self.journal.append(self.unit(key), self.jobs[key].turns, answer, self.asked[key])
        self.answered += 1
        self.jobs[key].take(answer)
        self.advance(key)

    def _fail(self, key: tuple[int, int], reason: str) -> None:
        job = self.jobs[key]
        job.failed = reason
        failure = {"conversation": self.unit(key), "turn": job.turns, "opening": _opening(job.source),
                   "reason": reason, **({"split": self.split} if self.split else {})}
        self.failed.append(failure)
        budget = self.budget
        budget.failed.append(failure)
        if budget.over():
            self.write_failures()
            both = " (training and held-out together)" if budget.shared else ""
            raise RegenerationFailed(
                f"{len(budget.failed)} of {budget.total} conversations{both} could not be regenerated (their "
                "requests failed after the retries), more than data.generation.max_failed_fraction="
                f"{budget.fraction} allows: {_named(budget.failed)} (all in {' and '.join(map(str, budget.files))})."
                " Check the server (data.generation.server_url) and run the same command: the answers already made "
                f"are kept in {self.journal.path.parent.parent if budget.shared else self.journal.path.parent} and "
                "only the missing ones are asked for")

    def _done(self, i: int) -> None:
        self.left[i] -= 1
        jobs = [self.jobs[(i, j)] for j in range(len(self.shards[i]))]
        if self.left[i] == 0 and not any(job.failed for job in jobs):
            _write_shard(self.paths[i], jobs)
            self.bar.update(1)

    @property
    def failures_path(self) -> Path:
        return self.journal.path.parent / "failed.jsonl"

    def write_failures(self) -> None:
        write_jsonl(self.failures_path, self.failed)
        if self.failures_path not in self.budget.files:
            self.budget.files.append(self.failures_path)

    def unwritten(self, i: int) -> tuple[list[Messages], int]:
        """A shard left unwritten by a failure: its conversations that are complete, and its empty answers."""
        jobs = [self.jobs[(i, j)] for j in range(len(self.shards[i]))]
        return [c for c in (job.result() for job in jobs) if c is not None], sum(
            job.empty and not job.failed for job in jobs)


def regenerate(conversations: list[Messages], generate: Generate | AnswerStream, cfg: GenerationConfig, key: str,
               log=print, split: str | None = None, budget: FailureBudget | None = None) -> tuple[list[Messages], dict]:
    """The conversations with the target's answers (those whose request failed for good left out, and asked for
    again by the next call), and the stats. ``split`` names them in the failures (train, held-out); ``budget``:
    the failures allowed across this call and others (data.prepare: both splits), else this call's own share."""
    units = _units(conversations, cfg)
    if cfg.max_conversations is not None:
        units = units[: cfg.max_conversations]
    root = cache_dir() / "regenerated" / key
    root.mkdir(parents=True, exist_ok=True)
    shards = [units[i : i + cfg.batch_size] for i in range(0, len(units), cfg.batch_size)]
    paths = [root / f"part-{i:05d}-of-{len(shard)}.jsonl" for i, shard in enumerate(shards)]
    todo = [i for i, path in enumerate(paths) if not path.is_file()]
    budget = budget or FailureBudget(len(units), cfg.max_failed_fraction)
    rebuild = _Rebuild(shards, paths, todo, cfg, AnswerJournal(root / "answers.jsonl"), budget, split)
    stream = answer_stream(generate, cfg.batch_size)
    before, t0 = counters(stream), time.perf_counter()
    if todo:
        what = "conversations" if cfg.context == "all" else "prompts"
        resumed = f"; {rebuild.replayed} answers of unfinished batches read back" if rebuild.replayed else ""
        log(f"[regenerate] {len(units)} {what} in {len(shards)} batches of {cfg.batch_size} "
            f"({len(shards) - len(todo)} already cached in {root}{resumed})")
        rebuild.run(stream)
        if rebuild.stale:
            log(f"[regenerate] {rebuild.stale} journaled answers were given to prompts this data no longer holds "
                "(the conversation before them changed): asked again, not reused")
    elapsed = time.perf_counter() - t0
    out, empty_total = [], 0
    for i, path in enumerate(paths):
        conversations, empty = _read_shard(path) if path.is_file() else rebuild.unwritten(i)
        out += conversations
        empty_total += empty
    stats = {"regenerated": len(out), "empty_answers": empty_total, "failed": len(rebuild.failed), "cache": str(root)}
    # the rate a user multiplies by their data size (this call's answers alone), said before the failures' line
    if todo and elapsed > 0:
        after = counters(stream)
        stats.update(compute_shares({k: after[k] - before.get(k, 0) for k in after}))
        stats.update(answers=rebuild.answered, seconds=elapsed, answers_per_s=rebuild.answered / elapsed,
                     generated_tokens_per_s=stats["generated_tokens"] / elapsed)
        tokens = f", {stats['generated_tokens_per_s']:.0f} tokens/s" if stats["generated_tokens"] else ""
        log(f"[regenerate] {rebuild.answered} answers in {elapsed:.1f} s: {stats['answers_per_s']:.2f} answers/s"
            f"{tokens}")
    if rebuild.failed:
        stats["failed_conversations"] = rebuild.failed
        rebuild.write_failures()
        which = f"{split} " if split else ""
        share = f" of all {budget.total} conversations, both splits together," if budget.shared else ""
        log(f"[regenerate] {len(rebuild.failed)} of {len(units)} {which}conversations failed after the retries and "
            f"are left out of this run's data (up to data.generation.max_failed_fraction={cfg.max_failed_fraction}"
            f"{share} may be; the same command asks for them again): {_named(rebuild.failed)} (all in "
            f"{rebuild.failures_path})")
    else:
        rebuild.failures_path.unlink(missing_ok=True)
    return out, stats
