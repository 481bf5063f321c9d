"""Rows in the public shapes, normalised to messages ``[{"role", "content", ...}, ...]``.

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}``, with LLaMA-Factory's
  ``function_call`` / ``observation`` turns and a row-level ``tools``;
* OpenAI: ``{"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": "..."}]}``, assistant turns
  with ``tool_calls`` and ``reasoning_content`` (or ``reasoning``, ``thinking``), a row-level ``tools``
  (tools.py says how calls and results are normalised);
* a prompt: ``{"prompt": "..."}`` (or a list of messages), with an optional ``completion``;
* pre-tokenized: ``{"input_ids": [...], "loss_mask": [...]}`` (optional ``attention_mask``), one message of role
  ``tokens`` that carries them as they are.

Images (vision targets): OpenAI content parts ``[{"type": "image", "image": "a.png"}, {"type": "text", ...}]``
(``image_url`` with a local path or ``file://`` URL too), or LLaVA-style ShareGPT rows with ``"image"`` /
``"images"`` at the row and ``<image>`` markers in the turns. Relative paths are read from the data
file's folder. A turn with images gets ``"images": [absolute paths]`` and ``<image>`` markers in its
content (see images.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import MalformedRow
from .images import IMAGE_MARKER
from .readers import iter_rows  # noqa: F401  (adapt/ and bench/ read rows through here)
from .tools import calls_from, check_tool_turns, part_text, row_tools, tool_calls, tool_result

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bot": "assistant",
    "function_call": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
    "system": "system",
}
# An assistant turn's reasoning, under the names datasets give it: Qwen3's and DeepSeek's templates read the first
# (the name it is kept under here), vLLM's responses and GPT-OSS's template the others (chat.py renders it under
# the name the target's template reads).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
REASONING = REASONING_KEYS[0]
TOKENS = "tokens"  # the role of a pre-tokenized row's one message


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
    try:
        found = path.is_file()
    except OSError as e:  # (a name longer than the file system takes: a row holding the image's bytes as text)
        raise MalformedRow(f"image {ref[:40]!r}... is not a path this machine can open ({e.strerror}): give the "
                           "image's file path") from None
    if not found:
        raise MalformedRow(f"image file not found: {path}")
    return str(path.resolve())


def _content_parts(parts: list, base_dir: Path | None, confine: bool) -> tuple[str, list[str]]:
    """OpenAI content parts -> text with <image> markers, and the image paths in order."""
    text, images = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(part_text(part))
        elif kind in ("image", "image_url"):
            images.append(_image_path(part.get(kind, part.get("path")), base_dir, confine))
            text.append(IMAGE_MARKER)
        else:
            raise MalformedRow(f"unknown content part {kind!r} (text, image and image_url are read)")
    return "".join(text), images


def normalize_conversation(row: Any, base_dir: Path | None = None, confine_images: bool = True, *,
                           prompts: bool = False, vocab_size: int | None = None) -> list[dict[str, Any]]:
    """A row as messages. ``prompts``: a row without an answer (or ending on a user turn) gets an empty
    assistant turn for the target to write (data.regenerate); else it is refused. ``vocab_size``: a
    pre-tokenized row's ids must lie below it."""
    if not isinstance(row, dict):
        raise MalformedRow(f"row is a {type(row).__name__}, not an object")
    if "input_ids" in row:
        return [pretokenized(row, vocab_size)]
    messages = [_message(turn, role_key, text_key, base_dir, confine_images)
                for turn, role_key, text_key in _turns(row)]
    _attach_row_images(row, messages, base_dir, confine_images)
    if any(m["role"] == "system" for m in messages[1:]):
        raise MalformedRow("a system message appears after the first turn")
    # A conversation that opens with the assistant has no prompt for it: drop those leading turns.
    start = 1 if messages[0]["role"] == "system" else 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        del messages[start]
    if not messages:
        raise MalformedRow("no turn before the first answer")
    tools = row_tools(row)
    if tools:  # (carried by the first turn, so that every prefix of the conversation renders them)
        messages[0] = {**messages[0], "tools": tools}
    check_tool_turns(messages)
    return _with_answers(messages, prompts)


def _turns(row: dict) -> list[tuple[dict, str, str]]:
    """(turn, its role key, its text key) for each turn of the row."""
    if "messages" in row:
        turns, role_key, text_key = row["messages"], "role", "content"
    elif "conversations" in row:
        turns, role_key, text_key = row["conversations"], "from", "value"
    elif "prompt" in row:  # a prompt (text or messages), and its completion if the row has one
        turns = [t for key in ("prompt", "completion") if key in row
                 for t in (row[key] if isinstance(row[key], list)
                           else [{"role": "user" if key == "prompt" else "assistant", "content": row[key]}])]
        role_key, text_key = "role", "content"
    else:
        raise MalformedRow("row has none of 'conversations' (ShareGPT), 'messages' (OpenAI), 'prompt', or "
                           "'input_ids' with 'loss_mask' (pre-tokenized)")
    if not isinstance(turns, list) or not turns:
        raise MalformedRow("conversation is empty or not a list")
    if not all(isinstance(t, dict) for t in turns):
        raise MalformedRow("a turn is not an object")
    return [(t, role_key, text_key) for t in turns]


