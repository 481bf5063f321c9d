"""The data's sources: which there are (one file, a folder or a hub dataset, the built-in sets, a mix by weight,
requests the target writes itself), their settings checked, and each file source's rows read and checked
through the tokenizer's chat template before any of the target's weights load."""

from __future__ import annotations

import hashlib
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DataConfig, MixSource, cache_dir
from .builtin import chitchat_path, shapes_path
from .chat import check_renderable, prompt_ids
from .errors import DataError, MalformedRow
from .formats import normalize_conversation
from .images import ImageInputs
from .readers import SUFFIXES, hub_dataset, is_hub_id, iter_rows
from .self_generated import write_requests

SELF_GENERATED = "self_generated"
PATH_SOURCES = ("path", "jsonl", "file")


def mix_sources(cfg: DataConfig) -> list[MixSource]:
    """The data's sources: data.mix for data.source=mix, else data.source alone. Without regeneration a mix's
    self_generated requests have no answers, so they are left out (``describe_recipe`` says so)."""
    if cfg.source != "mix":
        return [MixSource(cfg.source, cfg.path, 1.0)]
    if not cfg.mix:
        raise DataError("data.source=mix needs data.mix, e.g. data.mix='[{source: builtin_chitchat, weight: 1}, "
                        "{source: self_generated, weight: 1}]'")
    for m in cfg.mix:
        if m.weight <= 0:
            raise DataError(f"data.mix: the weight of {m.source} is {m.weight}; weights must be positive")
        if m.source == "mix":
            raise DataError("data.mix cannot hold another mix")
    if all(m.source == SELF_GENERATED for m in cfg.mix):
        raise DataError("data.mix holds only self_generated: add a file source (its held-out conversations are the "
                        "evaluation's held-out prompts), e.g. {source: builtin_chitchat, weight: 1}")
    if any(m.source == SELF_GENERATED and m.regenerate is False for m in cfg.mix):
        raise DataError("data.mix: self_generated with regenerate: false would train on empty answers; drop "
                        "regenerate from that source")
    return [m for m in cfg.mix if cfg.regenerate or m.source != SELF_GENERATED]


def data_setting_problems(cfg: DataConfig) -> list[str]:
    """Data settings no run would read (said before anything runs, with the fix)."""
    problems = []
    if cfg.path is not None and cfg.source not in PATH_SOURCES:
        problems.append(f"data.path={cfg.path} is read only with data.source=path, and data.source is {cfg.source}: "
                        f"use data=sharegpt data.path={cfg.path}"
                        + (" (or add {source: path, path: ...} to data.mix)" if cfg.source == "mix" else ""))
    if cfg.source != "offline":
        store = {"data.store": cfg.store, "data.store_order": None if cfg.store_order == "global" else cfg.store_order}
        problems += [f"{key}={value} is read only with data.source=offline, and data.source is {cfg.source}: add "
                     f"data.source=offline, or drop {key}" for key, value in store.items() if value is not None]
    gen = cfg.generation
    if gen.engine != "openai":
        problems += [f"data.generation.{key}={value} is read by data.generation.engine=openai only ({gen.engine} "
                     f"answers in-process): set data.generation.engine=openai, or drop data.generation.{key}"
                     for key, value in (("server_url", gen.server_url), ("server_model", gen.server_model)) if value]
    if (gen.round_conversations is None) != (gen.max_minutes is None):
        given, missing = ("round_conversations", "max_minutes") if gen.max_minutes is None else \
            ("max_minutes", "round_conversations")
        problems.append(f"data.generation.{given} is read only together with data.generation.{missing} (rounds of "
                        f"answers while there is time): set both, or neither")
    elif cfg.regenerate and gen.max_minutes is not None and gen.max_conversations is None:
        # (without regeneration there are no rounds: the recipe's round settings are not read)
        problems.append("data.generation.max_minutes answers the training conversations in rounds up to "
                        "data.generation.max_conversations: set data.generation.max_conversations (the most a run "
                        "may take)")
    return problems


