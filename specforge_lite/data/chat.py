"""Tokenise a conversation with the target's chat template and an assistant-only loss mask.

The mask comes from character spans: the text the template adds for assistant turn i is the
difference between rendering ``messages[:i]`` with a generation prompt and rendering
``messages[:i+1]``. This works for any prefix-stable template without ``{% generation %}`` tags, and
includes the turn's end token (the draft must learn to predict it) but not the whitespace after it.

Some real templates render a past turn differently from the live one: Qwen3 drops the ``<think>``
block of earlier answers, GPT-OSS's Harmony ends the last answer with ``<|return|>`` and earlier
ones with ``<|end|>``, Gemma 4's generation prompt holds an empty thought channel that no past answer
keeps. A conversation through such a template becomes one sample per assistant turn,
each rendered the way the served model sees that turn (history as the template renders history,
the turn itself as the live answer), with the loss on that turn only.

An assistant turn is what the served model writes: its text, its reasoning (``<think>`` in Qwen3's
template) and its tool calls are in the loss; tool results, like user turns, are context. Tools and
reasoning go to the template as transformers and vLLM pass them (``tools=``, ``tool_calls`` with
object arguments, ``reasoning_content``); a template that would drop them is refused by name.
A pre-tokenized row is its own sample, as given.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from .formats import REASONING, REASONING_KEYS, MalformedRow, conversation_images, is_pretokenized
from .images import ImageInputs
from .tools import nine_character_ids

# One training sample: token ids, loss mask, and the image files its ids hold placeholders for.
Sample = tuple[list[int], list[int], list[str]]


def pad_id(tokenizer: Any) -> int:
    """The id batches pad with: the tokenizer's pad token, else its end of sequence (pads are masked, never read)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
           images: ImageInputs | None = None) -> str:
    """The conversation as the target's template writes it, with the tools its first turn carries (formats.py)."""
    tools = messages[0].get("tools") if messages else None
    key = reasoning_key(tokenizer) if any(REASONING in m for m in messages) else REASONING
    if _has_tool_turns(messages) and _probe(tokenizer, "tools", _tool_probe)[1]:
        messages = nine_character_ids(messages)
    messages = [_for_template(m, key, images) for m in messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}))
    except (TemplateError, TypeError) as e:  # (the template's raise_exception, or a type error inside it)
        raise MalformedRow(f"{_template_name(tokenizer)} refuses this conversation "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _for_template(message: dict[str, Any], reasoning: str, images: ImageInputs | None) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != "tools"}
    if images is not None and out.get("images"):
        out["content"] = images.render(out["content"])
    if REASONING in out and reasoning != REASONING:
        out[reasoning] = out.pop(REASONING)
    return out


# ---- what a template can render: probed once per template ------------------------------------------------------
_PROBED: dict[tuple[str, str], Any] = {}


def _probe(tokenizer: Any, what: str, probe) -> Any:
    key = (str(tokenizer.chat_template), what)
    if key not in _PROBED:
        _PROBED[key] = probe(tokenizer)
    return _PROBED[key]


