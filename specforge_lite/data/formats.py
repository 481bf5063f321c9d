"""Conversation rows in the two public formats, normalised to ``[{"role", "content"}, ...]``.

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``
* OpenAI: ``{"messages": [{"role": "user"|"assistant"|"system", "content": "..."}]}``

Images (vision targets): OpenAI content parts ``[{"type": "image", "image": "a.png"}, {"type": "text", ...}]``
(``image_url`` with a local path or ``file://`` URL too), or LLaVA-style ShareGPT rows with ``"image"`` /
``"images"`` at the row and ``<image>`` markers in the turns. Relative paths are read from the data
file's folder. A turn with images gets ``"images": [absolute paths]`` and ``<image>`` markers in its
content (see images.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from .errors import MalformedRow
from .images import IMAGE_MARKER

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bot": "assistant",
    "system": "system",
}


def _image_path(ref: Any, base_dir: Path | None, confine: bool) -> str:
    """The image file a row names, resolved against its data file's folder; with ``confine`` it must lie
    inside that folder (a data file from elsewhere must not make training read any file on the machine)."""
    if isinstance(ref, dict):  # OpenAI image_url: {"url": ...}
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise MalformedRow("an image part names no file")
    if ref.startswith(("http://", "https://", "data:")):
        raise MalformedRow("image URLs are not fetched; give a local file path")
    path = Path(ref.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if confine and base_dir is not None and not path.resolve().is_relative_to(Path(base_dir).resolve()):
        raise MalformedRow(f"image {ref!r} lies outside the data file's folder {base_dir}: move it there, or set "
                           "data.images_outside_folder=true to read images from anywhere")
    if not path.is_file():
        raise MalformedRow(f"image file not found: {path}")
    return str(path.resolve())


def _content_parts(parts: list, base_dir: Path | None, confine: bool) -> tuple[str, list[str]]:
    """OpenAI content parts -> text with <image> markers, and the image paths in order."""
    text, images = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(str(part.get("text", "")))
        elif kind in ("image", "image_url"):
            images.append(_image_path(part.get(kind, part.get("path")), base_dir, confine))
            text.append(IMAGE_MARKER)
        else:
            raise MalformedRow(f"unknown content part {kind!r} (text, image and image_url are read)")
    return "".join(text), images


def normalize_conversation(row: Any, base_dir: Path | None = None, confine_images: bool = True
                           ) -> list[dict[str, Any]]:
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
        images: list[str] = []
        if isinstance(text, list):
            text, images = _content_parts(text, base_dir, confine_images)
        if not isinstance(text, str):
            raise MalformedRow(f"turn content is {type(text).__name__}, not text")
        _check_encodable(text)
        messages.append({"role": ROLES[role], "content": text, **({"images": images} if images else {})})
    _attach_row_images(row, messages, base_dir, confine_images)
    if any(m["role"] == "system" for m in messages[1:]):
        raise MalformedRow("a system message appears after the first turn")
    # A conversation that opens with the assistant has no prompt for it: drop those leading turns.
    start = 1 if messages[0]["role"] == "system" else 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        del messages[start]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise MalformedRow("no non-empty assistant turn to learn from")
    return messages


def _check_encodable(text: str) -> None:
    """JSON's \\u escapes can spell half of a UTF-16 pair (a lone surrogate), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MalformedRow(f"text holds {text[e.start]!r} at character {e.start}, a lone UTF-16 surrogate (half of "
                           "an escaped pair) that is not Unicode text: fix the escape in the file") from None


def _attach_row_images(row: dict, messages: list[dict[str, Any]], base_dir: Path | None, confine: bool) -> None:
    """LLaVA-style rows: images listed at the row, placed at the <image> markers in turn order (or all
    before the first user turn when the text has no markers, as LLaVA does)."""
    refs = row.get("images", row.get("image"))
    if refs is None:
        return
    paths = [_image_path(r, base_dir, confine) for r in (refs if isinstance(refs, list) else [refs])]
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if markers == 0:
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise MalformedRow("the row has images but no user turn to put them in")
        first["content"] = IMAGE_MARKER * len(paths) + "\n" + first["content"]
        first["images"] = paths
        return
    if markers != len(paths):
        raise MalformedRow(f"the row lists {len(paths)} images but its turns hold {markers} {IMAGE_MARKER} markers")
    for m in messages:
        n = m["content"].count(IMAGE_MARKER)
        if n:
            m["images"], paths = m.get("images", []) + paths[:n], paths[n:]


def conversation_images(messages: list[dict[str, Any]]) -> list[str]:
    return [p for m in messages for p in m.get("images") or []]


def iter_rows(path: str | Path) -> Iterator[tuple[Path, str, Any]]:
    """Yield ``(file, location, parsed_row_or_exception)`` for a JSONL/JSON file or a folder of them."""
    path = Path(path).expanduser()
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl or .json files under {path}")
    for f in files:
        try:
            yield from _file_rows(f)
        except OSError as e:  # a symlink loop or a dangling link, a file that cannot be read: one counted skip
            yield f, f"{f}", MalformedRow(f"the file cannot be read ({e.strerror or e})")


def _file_rows(f: Path) -> Iterator[tuple[Path, str, Any]]:
    if f.suffix == ".json":
        try:
            rows = _parse(_utf8(f.read_bytes()))
        except UnicodeDecodeError as e:
            before = e.object[: e.start]
            line = before.count(b"\n") + 1
            yield f, f"{f}:{line}", _not_utf8(e, e.start - before.rfind(b"\n"))
            return
        except MalformedRow as e:
            yield f, f"{f}", e
            return
        if not isinstance(rows, list):
            rows = [rows]
        for i, row in enumerate(rows):
            yield f, f"{f}[{i}]", row
        return
    with open(f, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = _utf8(raw) if n == 1 else raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f, f"{f}:{n}", _not_utf8(e, e.start + 1)
                continue
            if not line.strip():
                continue
            try:
                yield f, f"{f}:{n}", _parse(line)
            except MalformedRow as e:
                yield f, f"{f}:{n}", e


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedRow(f"invalid JSON: {e.msg}") from None
    except RecursionError:
        raise MalformedRow("JSON nested deeper than any conversation (the parser's recursion limit)") from None


def _utf8(data: bytes) -> str:
    """UTF-8 text, a leading byte-order mark (Windows tools write one) dropped."""
    return data.decode("utf-8-sig")


def _not_utf8(e: UnicodeDecodeError, column: int) -> MalformedRow:
    return MalformedRow(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at column {column}): save the file as "
                        f"UTF-8")