def data_file(cfg: DataConfig | MixSource) -> Path | str:
    """Where a source's rows are: a file or folder, or a hub dataset's id (``hf:org/name[:split]``)."""
    if cfg.source == "builtin_chitchat":
        return chitchat_path()
    if cfg.source == "builtin_shapes":
        return shapes_path()
    if cfg.source in PATH_SOURCES:
        if not cfg.path:
            raise DataError(f"data.source={cfg.source} needs data.path=/path/to/data.jsonl")
        if is_hub_id(cfg.path):
            hub_dataset(cfg.path)  # (loaded, or refused with the reason, before the target is built)
            return cfg.path
        path = Path(cfg.path).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data.path={str(path)!r} does not exist; give a file ({', '.join(SUFFIXES)}) or a folder of them, "
                "a folder saved with datasets' save_to_disk, or a hub dataset as hf:org/name[:split]; or "
                "data.source=builtin_chitchat")
        return _read_once(path)
    raise DataError(f"data.source={cfg.source!r}: use builtin_chitchat, builtin_shapes (image conversations, for "
                    "vision targets), path (with data.path=...) or mix (with data.mix=...; its sources may also be "
                    "self_generated)")


_PIPED: dict[str, Path] = {}


def _read_once(path: Path) -> Path:
    """A pipe (data.path=/dev/stdin, a process substitution such as <(zcat chats.jsonl.gz)) can be read once, and
    the data is read more than once (its fingerprint, then its rows): its bytes are kept in a file of the
    cache, read from there. A regular file or a folder is read where it is."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return path
    if str(path) not in _PIPED:
        data = path.read_bytes()
        suffix = ".json" if data.lstrip()[:1] == b"[" else ".jsonl"
        copy = cache_dir() / "piped" / f"{hashlib.sha256(data).hexdigest()[:20]}{suffix}"
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(data)
        _PIPED[str(path)] = copy
    return _PIPED[str(path)]


def check_data_sources(cfg: DataConfig) -> None:
    """The data's files exist and its sources are known: said before the target is built (seconds to
    minutes), not after."""
    for source in mix_sources(cfg):
        if source.source not in ("builtin_chitchat", "builtin_shapes", SELF_GENERATED):
            data_file(source)


@dataclass
class SourceRows:
    """The file sources read: each one's conversations whose first prompt leaves room for an answer (by its index
    among the sources), and the rows that could not be used (reason -> count, and where each reason first
    occurred)."""
    usable: dict[int, list] = field(default_factory=dict)
    reasons: Counter = field(default_factory=Counter)
    first_at: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    conversations: int = 0
    as_written: set[int] = field(default_factory=set)  # (ids of the conversations regeneration leaves alone)


def read_sources(files: dict[int, Path | str], sources: list[MixSource], cfg: DataConfig, tokenizer: Any,
                 images: ImageInputs | None) -> SourceRows:
    """Each file source's rows read and checked (too many malformed ones: refused, naming the file), and its
    conversations whose first prompt leaves room for an answer."""
    read = SourceRows()
    for i, path in files.items():
        conversations, bad, rows, where = _read_conversations(path, cfg, tokenizer, _takes_prompts(cfg, sources[i]))
        read.reasons.update(bad)
        read.first_at = {**where, **read.first_at}
        read.rows += rows
        read.conversations += len(conversations)
        # A prompt that fills data.max_length leaves no room for an answer: never a sample, nor an eval prompt.
        fits = [c for c in conversations if _prompt_fits(tokenizer, c, cfg.max_length, images)]
        if len(fits) < len(conversations):
            too_long = f"first prompt of data.max_length={cfg.max_length} tokens or more"
            read.reasons[too_long] += len(conversations) - len(fits)
        read.usable[i] = fits
        if sources[i].regenerate is False:
            read.as_written.update(map(id, fits))
    return read


def _takes_prompts(cfg: DataConfig, source: MixSource) -> bool:
    """Whether rows without answers are usable: the target writes every answer of this source."""
    return cfg.regenerate and source.regenerate is not False


def _read_conversations(path: Path | str, cfg: DataConfig, tokenizer: Any, prompts: bool
                        ) -> tuple[list, Counter, int, dict[str, str]]:
    """A file source's conversations, the reasons of the rows skipped, the number of rows, and where each
    reason was first met (file:line). ``prompts``: rows without answers are kept for the target to answer."""
    conversations, reasons, total, first_at = [], Counter(), 0, {}
    for file, where, row in iter_rows(path):
        total += 1
        try:
            if isinstance(row, Exception):
                raise row
            messages = normalize_conversation(row, base_dir=file.parent, confine_images=not cfg.images_outside_folder,
                                              prompts=prompts, vocab_size=len(tokenizer))
            check_renderable(tokenizer, messages)
            conversations.append(messages)
        except MalformedRow as e:
            reasons[str(e)] += 1
            first_at.setdefault(str(e), where)
    check_malformed(total, reasons, cfg, path, first_at)
    return conversations, reasons, total, first_at


def _prompt_fits(tokenizer: Any, conversation: list, max_length: int, images: ImageInputs | None) -> bool:
    try:
        ids, _ = prompt_ids(tokenizer, conversation, images)
    except MalformedRow:
        return True  # (an image prompt for a text-only target: skipped and counted at tokenisation)
    return len(ids) < max_length


def check_malformed(total: int, reasons: Counter, cfg: DataConfig, path: Path | str, first_at: dict[str, str],
                    what: str = "are malformed") -> None:
    """Refused in one line where more than data.max_malformed_fraction of ``path``'s ``total`` rows were not usable
    (the three commonest reasons named, each with where it first occurred)."""
    bad = sum(reasons.values())
    if total == 0:
        raise DataError(f"{path} holds no rows")
    if bad / total > cfg.max_malformed_fraction:
        top = ", ".join(f"{n}x {r}" + (f" (first at {first_at[r]})" if r in first_at else "")
                        for r, n in reasons.most_common(3))
        raise DataError(
            f"{bad} of {total} rows in {path} {what} ({top}); above data.max_malformed_fraction="
            f"{cfg.max_malformed_fraction}. Fix the file (or data.max_length, model.chat_template) or raise the "
            "threshold to skip them."
        )


def mix_conversations(pools: dict[int, list], sources: list[MixSource], cfg: DataConfig, tokenizer: Any,
                      request_writer, model_fingerprint: str, log) -> tuple[list, dict]:
    """The training conversations: one source's pool, or the mix's sources interleaved by weight (with the
    self-generated requests written first); at most data.max_samples. And the mix's stats."""
    stats = {}
    if len(sources) > 1 or sources[0].source == SELF_GENERATED:
        pools, self_stats = _add_self_generated(pools, sources, cfg, tokenizer, request_writer, model_fingerprint, log)
        train_convs, stats["mix"] = _interleave(pools, sources, _mix_total(cfg, pools, sources))
        if self_stats is not None:
            stats["self_generated"] = self_stats
    else:
        train_convs = pools[0]
    if cfg.max_samples is not None:
        train_convs = train_convs[: cfg.max_samples]
    return train_convs, stats


