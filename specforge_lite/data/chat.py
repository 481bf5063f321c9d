"""Tokenise a conversation with the target's chat template and an assistant-only loss mask.

The mask comes from character spans: the text the template adds for assistant turn i is the
difference between rendering ``messages[:i]`` with a generation prompt and rendering
``messages[:i+1]``. This works for any prefix-stable template without ``{% generation %}`` tags, and
includes the turn's end token (the draft must learn to predict it) but not the whitespace after it.

Some real templates render a past turn differently from the live one: Qwen3 drops the ``<think>``
block of earlier answers, GPT-OSS's Harmony ends the last answer with ``<|return|>`` and earlier
ones with ``<|end|>``. A conversation through such a template becomes one sample per assistant turn,
each rendered the way the served model sees that turn (history as the template renders history,
the turn itself as the live answer), with the loss on that turn only.
"""

from __future__ import annotations

from typing import Any

from .formats import MalformedRow, conversation_images
from .images import ImageInputs

# One training sample: token ids, loss mask, and the image files its ids hold placeholders for.
Sample = tuple[list[int], list[int], list[str]]


def render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
           images: ImageInputs | None = None) -> str:
    if images is not None:
        messages = [{**m, "content": images.render(m["content"])} if m.get("images") else m for m in messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class NotPrefixStable(MalformedRow):
    pass


def _turn_span(tokenizer: Any, messages: list[dict[str, str]], i: int, images: ImageInputs | None = None
               ) -> tuple[str, str]:
    """(the prompt for assistant turn i, the render up to and including that turn)."""
    prefix = render(tokenizer, messages[:i], add_generation_prompt=True, images=images)
    upto = render(tokenizer, messages[: i + 1], images=images)
    if not upto.startswith(prefix):
        raise MalformedRow("the chat template renders an assistant turn differently from its generation prompt")
    return prefix, upto


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


def _within_budget(messages: list[dict[str, str]], max_length: int) -> list[dict[str, str]]:
    budget, kept = max_length * _MAX_CHARS_PER_TOKEN, []
    for m in messages:
        kept.append(m)
        budget -= len(m["content"])
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
    image files its ids hold placeholders for."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    _check_images(messages[:first], images)
    ids = generation_prompt_ids(tokenizer, messages[:first], images)
    paths = conversation_images(messages[:first])
    if images is not None:
        ids, _ = images.expand(ids, [0] * len(ids), paths)
    return ids, paths
