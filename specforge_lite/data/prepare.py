"""The sources' rows -> tokenised training and held-out sets (cached by content), with the rows skipped counted."""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import DataConfig, GenerationConfig, MixSource, cache_dir
from ..files import write_folder_then_rename
from .chat import given_prompt, prompt_ids, tokenize_samples
from .errors import DataError, MalformedRow
from .formats import conversation_images, is_pretokenized
from .images import ImageInputs
from .readers import is_hub_id, source_files, source_name
from .regenerate import FailureBudget, regenerate, regeneration_key, regeneration_units
from .sources import (SELF_GENERATED, SourceRows, check_malformed, data_file, mix_conversations, mix_sources,
                      read_sources)

_PREP_VERSION = "5"  # bump when tokenisation or masking changes, so stale caches are not reused
_HELDOUT_SEED = 1234  # fixed: the held-out split does not move with trainer.seed


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset with input_ids, loss_mask
    heldout: Any  # datasets.Dataset with input_ids, loss_mask
    heldout_prompts: list[list[int]]  # token ids up to each held-out conversation's first answer
    stats: dict = field(default_factory=dict)
    heldout_prompt_images: list[list[str]] = field(default_factory=list)  # image files of each prompt

    def prompt_images(self, i: int) -> list[str]:
        return self.heldout_prompt_images[i] if i < len(self.heldout_prompt_images) else []


def check_rows(cfg: DataConfig, tokenizer: Any, log=print) -> None:
    """Every row of the file sources read and rendered through the chat template with the tokenizer alone, before
    any of the target's weights load: a file too damaged to train on is refused here, not after minutes of loading
    a large target, and the rows skipped are counted. What is read is kept for ``prepare_data`` (each row read
    once). Nothing to do where data prepared from the same files with the same tokenizer is cached."""
    sources = mix_sources(cfg)
    files = {i: data_file(src) for i, src in enumerate(sources) if src.source != SELF_GENERATED}
    if not files:
        return
    source_key = _fingerprint(list(files.values()), tokenizer, cfg)
    if any(_complete(folder) for folder in (cache_dir() / "prepared").glob(source_key + "*")):
        return
    read = _READ_BEFORE_TARGET[source_key] = read_sources(files, sources, cfg, tokenizer, None)
    skipped = ", ".join(f"{n}x {reason}" for reason, n in read.reasons.most_common(3))
    log(f"[data] read before the target loads: {read.rows} rows, {sum(read.reasons.values())} skipped"
        + (f" ({skipped})" if skipped else ""))


# check_rows's reading of each source key, taken once by prepare_data
_READ_BEFORE_TARGET: dict[str, SourceRows] = {}
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


def _fingerprint(paths: list[Path | str], tokenizer: Any, cfg: DataConfig, images: ImageInputs | None = None) -> str:
    h = hashlib.sha256()
    for path in paths:
        for f in source_files(path):
            h.update(str(f.name).encode())
            try:
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
            except OSError as e:  # (reading its rows counts it as a skipped file, with the reason)
                h.update(str(e).encode())
        if images is not None and not is_hub_id(path):  # token counts follow image sizes and the processor
            folder = path if path.is_dir() else path.parent
            for f in sorted(p for p in folder.rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES):
                try:
                    st = f.stat()
                    h.update(f"{f.relative_to(folder)}|{st.st_size}|{st.st_mtime_ns}".encode())
                except OSError as e:  # (a dangling or looping link: the row naming it is skipped, with the reason)
                    h.update(str(e).encode())
    if images is not None:
        h.update(images.processor.to_json_string().encode())
    tok_state = json.dumps([tokenizer.name_or_path, len(tokenizer), tokenizer.chat_template,
                            tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), 4096))))])
    h.update(tok_state.encode())
    h.update(json.dumps([_PREP_VERSION, cfg.max_length, cfg.heldout_samples, cfg.max_samples]).encode())
    if cfg.loss_turns != "all":  # (keys made before the option existed stay valid)
        h.update(f"loss_turns={cfg.loss_turns}".encode())
    if cfg.images_outside_folder:
        h.update(b"images_outside_folder")
    if cfg.source == "mix":  # the mix's composition, and how self-generated requests are sampled
        h.update(json.dumps([[m.source, m.path, m.weight] + ([m.regenerate] if m.regenerate is not None else [])
                             for m in cfg.mix], sort_keys=True).encode())
        h.update(json.dumps(vars(cfg.self_generated), sort_keys=True).encode())
    # (regeneration settings are keyed separately, see regenerate.regeneration_key)
    return h.hexdigest()[:20]