def _mix_total(cfg: DataConfig, pools: dict, sources: list[MixSource]) -> int:
    """How many training conversations a mix holds: data.max_samples, else the regeneration cap, else all
    of its file sources' conversations with the other sources in proportion."""
    if cfg.max_samples is not None:
        return cfg.max_samples
    if cfg.regenerate and cfg.generation.max_conversations is not None:
        return cfg.generation.max_conversations
    files = [i for i, s in enumerate(sources) if s.source != SELF_GENERATED]
    scale = min(len(pools[i]) / sources[i].weight for i in files)
    return int(scale * sum(s.weight for s in sources))


def _add_self_generated(pools: dict, sources: list[MixSource], cfg: DataConfig, tokenizer, writer, fingerprint: str,
                        log) -> tuple[dict, dict | None]:
    """Pools with the self-generated requests (single-turn conversations the target answers later)."""
    wanted = [i for i, s in enumerate(sources) if s.source == SELF_GENERATED]
    if not wanted:
        return pools, None
    if writer is None:
        raise ValueError("data.mix holds self_generated: pass request_writer=... (the target sampling requests)")
    total, weight = _mix_total(cfg, pools, sources), sum(s.weight for s in sources)
    counts = {i: int(round(total * sources[i].weight / weight)) for i in wanted}
    requests, stats = write_requests(writer, tokenizer, sum(counts.values()), cfg.self_generated, fingerprint,
                                     cfg.generation.batch_size, log)
    pools = dict(pools)
    for i in wanted:  # several self_generated entries share one list of requests, in turn
        pools[i], requests = requests[: counts[i]], requests[counts[i]:]
        pools[i] = [[{"role": "user", "content": r}, {"role": "assistant", "content": ""}] for r in pools[i]]
    return pools, stats


def _interleave(pools: dict, sources: list[MixSource], total: int) -> tuple[list, dict]:
    """Up to ``total`` conversations taking from each source in proportion to its weight (the source furthest
    behind its share goes next; an exhausted source drops out). A larger total extends the same order."""
    taken, out = {i: 0 for i in pools}, []
    while len(out) < total:
        open_ = [i for i in pools if taken[i] < len(pools[i])]
        if not open_:
            break
        i = min(open_, key=lambda j: ((taken[j] + 1) / sources[j].weight, j))
        out.append(pools[i][taken[i]])
        taken[i] += 1
    return out, {f"{sources[i].source}{'' if sources[i].path is None else ':' + sources[i].path}#{i}": n
                 for i, n in taken.items()}