def _try_render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs) -> str | Exception:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001  (a template's own raise_exception, or a type error inside it)
        return e


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def _render_tool_probe(tokenizer: Any, call_id: str) -> str | Exception:
    call = {"id": call_id, "type": "function", "function": {"name": "probe_called_fn", "arguments": {"x": 1}}}
    tools = [{"type": "function", "function": {"name": "probe_offered_fn", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    return _try_render(tokenizer, [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": call_id, "content": "probe_result_text"}],
                       tools=tools)


def _tool_probe(tokenizer: Any) -> tuple[str | None, bool]:
    """(What of a tool-calling conversation the template leaves out, None: it renders all of it; whether it takes
    only call ids of 9 letters or digits, as Mistral's templates do: a row's ids are then rendered so, by
    tools.nine_character_ids.)"""
    text, nine = _render_tool_probe(tokenizer, "call_0"), False
    if isinstance(text, Exception):
        retried = _render_tool_probe(tokenizer, "call00000")
        if not isinstance(retried, Exception):
            text, nine = retried, True
    if isinstance(text, Exception):
        return f"fails on them ({type(text).__name__}: {str(text).splitlines()[0] if str(text) else ''})", False
    missing = [what for what, mark in (("tools", "probe_offered_fn"), ("tool calls", "probe_called_fn"),
                                       ("tool results", "probe_result_text")) if mark not in text]
    return (f"renders no {', '.join(missing)}" if missing else None), nine


def reasoning_key(tokenizer: Any) -> str:
    """The name under which the template reads an answer's reasoning."""
    def probe(tok):
        for key in REASONING_KEYS:
            text = _try_render(tok, [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "a", key: "probe_reasoning_text"}])
            if isinstance(text, str) and "probe_reasoning_text" in text:
                return key
        return None

    key = _probe(tokenizer, "reasoning", probe)
    if key is None:
        raise MalformedRow(f"{_template_name(tokenizer)} renders no reasoning (it reads none of "
                           f"{', '.join(REASONING_KEYS)}): set model.chat_template=/path/to/template.jinja to the "
                           "target's template that does, or put the reasoning in the answer as the target writes it")
    return key


def check_renderable(tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    """The template renders what the conversation holds (tools, tool calls and results, reasoning), else a
    MalformedRow naming the template and the fix: a template that drops them would train the draft on text the
    served target never sees."""
    if is_pretokenized(messages):
        return
    if messages[0].get("tools") or _has_tool_turns(messages):
        problem, _ = _probe(tokenizer, "tools", _tool_probe)
        if problem:
            raise MalformedRow(f"{_template_name(tokenizer)} {problem}: set model.chat_template=/path/to/"
                               "template.jinja to the target's template that renders tools (the one its server uses)")
        # a template that renders tools may still refuse this conversation (Llama 3.1's takes one call per turn):
        # its server would refuse it too, so the row is skipped with the template's own words, before any answer
        # is asked for
        render(tokenizer, messages)
    if any(REASONING in m for m in messages):
        reasoning_key(tokenizer)


def _template_name(tokenizer: Any) -> str:
    return f"the chat template of {tokenizer.name_or_path or 'the tokenizer'}"


class NotPrefixStable(MalformedRow):
    pass


def _turn_span(tokenizer: Any, messages: list[dict[str, str]], i: int, images: ImageInputs | None = None
               ) -> tuple[str, str]:
    """(the prompt for assistant turn i, the render up to and including that turn: the prompt and then the turn as
    the served model writes it after the prompt, _live_turn)."""
    prefix = render(tokenizer, messages[:i], add_generation_prompt=True, images=images)
    upto = render(tokenizer, messages[: i + 1], images=images)
    if upto.startswith(prefix):
        return prefix, upto
    live = _live_turn(tokenizer, render(tokenizer, messages[:i], images=images), prefix, upto)
    if live is None:
        raise MalformedRow("the chat template renders an assistant turn differently from its generation prompt")
    return prefix, prefix + live


def _live_turn(tokenizer: Any, history: str, prefix: str, upto: str) -> str | None:
    """The turn the served model writes after a generation prompt that opens it with more than the template keeps
    of it in history: Gemma 4's empty thought channel (``<|turn>model\\n<|channel>thought\\n<channel|>``, dropped
    from every past answer). The prompt and the rendered turn share the turn's opening tokens; the model writes the
    rest of the turn after the whole prompt. None where they share no opening or differ before the turn."""
    if not (prefix.startswith(history) and upto.startswith(history)):
        return None
    opening, turn = prefix[len(history):], upto[len(history):]
    asked = tokenizer(opening, add_special_tokens=False)["input_ids"]
    enc = tokenizer(turn, add_special_tokens=False, return_offsets_mapping=True)
    written, offsets = enc["input_ids"], enc["offset_mapping"]
    shared = next((k for k, (a, b) in enumerate(zip(asked, written)) if a != b), min(len(asked), len(written)))
    if shared == 0 or shared >= len(written):
        return None
    return turn[offsets[shared][0]:]


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]], images: ImageInputs | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    full = render(tokenizer, messages, images=images)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix, upto = _turn_span(tokenizer, messages, i, images)
        if not full.startswith(upto):
            raise NotPrefixStable("the chat template is not prefix-stable for this conversation")
        end = len(upto.rstrip())
        if end > len(prefix):
            spans.append((len(prefix), end))
    return full, spans


# No tokenizer in use averages this many characters per token, so text past max_length * this is cut
# by truncation anyway; not rendering it keeps long conversations linear instead of quadratic.
_MAX_CHARS_PER_TOKEN = 16


def _chars(message: dict[str, Any]) -> int:
    """About how many characters the template writes for a turn (its tools and calls as JSON)."""
    extra = [message[k] for k in ("tools", "tool_calls") if message.get(k)]
    return len(message["content"]) + len(message.get(REASONING, "")) + (len(json.dumps(extra)) if extra else 0)


def _within_budget(messages: list[dict[str, str]], max_length: int) -> list[dict[str, str]]:
    budget, kept = max_length * _MAX_CHARS_PER_TOKEN, []
    for m in messages:
        kept.append(m)
        budget -= _chars(m)
        if budget < 0:
            break
    return kept


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]], max_length: int,
                          images: ImageInputs | None = None) -> Sample:
    """One sample with every assistant turn in the loss (prefix-stable templates)."""
    messages = _within_budget(messages, max_length)
    _check_images(messages, images)
    return _encode(tokenizer, *assistant_spans(tokenizer, messages, images), max_length,
                   images, conversation_images(messages))