def opening(messages: list[dict[str, str]]) -> str:
    """A conversation's first user turn, normalised: what an evaluation prompt is made of (a pre-tokenized row:
    its ids before the first one in the loss)."""
    if is_pretokenized(messages):
        return "ids:" + " ".join(map(str, given_prompt(messages[0])))
    first = next((m for m in messages if m["role"] == "user"), {"content": ""})
    # the same question about another image is another prompt
    return " ".join(first["content"].lower().split()) + "|".join(first.get("images") or [])


def prepare_data(cfg: DataConfig, tokenizer: Any, generate=None, model_fingerprint: str = "", log=print,
                 images: ImageInputs | None = None, request_writer=None) -> PreparedData:
    """Read, split, check, optionally regenerate with the target, tokenise; cached by content.

    ``generate`` (the target's answers: data.regenerate.AnswerStream or a batch callable) is required when
    ``cfg.regenerate`` is set; ``request_writer`` (the same, sampling as data.self_generated says) when the
    mix holds self_generated. ``images``: how a vision target takes images (None: conversations with images
    are skipped and counted).
    """
    sources = mix_sources(cfg)
    if len(sources) < len(cfg.mix):
        log(f"[data] data.mix's {SELF_GENERATED} requests left out: only the target answers them "
            "(data.regenerate=false)")
    files = {i: data_file(src) for i, src in enumerate(sources) if src.source != SELF_GENERATED}
    source_key = _fingerprint(list(files.values()), tokenizer, cfg, images)
    regen_key = regeneration_key(source_key, model_fingerprint, cfg.generation) if cfg.regenerate else None
    # (the regenerated answers' key leaves the cap out, as a larger cap reuses them; the prepared data holds
    # as many conversations as the cap allows, so its folder names the cap)
    def prepared(cap: int | None) -> Path:  # the prepared data's folder, holding up to ``cap`` conversations
        return cache_dir() / "prepared" / (source_key + (f"-regen-{regen_key}" if regen_key else "")
                                           + (f"-n{cap}" if regen_key and cap is not None else ""))

    done = prepared(cfg.generation.max_conversations)
    if _complete(done):
        try:
            return _load_prepared(done)
        except (OSError, ValueError) as e:  # (cut short on disk: pyarrow's and json's errors are ValueErrors)
            log(f"[data] the prepared data in {done} does not read ({' '.join(str(e).split())[:200]}): prepared "
                "again")
            _discard(done)
    if _other_rank() and (_incomplete(done) / "stats.json").is_file():
        return _load_prepared(_incomplete(done))  # what rank 0 made just now, its failed conversations left out

    read = _READ_BEFORE_TARGET.pop(source_key, None) or read_sources(files, sources, cfg, tokenizer, images)
    pools, heldout_read = _split_heldout(read.usable, sources, cfg)
    overlap = _drop_heldout_openings(pools, heldout_read)
    prompts, prompt_images = _heldout_prompts(heldout_read, tokenizer, images)
    path = next(iter(files.values()))
    stats: dict = {"file": str(path), "rows": read.rows, "conversations": read.conversations,
                   "heldout_overlap_removed": overlap}
    train_convs, heldout_convs, cap, made = _answered(pools, heldout_read, read.as_written, sources, cfg, tokenizer,
                                                      generate, request_writer, model_fingerprint, regen_key, log)
    stats.update(made)
    train, train_err = _tokenized(train_convs, cfg, tokenizer, images)
    heldout, held_err = _tokenized(heldout_convs, cfg, tokenizer, images)
    read.reasons.update(train_err)
    read.reasons.update(held_err)
    # rows lost after parsing (a prompt too long, no answer within max_length, a template that renders the
    # turns otherwise) count against the same threshold as unparsable ones: a wrong template must not
    # silently drop most of the data
    check_malformed(read.rows, read.reasons, cfg, path, read.first_at, "could not be used")
    if len(train) == 0:
        raise DataError(
            f"no usable training conversations in {path} after filtering ({dict(read.reasons)}; {overlap} shared an "
            f"opening with a held-out prompt); check the row shapes (docs/data.md) and "
            f"data.max_length={cfg.max_length}"
        )
    stats.update(_split_stats(train, heldout, read))
    regen = stats.get("regeneration") or {}
    cached = prepared(cap)
    if regen.get("failed_total"):
        # conversations missing: never published under the key the next run takes as complete (it would never ask
        # for them again), but apart, replacing the last such data
        cached = _incomplete(cached)
        _discard(cached)
    elif cached.exists() and not _complete(cached):  # (published by an earlier version with conversations missing)
        _discard(cached)
    _publish(cached, train, heldout, prompts, prompt_images, stats)
    if not regen.get("failed_total"):
        _discard(_incomplete(cached))
    skipped = sum(read.reasons.values())
    names = ", ".join(f"{k}: {v}" for k, v in stats["mix"].items()) if "mix" in stats else source_name(path)
    log(f"[data] {names}: {len(train)} train / {len(heldout)} held-out conversations, {stats['train_tokens']} "
        f"train tokens; {overlap} training conversations dropped for sharing an opening with a held-out prompt"
        + (f"; skipped {skipped}: {dict(read.reasons)}" if skipped else "") + _lost(regen, cached))
    return _load_prepared(cached)


