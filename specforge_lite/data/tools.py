"""Tool calling in a row, normalised to the shape chat templates take (transformers' and vLLM's):

* a row-level ``tools`` list (a JSON string too), each ``{"type": "function", "function": {name, description,
  parameters}}``; a bare function (LLaMA-Factory's ShareGPT rows) is wrapped so;
* an assistant turn's ``tool_calls`` (OpenAI's; a JSON string too, and the legacy ``function_call``), each
  ``{"type": "function", "function": {"name", "arguments": {...}}}``: arguments as an object, parsed from
  OpenAI's JSON string, as vLLM hands them to the template of the served model;
* the result of a call: a ``tool`` turn (OpenAI's ``tool``/``function``, ShareGPT's ``observation``), with its
  ``tool_call_id``/``name`` when the row gives them.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .errors import MalformedRow


def row_tools(row: dict) -> list[dict] | None:
    """The tools a row offers the model, or None."""
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = _json(tools, "the row's tools") if tools.strip() else None
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise MalformedRow("the row's tools are not a list of objects (OpenAI's {\"type\": \"function\", "
                           "\"function\": {...}})")
    return [t if "function" in t else {"type": "function", "function": t} for t in tools]


def tool_calls(turn: dict) -> list[dict]:
    """An assistant turn's tool calls (none: an empty list)."""
    raw = turn.get("tool_calls")
    if raw is None and isinstance(turn.get("function_call"), dict):  # (OpenAI's legacy single call)
        raw = [turn["function_call"]]
    return calls_from(raw) if raw else []


def calls_from(raw: Any) -> list[dict]:
    """Tool calls given as a list, one call, or either as JSON text (ShareGPT's ``function_call`` turn value)."""
    if isinstance(raw, str):
        raw = _json(raw, "the tool calls")
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise MalformedRow(f"tool calls are a {type(raw).__name__}, not a list of calls")
    return [_call(c) for c in raw]


def _call(call: Any) -> dict:
    if not isinstance(call, dict):
        raise MalformedRow(f"a tool call is a {type(call).__name__}, not an object")
    fn = call.get("function", call)  # (OpenAI nests name and arguments; a ShareGPT function_call value does not)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise MalformedRow("a tool call names no function")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        args = _json(args, f"the arguments of the call to {name}") if args.strip() else {}
    if not isinstance(args, dict):
        raise MalformedRow(f"the arguments of the call to {name} are a {type(args).__name__}, not an object")
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if call.get("id"):
        out["id"] = str(call["id"])
    return out


def part_text(part: dict) -> str:
    """The text of an OpenAI text part; one with no text (null, absent) is malformed, never the text "None"."""
    text = part.get("text")
    if text is None:
        raise MalformedRow("a text part has no text")
    return str(text)


def tool_result(turn: dict, text: Any) -> dict:
    """A tool turn: its result as text (a structured one as JSON, as a client sends it) and its call's id/name."""
    if isinstance(text, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in text):
        text = "".join(part_text(p) for p in text)  # (OpenAI's content parts)
    elif isinstance(text, (dict, list)):
        text = json.dumps(text, ensure_ascii=False)
    if text is not None and not isinstance(text, str):
        raise MalformedRow(f"a tool result is {type(text).__name__}, not text")
    message = {"role": "tool", "content": "" if text is None else text}
    for key in ("tool_call_id", "name"):
        if turn.get(key):
            message[key] = str(turn[key])
    return message


def check_tool_turns(messages: list[dict]) -> None:
    """Each tool result answers a call of the assistant turn before it (the results that follow one turn answer its
    calls, each once): a result with no such call is a row no server would be sent, refused so it is counted and
    skipped, not trained as if it were whole."""
    pending: list[str | None] = []  # the calls of the last assistant turn not answered yet (their ids, or None)
    for m in messages:
        if m.get("role") == "assistant":
            pending = [c.get("id") for c in m.get("tool_calls") or []]
        elif m.get("role") == "tool":
            if not pending:
                raise MalformedRow("a tool result answers no tool call (no assistant turn with tool_calls, or "
                                   "more results than calls, before it)")
            given = m.get("tool_call_id")
            named = [i for i, call_id in enumerate(pending) if call_id == given]
            if given and any(pending) and not named:
                raise MalformedRow(f"a tool result's tool_call_id {given!r} names none of the calls before it")
            pending.pop(named[0] if named else 0)
        else:
            pending = []


_NINE = re.compile(r"[A-Za-z0-9]{9}")


def nine_character_ids(messages: list[dict]) -> list[dict]:
    """The conversation with each tool call's id, and each result's, as 9 letters or digits: Mistral's templates
    take no other ("Tool call IDs should be alphanumeric strings with length 9!"; mistral_common and vLLM's Mistral
    tool parser make them so). An id already so is kept, another becomes 9 hex digits of its hash (the same in the
    call and in its result), a call without one gets one from its place in the conversation, and a result without
    one takes the id of the first call before it not yet answered. Each id depends on the turns up to its own, so
    every prefix of the conversation renders alike."""
    out, waiting = [], []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = [{**c, "id": _nine(c.get("id") or f"{i}.{k}")} for k, c in enumerate(m["tool_calls"])]
            waiting = [c["id"] for c in calls]
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool":
            given = m.get("tool_call_id")
            call_id = _nine(given) if given else waiting[0] if waiting else _nine(str(i))
            if call_id in waiting:
                waiting.remove(call_id)
            m = {**m, "tool_call_id": call_id}
        out.append(m)
    return out


def _nine(call_id: str) -> str:
    return call_id if _NINE.fullmatch(call_id) else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedRow(f"{what} are not valid JSON ({e.msg} at character {e.pos})") from None
