"""Conversation rows in the two public formats, normalised to ``[{"role", "content"}, ...]``.

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``
* OpenAI: ``{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}]}``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bot": "assistant",
    "system": "system",
}


class MalformedRow(ValueError):
    """A row that cannot be used; the loader counts these and skips them."""


def normalize_conversation(row: Any) -> list[dict[str, str]]:
    if not isinstance(row, dict):
        raise MalformedRow(f"row is a {type(row).__name__}, not an object")
    if "messages" in row:
        turns, role_key, text_key = row["messages"], "role", "content"
    elif "conversations" in row:
        turns, role_key, text_key = row["conversations"], "from", "value"
    else:
        raise MalformedRow("row has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    if not isinstance(turns, list) or not turns:
        raise MalformedRow("conversation is empty or not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise MalformedRow("a turn is not an object")
        role = turn.get(role_key, turn.get("role", turn.get("from")))
        text = turn.get(text_key, turn.get("content", turn.get("value")))
        if role not in ROLES:
            raise MalformedRow(f"unknown role {role!r}")
        if not isinstance(text, str):
            raise MalformedRow(f"turn content is {type(text).__name__}, not text")
        messages.append({"role": ROLES[role], "content": text})
    if any(m["role"] == "system" for m in messages[1:]):
        raise MalformedRow("a system message appears after the first turn")
    # A conversation that opens with the assistant has no prompt for it: drop those leading turns.
    start = 1 if messages[0]["role"] == "system" else 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        del messages[start]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise MalformedRow("no non-empty assistant turn to learn from")
    return messages


def iter_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, parsed_row_or_exception)`` for a JSONL/JSON file or a folder of them."""
    path = Path(path).expanduser()
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl or .json files under {path}")
    for f in files:
        if f.suffix == ".json":
            try:
                rows = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                yield f"{f}", MalformedRow(f"invalid JSON: {e}")
                continue
            if not isinstance(rows, list):
                rows = [rows]
            for i, row in enumerate(rows):
                yield f"{f}[{i}]", row
        else:
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        yield f"{f}:{n}", json.loads(line)
                    except json.JSONDecodeError as e:
                        yield f"{f}:{n}", MalformedRow(f"invalid JSON: {e.msg}")
