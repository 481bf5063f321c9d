"""Tokenise a conversation with the target's chat template and an assistant-only loss mask.

The mask comes from character spans: the text the template adds for assistant turn i is the
difference between rendering ``messages[:i]`` with a generation prompt and rendering
``messages[:i+1]``. This works for any prefix-stable template without ``{% generation %}`` tags, and
includes the turn's end token (the draft must learn to predict it) but not the whitespace after it.
"""

from __future__ import annotations

from typing import Any

from .formats import MalformedRow


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise MalformedRow("the chat template is not prefix-stable for this conversation")
        end = len(upto.rstrip())
        if end > len(prefix):
            spans.append((len(prefix), end))
    return full, spans


# No tokenizer in use averages this many characters per token, so text past max_length * this is cut
# by truncation anyway; not rendering it keeps long conversations linear instead of quadratic.
_MAX_CHARS_PER_TOKEN = 16


def _within_budget(messages: list[dict[str, str]], max_length: int) -> list[dict[str, str]]:
    budget, kept = max_length * _MAX_CHARS_PER_TOKEN, []
    for m in messages:
        kept.append(m)
        budget -= len(m["content"])
        if budget < 0:
            break
    return kept


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]], max_length: int) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(tokenizer, _within_budget(messages, max_length))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    s = 0
    for j, (start, _end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s < len(spans) and spans[s][0] <= start < spans[s][1]:
            mask[j] = 1
    ids, mask = ids[:max_length], mask[:max_length]
    if sum(mask) == 0:
        raise MalformedRow(f"no assistant tokens within max_length={max_length}")
    return ids, mask


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation up to its first assistant turn, ready for the assistant to answer."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    text = render(tokenizer, messages[:first], add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