def _field(turn: dict, *keys: str) -> Any:
    return next((turn[k] for k in keys if turn.get(k) is not None), None)


def _message(turn: dict, role_key: str, text_key: str, base_dir: Path | None, confine: bool) -> dict[str, Any]:
    role = _field(turn, role_key, "role", "from")
    if not isinstance(role, str) or role not in ROLES:
        raise MalformedRow(f"unknown role {role!r}")
    text = _field(turn, text_key, "content", "value")
    if ROLES[role] == "tool":
        message = tool_result(turn, text)
        _check_encodable(message["content"])
        return message
    calls = calls_from(text) if role == "function_call" else tool_calls(turn) if ROLES[role] == "assistant" else []
    if calls and (role == "function_call" or text is None):
        text = ""  # (the turn is its calls)
    images: list[str] = []
    if isinstance(text, list):
        text, images = _content_parts(text, base_dir, confine)
    if not isinstance(text, str):
        raise MalformedRow(f"turn content is {type(text).__name__}, not text")
    _check_encodable(text)
    message = {"role": ROLES[role], "content": text, **({"images": images} if images else {})}
    if calls:
        message["tool_calls"] = calls
    reasoning = _field(turn, *REASONING_KEYS) if message["role"] == "assistant" else None
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise MalformedRow(f"the reasoning of a turn is {type(reasoning).__name__}, not text")
        message[REASONING] = reasoning
    return message


def learnable(message: dict[str, Any]) -> bool:
    """An assistant turn with something to learn: text, tool calls or reasoning."""
    return message["role"] == "assistant" and bool(message["content"].strip() or message.get("tool_calls")
                                                     or message.get(REASONING, "").strip())


PROMPT_ONLY = ("no assistant answer to learn from (a prompt-only row): set data.regenerate=true to have the target "
               "write the answers")


def _with_answers(messages: list[dict[str, Any]], prompts: bool) -> list[dict[str, Any]]:
    if prompts:
        if messages[-1]["role"] != "assistant":  # (the target answers the last turn too)
            messages.append({"role": "assistant", "content": ""})
        return messages
    if not any(map(learnable, messages)):
        raise MalformedRow(PROMPT_ONLY)
    return messages


def pretokenized(row: dict, vocab_size: int | None) -> dict[str, Any]:
    """A pre-tokenized row as the one message that carries it: its ids and loss mask are used as they are."""
    ids, mask = _unpadded(row)
    if not set(mask) <= {0, 1}:
        raise MalformedRow("loss_mask holds values other than 0 and 1")
    if not any(mask):
        raise MalformedRow("loss_mask is 0 everywhere: no token to learn")
    if mask[0]:  # (what a draft speeds up follows a prompt, and the held-out rows' prompts are evaluated)
        raise MalformedRow("loss_mask is 1 on the first token: a row starts with its prompt (loss 0)")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None) if vocab_size is not None else None
    if bad is not None:
        raise MalformedRow(f"token id {bad} lies outside the target's vocabulary of {vocab_size}: tokenize the row "
                           "with the target's tokenizer")
    return {"role": TOKENS, "content": "", "input_ids": ids, "loss_mask": mask}


def _unpadded(row: dict) -> tuple[list[int], list[int]]:
    """A pre-tokenized row's ids and loss mask, checked to be integer lists of one length, without the positions
    its attention_mask pads."""
    ids, mask, attention = row["input_ids"], row.get("loss_mask"), row.get("attention_mask")
    if mask is None:
        raise MalformedRow("a pre-tokenized row (input_ids) has no loss_mask: add one, 1 on the tokens to learn")
    if not isinstance(ids, list):
        raise MalformedRow("input_ids is not a list of integers")
    for name, values in (("input_ids", ids), ("loss_mask", mask), ("attention_mask", attention)):
        if values is not None and not (isinstance(values, list) and all(type(v) is int for v in values)):
            raise MalformedRow(f"{name} is not a list of integers")
        if values is not None and len(values) != len(ids):
            raise MalformedRow(f"{name} has {len(values)} entries and input_ids {len(ids)}: they must be as long")
    if attention is None:
        return ids, mask
    kept = [i for i, a in enumerate(attention) if a]
    if not kept or kept[-1] - kept[0] + 1 != len(kept):
        raise MalformedRow("attention_mask is not one run of 1s (padding on one side): give the unpadded row")
    return ids[kept[0]: kept[-1] + 1], mask[kept[0]: kept[-1] + 1]


def is_pretokenized(messages: list[dict[str, Any]]) -> bool:
    return messages[0]["role"] == TOKENS


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
    if not refs:  # (none, or a table column's empty list)
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