LOSS_TURNS = ("all", "last")


def tokenize_samples(tokenizer: Any, messages: list[dict[str, str]], max_length: int,
                     images: ImageInputs | None = None, loss_turns: str = "all") -> list[Sample]:
    """The training samples of a conversation: one for a prefix-stable template, else one per assistant
    turn (see the module docstring). Turns cut off by max_length are dropped; none left is a MalformedRow.
    ``images``: how the (vision) target takes the conversation's images; None for text-only targets.
    ``loss_turns=last``: one sample, the conversation up to its last answer, with the loss on that answer
    only (rendered as the live turn, the earlier ones as the template renders history)."""
    if loss_turns not in LOSS_TURNS:
        raise ValueError(f"data.loss_turns={loss_turns!r}: use one of {LOSS_TURNS}")
    if is_pretokenized(messages):
        return [_given(messages[0], max_length)]
    if loss_turns == "last":
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise MalformedRow("no assistant turn")
        _check_images(messages[: last + 1], images)
        prefix, upto = _turn_span(tokenizer, messages, last, images)
        return [_encode(tokenizer, upto, [(len(prefix), len(upto.rstrip()))], max_length, images,
                        conversation_images(messages[: last + 1]))]
    messages = _within_budget(messages, max_length)
    try:
        return [tokenize_conversation(tokenizer, messages, max_length, images)]
    except NotPrefixStable:
        pass
    samples = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prefix, upto = _turn_span(tokenizer, messages, i, images)
            try:
                samples.append(_encode(tokenizer, upto, [(len(prefix), len(upto.rstrip()))], max_length,
                                       images, conversation_images(messages[: i + 1])))
            except MalformedRow:
                break  # this turn starts past max_length, and so does every later one
    if not samples:
        raise MalformedRow(f"no assistant tokens within max_length={max_length}")
    return samples


def _given(message: dict[str, Any], max_length: int) -> Sample:
    """A pre-tokenized row's sample: its ids and mask as they are, cut at max_length."""
    ids, mask = message["input_ids"][:max_length], message["loss_mask"][:max_length]
    if sum(mask) == 0:
        raise MalformedRow(f"no assistant tokens within max_length={max_length}")
    return ids, mask, []


def given_prompt(message: dict[str, Any]) -> list[int]:
    """A pre-tokenized row's prompt: its ids before the first one in the loss."""
    return message["input_ids"][: message["loss_mask"].index(1)]


def _check_images(messages: list[dict[str, Any]], images: ImageInputs | None) -> None:
    if images is None and conversation_images(messages):
        raise MalformedRow("a turn holds images but the target takes text only")


def _encode(tokenizer: Any, text: str, spans: list[tuple[int, int]], max_length: int,
            images: ImageInputs | None = None, paths: list[str] = ()) -> Sample:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    s = 0
    for j, (start, _end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s < len(spans) and spans[s][0] <= start < spans[s][1]:
            mask[j] = 1
    paths = list(paths)
    if images is not None:
        try:
            ids, mask = images.expand(ids, mask, paths)
        except ValueError as e:
            raise MalformedRow(str(e)) from None
        ids, mask, paths = images.truncate(ids, mask, paths, max_length)
    ids, mask = ids[:max_length], mask[:max_length]
    if sum(mask) == 0:
        raise MalformedRow(f"no assistant tokens within max_length={max_length}")
    return ids, mask, paths


def generation_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                          images: ImageInputs | None = None) -> list[int]:
    """Token ids of ``messages`` rendered for the assistant to answer next (before image expansion)."""
    text = render(tokenizer, messages, add_generation_prompt=True, images=images)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], images: ImageInputs | None = None
               ) -> tuple[list[int], list[str]]:
    """The conversation up to its first assistant turn, ready for the assistant to answer, and the
    image files its ids hold placeholders for (a pre-tokenized row: its ids before the first one in the loss)."""
    if is_pretokenized(messages):
        return given_prompt(messages[0]), []
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    _check_images(messages[:first], images)
    ids = generation_prompt_ids(tokenizer, messages[:first], images)
    paths = conversation_images(messages[:first])
    if images is not None:
        ids, _ = images.expand(ids, [0] * len(ids), paths)
    return ids, paths