def _lost(regen: dict, cached: Path) -> str:
    """What the [data] line says of the conversations whose requests failed for good (nothing when none did)."""
    if not regen.get("failed_total"):
        return ""
    parts = [f"{n} {split}" for n, split in ((regen["failed"], "training"), (regen["heldout"]["failed"], "held-out"))
             if n]
    many = regen["failed_total"] > 1
    return (f"; {' and '.join(parts)} conversation{'s' if many else ''} left out after failed requests (named "
            f"above): this data is kept apart as incomplete in {cached}, and the same command asks for "
            f"{'them' if many else 'it'} again")


def _incomplete(folder: Path) -> Path:
    """Where prepared data with conversations missing (their requests failed for good) is kept: a name no run
    looks up as complete data (only another rank of the run that made it reads it)."""
    return folder.with_name(folder.name + "-incomplete")


def _complete(folder: Path) -> bool:
    """Prepared data there, every conversation it asked the target for answered (a stats.json that does not read:
    not, and prepared again in its place)."""
    try:
        stats = json.loads((folder / "stats.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stats, dict) and not (stats.get("regeneration") or {}).get("failed")


def _other_rank() -> bool:
    """A distributed run's rank other than 0: run.py has it prepare the data once rank 0 has (and read rank 0's)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def _discard(folder: Path) -> None:
    """A published folder moved out of the way at once (a rename), then deleted."""
    import os
    import shutil

    if not folder.exists():
        return
    aside = folder.with_name(f".{folder.name}.old-{os.getpid()}-{time.monotonic_ns()}")
    try:
        folder.rename(aside)
    except OSError:
        return  # (another process moved it first)
    shutil.rmtree(aside, ignore_errors=True)


def _answered(pools: dict[int, list], heldout_read: list, as_written: set[int], sources: list[MixSource],
              cfg: DataConfig, tokenizer: Any, generate, request_writer, model_fingerprint: str, regen_key: str | None,
              log) -> tuple[list, list, int | None, dict]:
    """The training and held-out conversations, with the target's answers where data.regenerate is on (in rounds
    while data.generation.max_minutes has time for another); how many training conversations were asked for (the
    prepared data's cap); the mix's and the regeneration's stats."""
    caps = _rounds(cfg.generation) if cfg.regenerate else [cfg.generation.max_conversations]
    first = time.perf_counter()
    made = Counter()  # the training answers every round made, and their time
    for n, cap in enumerate(caps):
        started = time.perf_counter()
        round_cfg = replace(cfg, generation=replace(cfg.generation, max_conversations=cap))
        train, stats = mix_conversations(pools, sources, round_cfg, tokenizer, request_writer, model_fingerprint,
                                         log)
        heldout = heldout_read
        if cfg.regenerate:
            train, heldout, stats["regeneration"] = _regenerate_answers(
                train, heldout, as_written, generate, round_cfg, regen_key, log)
            made.update({k: stats["regeneration"].get(k, 0) for k in ("answers", "seconds", "generated_tokens")})
        now = time.perf_counter()
        if n + 1 == len(caps) or not _another_round(cfg.generation, cap, now - first, now - started, log):
            break
    if len(caps) > 1:
        stats["regeneration"]["rounds"] = n + 1
        if made["seconds"]:
            stats["regeneration"].update(made, answers_per_s=made["answers"] / made["seconds"],
                                         generated_tokens_per_s=made["generated_tokens"] / made["seconds"])
    return train, heldout, cap, stats


def _rounds(gen: GenerationConfig) -> list[int]:
    """How many training conversations each round of regeneration answers (data.generation.round_conversations
    more each round, up to max_conversations); one round, of max_conversations, without a time budget."""
    if gen.max_minutes is None:
        return [gen.max_conversations]
    steps = range(gen.round_conversations, gen.max_conversations, gen.round_conversations)
    return [*steps, gen.max_conversations]


def _another_round(gen: GenerationConfig, done: int, spent: float, last: float, log) -> bool:
    """Whether the next round fits: the rounds so far (``spent`` seconds) and one more as long as the last fit
    within data.generation.max_minutes. Said in one line when it does not."""
    if spent + last <= 60 * gen.max_minutes:
        return True
    log(f"[regenerate] {done} of data.generation.max_conversations={gen.max_conversations} conversations answered: "
        f"another round of {gen.round_conversations} would end past data.generation.max_minutes={gen.max_minutes} "
        f"(this round took {last / 60:.1f} min); the answers stay cached, and the next run with these settings "
        "goes on from here")
    return False


def _load_prepared(cached: Path) -> PreparedData:
    """The prepared data that ``_publish`` wrote into ``cached``."""
    import datasets

    return PreparedData(datasets.load_from_disk(str(cached / "train")),
                        datasets.load_from_disk(str(cached / "heldout")),
                        json.loads((cached / "heldout_prompts.json").read_text()),
                        json.loads((cached / "stats.json").read_text()),
                        json.loads((cached / "heldout_prompt_images.json").read_text()))


def _split_heldout(usable: dict[int, list], sources: list[MixSource], cfg: DataConfig) -> tuple[dict[int, list], list]:
    """Each file source's training pool and the held-out conversations of all: from each source a share of
    data.heldout_samples (by its weight, in a fixed order), the rest its pool."""
    pools, heldout = {}, []
    file_weight = sum(sources[i].weight for i in usable)
    for i, fits in usable.items():
        order = list(range(len(fits)))
        random.Random(_HELDOUT_SEED).shuffle(order)
        n_held = min(round(cfg.heldout_samples * sources[i].weight / file_weight), len(order) // 2)
        heldout += [fits[j] for j in order[:n_held]]
        pools[i] = [fits[j] for j in order[n_held:]]
    return pools, heldout


def _drop_heldout_openings(pools: dict[int, list], heldout: list) -> int:
    """Evaluation prompts are held-out openings: no training conversation may start the same way (chit-chat
    repeats "hi"-style openings, and a greedy target answers them identically). How many were dropped."""
    held_openings = {opening(c) for c in heldout}
    overlap = 0
    for i, pool in pools.items():
        pools[i] = [c for c in pool if opening(c) not in held_openings]
        overlap += len(pool) - len(pools[i])
    return overlap


def _heldout_prompts(heldout: list, tokenizer: Any, images: ImageInputs | None) -> tuple[list, list]:
    """The token ids (and image files) of each held-out conversation up to its first answer."""
    prompts, prompt_images = [], []
    for c in heldout:
        try:
            ids, paths = prompt_ids(tokenizer, c, images)
        except MalformedRow:
            continue  # an image prompt for a text-only target: counted when its sample is skipped
        prompts.append(ids), prompt_images.append(paths)
    return prompts, prompt_images


def _regenerate_answers(train_convs: list, heldout_convs: list, as_written: set[int], generate, cfg: DataConfig,
                        regen_key: str, log) -> tuple[list, list, dict]:
    """Both splits with the target's own answers, and the regeneration's stats. Answers to image turns keep the
    dataset's text (the generator takes text prompts only), a source with regenerate: false keeps its own, and
    pre-tokenized rows (no text to answer) are kept as given."""
    if generate is None:
        raise ValueError("data.regenerate=true needs the target to generate answers (pass generate=...)")
    keep = lambda c: bool(conversation_images(c)) or id(c) in as_written or is_pretokenized(c)  # noqa: E731
    gen = cfg.generation
    train_convs, kept = _regenerated_first(train_convs, keep)
    heldout_convs, held_kept = _regenerated_first(heldout_convs, keep)
    train_asked, held_asked = train_convs[: len(train_convs) - kept], heldout_convs[: len(heldout_convs) - held_kept]
    # one share of failures for both splits: a held-out failure counts among every conversation asked for
    budget = FailureBudget(regeneration_units(train_asked, gen) + regeneration_units(held_asked, gen),
                           gen.max_failed_fraction, shared=True)
    train_text, regen_stats = regenerate(train_asked, generate, gen, regen_key + "-train", log=log, split="training",
                                         budget=budget)
    train_convs = train_text + train_convs[len(train_asked):]
    held_text, held_stats = regenerate(held_asked, generate, gen, regen_key + "-heldout", log=log, split="held-out",
                                       budget=budget)
    heldout_convs = held_text + heldout_convs[len(held_asked):]
    heldout = {k: held_stats[k] for k in ("regenerated", "empty_answers", "failed", "failed_conversations", "cache")
               if k in held_stats}
    stats = {**regen_stats, "heldout": heldout, "failed_total": regen_stats["failed"] + held_stats["failed"],
             "image_conversations_kept_as_is": sum(bool(conversation_images(c)) for c in train_convs),
             "answers_kept_as_written": sum(id(c) in as_written for c in train_convs)}
    return train_convs, heldout_convs, stats


def _tokenized(convs: list, cfg: DataConfig, tokenizer: Any, images: ImageInputs | None) -> tuple[Any, Counter]:
    """The conversations as training samples (a datasets.Dataset of input_ids, loss_mask, images), and the
    reasons the ones that could not be tokenised were skipped."""
    import datasets

    if not convs:  # (typed: an untyped empty dataset cannot be read back from disk)
        return datasets.Dataset.from_dict({"input_ids": [], "loss_mask": [], "images": []},
                                          features=_sample_features()), Counter()

    def tokenize(batch):
        out = {"input_ids": [], "loss_mask": [], "images": [], "error": []}
        for text in batch["conversation"]:
            messages = json.loads(text)
            try:
                for ids, mask, paths in tokenize_samples(tokenizer, messages, cfg.max_length, images,
                                                         cfg.loss_turns):
                    out["input_ids"].append(ids), out["loss_mask"].append(mask), out["images"].append(paths)
                    out["error"].append("")
            except MalformedRow as e:
                out["input_ids"].append([]), out["loss_mask"].append([]), out["images"].append([])
                out["error"].append(str(e))
        return out

    # as JSON text: Arrow would give every turn the fields of all (tool_calls: null on a user turn), and
    # templates test whether a field is there
    ds = datasets.Dataset.from_dict({"conversation": [json.dumps(c) for c in convs]})
    ds = ds.map(tokenize, batched=True, remove_columns=["conversation"],
                num_proc=cfg.num_proc if cfg.num_proc > 1 else None, desc="tokenising")
    errors = Counter(e for e in ds["error"] if e)
    return ds.filter(lambda e: not e, input_columns="error").remove_columns("error"), errors


def _split_stats(train, heldout, read: SourceRows) -> dict:
    return {"train": len(train), "heldout": len(heldout), "train_tokens": sum(len(x) for x in train["input_ids"]),
            "train_loss_tokens": sum(sum(m) for m in train["loss_mask"]),
            "train_images": sum(len(x) for x in train["images"]), "skipped": dict(read.reasons),
            "skipped_first_at": {r: read.first_at[r] for r in read.reasons if r in read.first_at}}


def _publish(cached: Path, train, heldout, prompts: list, prompt_images: list, stats: dict) -> None:
    """Write the prepared data into a folder of this writer's own and rename it into the cache once it reads back
    (``write_folder_then_rename``: another run preparing the same data at once never touches these files)."""
    import datasets

    def write(tmp: Path) -> None:
        for name, split in (("train", train), ("heldout", heldout)):
            # datasets writes an empty split as no shard at all, which it then cannot read back: ask for one
            split.save_to_disk(str(tmp / name), num_shards=1 if len(split) == 0 else None)
        (tmp / "heldout_prompts.json").write_text(json.dumps(prompts))
        (tmp / "heldout_prompt_images.json").write_text(json.dumps(prompt_images))
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
        for split in ("train", "heldout"):  # only data that reads back is published to the cache
            datasets.load_from_disk(str(tmp / split))

    write_folder_then_rename(cached, write)


def _sample_features():
    """The columns of a tokenised sample."""
    import datasets

    ints, paths = datasets.Sequence(datasets.Value("int64")), datasets.Sequence(datasets.Value("string"))
    return datasets.Features({"input_ids": ints, "loss_mask": ints, "images": paths})


def _regenerated_first(convs: list, keep) -> tuple[list, int]:
    """The conversations to regenerate first (order kept), then those that ``keep`` as they are; and how
    many are kept."""
    kept = [c for c in convs if keep(c)]
    return [c for c in convs if not keep(c)] + kept, len(kept)


