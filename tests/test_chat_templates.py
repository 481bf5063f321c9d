"""Real chat templates with tools: Llama 3.1, Mistral (Nemo, the v3 tool format), Qwen3 and Gemma 4, as their model
repositories publish them (tests/fixtures/templates, whose README names each source). A tool-calling row is rendered
and masked through each; a tool call the target regenerates comes back from every answer engine with the template's
own markup (Llama's <|python_tag|>, Mistral's [TOOL_CALLS], Gemma's <|tool_call>) as the target emitted it, so the
draft trains on the very ids the served target writes."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specforge_lite.data import MalformedRow, normalize_conversation
from test_data_shapes import TOOL_ROW, WEATHER  # (a tool-calling row, as OpenAI clients send it)
from specforge_lite.data.chat import check_renderable, render, tokenize_samples
from specforge_lite.generation.engines import HFGenerator, LeanAnswers, ServedAnswers

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"



@dataclass(frozen=True)
class Family:
    template: str
    special: tuple[str, ...]  # the markup the real tokenizer holds as special tokens
    bos: str | None
    eos: str
    stops: tuple[str, ...]  # the end tokens the generation stops at
    call: str  # the learned text of the row's tool-call turn, as the template writes it
    answer: str  # a tool call the target regenerates, as it writes it (before its stop token)
    stop: str  # the token that answer ends with
    end: str  # what the template closes an answer turn with
    markup: str | None  # the special markup in that answer (None: the family's markup is ordinary tokens)
    plain: tuple[str, ...] = ()  # markup the real tokenizer holds as ordinary added tokens


FAMILIES = {
    "llama3.1": Family(
        "llama3.1.jinja",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"),
        "<|begin_of_text|>", "<|eot_id|>", ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        call='{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        answer='<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', stop="<|eom_id|>",
        end="<|eot_id|>", markup="<|python_tag|>"),
    "mistral": Family(
        "mistral_nemo.jinja",
        ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        "<s>", "</s>", ("</s>",),
        call='[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "ID"}]</s>',
        answer='[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "Xq7Lm2Pz9"}]', stop="</s>",
        end="</s>", markup="[TOOL_CALLS]"),
    "qwen3": Family(
        "qwen3.jinja", (), None, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
        call='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        answer=('<think>\nThe user wants the weather in Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                '"arguments": {"city": "Paris"}}\n</tool_call>'),
        stop="<|im_end|>", end="<|im_end|>", markup=None,
        plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")),
    "gemma4": Family(
        "gemma4.jinja",
        ("<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
         "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"),
        "<bos>", "<eos>", ("<eos>", "<turn|>", "<|tool_response>"),
        call='<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
        answer='<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', stop="<|tool_response>",
        end="<turn|>", markup="<|tool_call>"),
}


@pytest.fixture(scope="module")
def base_tokenizer():
    """SmolLM2's tokenizer (the one offline), read alone: no model is loaded."""
    from transformers import AutoTokenizer

    from specforge_lite.config import model_preset
    from specforge_lite.targets.acquire import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model_preset("smollm2_135m")))


def family_tokenizer(base, family: Family):
    """SmolLM2's tokenizer with the family's markup added as its real tokenizer holds it, and its real template."""
    tok = copy.deepcopy(base)
    if family.special:
        tok.add_special_tokens({"additional_special_tokens": list(family.special)}, replace_extra_special_tokens=False)
    if family.plain:
        tok.add_tokens(list(family.plain))
    if family.bos:
        tok.bos_token = family.bos
    tok.eos_token = family.eos
    tok.chat_template = (TEMPLATES / family.template).read_text()
    return tok


def learned(tok, samples) -> str:
    return "".join(tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask, _ in samples)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_row_is_rendered_and_masked_through_the_real_template(base_tokenizer, name):
    """The row's tool call is in the loss as the template writes it, its result is context only. Mistral's templates
    take only call ids of 9 letters or digits: the row's ``call_1`` is rendered as one, the same in the call and in
    its result (the probe's own ``call_0`` made every tool row refused, naming the template in use)."""
    family = FAMILIES[name]
    tok = family_tokenizer(base_tokenizer, family)
    messages = normalize_conversation(TOOL_ROW)
    check_renderable(tok, messages)
    samples = tokenize_samples(tok, messages, 4096)
    text = learned(tok, samples)
    if name == "mistral":
        ids = re.findall(r'"(?:id|call_id)": "([^"]*)"', render(tok, messages))
        assert len(ids) == 2 and ids[0] == ids[1] and re.fullmatch(r"[A-Za-z0-9]{9}", ids[0])
        text = text.replace(ids[0], "ID")
    assert family.call in text
    assert "It is 18C and sunny in Paris." + family.end in text
    assert "18C, sunny" not in text and "18C, sunny" in tok.decode(samples[-1][0])  # context, never learned
    if name == "gemma4":  # the call's sample is the prompt the server sends, its empty thought channel included
        assert tok.decode(samples[0][0]).endswith("<|turn>model\n<|channel>thought\n<channel|>" + family.call)


class _Emits(torch.nn.Module):
    """A target whose ``generate`` writes ``ids`` after every prompt, then pads, as transformers' does."""

    def __init__(self, ids: list[int], pad: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.ids, self.pad = ids, pad

    def generate(self, input_ids, max_new_tokens, **_):
        new = torch.tensor(self.ids + [self.pad] * (max_new_tokens - len(self.ids)))
        return torch.cat([input_ids, new.expand(len(input_ids), -1)], dim=1)


class _Decoder:
    """The lean decoder's interface: each prompt's answer ids, its stop token left out (as LeanDecoder does)."""

    tokens_generated = decode_rows = 0

    def __init__(self, ids: list[int]):
        self.ids = ids

    def stream(self, queue):
        while len(queue):
            key, _, _ = queue.pop()
            yield key, self.ids[:-1]


class _Queue(list):
    def pop(self):
        return super().pop(0)


class _VLLM:
    """openai's AsyncOpenAI against vLLM's completions endpoint: the answer's text is decoded as the request
    asks (``skip_special_tokens``, vLLM's default True), the stop token that ended it left out."""

    def __init__(self, tok, ids: list[int]):
        self.tok, self.ids, self.completions = tok, ids, self

    async def create(self, extra_body: dict, **_):
        ids = self.ids[:-1] if self.ids[-1] in extra_body["stop_token_ids"] else self.ids
        text = self.tok.decode(ids, skip_special_tokens=extra_body.get("skip_special_tokens", True))
        return SimpleNamespace(choices=[SimpleNamespace(text=text)], usage=SimpleNamespace(completion_tokens=len(ids)))

    async def close(self):
        pass


def engine_answers(tok, family: Family, prompt: list[dict], emitted: list[int], monkeypatch) -> dict[str, str]:
    """The answer each engine makes of the target emitting ``emitted`` (its stop token last) for ``prompt``."""
    stops = {tok.convert_tokens_to_ids(t) for t in family.stops}
    hf = HFGenerator(_Emits(emitted, tok.pad_token_id), tok, max_new_tokens=len(emitted) + 3, stop_ids=stops)
    lean = LeanAnswers(_Decoder(emitted), tok)
    served = ServedAnswers(base_url="http://127.0.0.1:9/v1", model="target", tokenizer=tok,
                           max_new_tokens=len(emitted) + 3, temperature=0.0, top_p=1.0, stop_ids=stops, concurrency=1)
    monkeypatch.setattr(served, "_client", lambda url: _VLLM(tok, emitted))
    return {"hf": hf([prompt])[0], "lean": dict(lean.stream(_Queue([(0, prompt, 0)])))[0],
            "openai": dict(served.stream(_Queue([(0, prompt, 0)])))[0]}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_regenerated_tool_call_keeps_the_templates_own_markup(base_tokenizer, name, monkeypatch):
    """Every engine decodes the target's tool call with the template's special-token markup kept (a decode that
    skips special tokens drops it, and the draft trains on text the served target never emits) and without the
    stop token (the template writes the turn's end). Rendered back through the template, the answer turn holds
    exactly the ids the target emitted, then the template's end of turn."""
    family = FAMILIES[name]
    tok = family_tokenizer(base_tokenizer, family)
    answer_ids = tok(family.answer, add_special_tokens=False)["input_ids"]
    emitted = answer_ids + [tok.convert_tokens_to_ids(family.stop)]
    if family.markup:  # the fixture holds the markup as the real tokenizer does: a special token
        assert family.markup not in tok.decode(emitted, skip_special_tokens=True)
    prompt = normalize_conversation(TOOL_ROW)[:1]
    answers = engine_answers(tok, family, prompt, emitted, monkeypatch)
    assert answers == {engine: family.answer for engine in answers}

    regenerated = prompt + [{"role": "assistant", "content": answers["hf"]}]
    check_renderable(tok, regenerated)
    *_, (ids, mask, _) = tokenize_samples(tok, regenerated, 4096)
    turn = [t for t, m in zip(ids, mask) if m]
    assert turn == answer_ids + tok(family.end, add_special_tokens=False)["input_ids"]
    if family.markup:
        assert tok.convert_tokens_to_ids(family.markup) in turn


TWO_CALLS = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7Hd92kLq0pWx", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "a1B2c3D4e", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_7Hd92kLq0pWx", "content": "18C"},
    {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "25C"},
    {"role": "assistant", "content": "18C in Paris, 25C in Rome."}]}


def test_tool_call_ids_are_made_nine_letters_or_digits_only_for_a_template_that_takes_no_other(base_tokenizer):
    """Through Mistral's template, an OpenAI-style id becomes 9 letters or digits (the same in its call and its
    result), one already so stays, and calls without ids (ShareGPT rows) get them, each result matched to its call
    in order. A template that takes any id renders the row's own."""
    tok = family_tokenizer(base_tokenizer, FAMILIES["mistral"])
    ids = re.findall(r'"(?:id|call_id)": "([^"]*)"', render(tok, normalize_conversation(TWO_CALLS)))
    assert len(ids) == 4 and ids[0] == ids[2] and ids[1] == ids[3] == "a1B2c3D4e" and ids[0] != ids[1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)

    bare = copy.deepcopy(TWO_CALLS)
    for m in bare["messages"]:
        m.pop("tool_call_id", None)
        for call in m.get("tool_calls") or []:
            call.pop("id")
    text = render(tok, normalize_conversation(bare))
    ids = re.findall(r'"(?:id|call_id)": "([^"]*)"', text)
    assert len(ids) == 4 and ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)

    shows_ids = ("{%- for m in messages -%}{{- m.role + ':' + (m.content or '') -}}"
                 "{%- for c in m.tool_calls or [] -%}{{- c.function.name + '#' + c.id -}}{%- endfor -%}"
                 "{%- if m.tool_call_id -%}{{- '#' + m.tool_call_id -}}{%- endif -%}{{- ';' -}}{%- endfor -%}"
                 "{%- for t in tools or [] -%}{{- t.function.name -}}{%- endfor -%}")
    tok.chat_template = shows_ids
    text = render(tok, normalize_conversation(TWO_CALLS))
    assert "get_weather#call_7Hd92kLq0pWx" in text and "tool:18C#call_7Hd92kLq0pWx;" in text


def test_a_tool_row_the_template_refuses_is_skipped_in_the_templates_words(base_tokenizer):
    """Llama 3.1's template renders tools but takes one call per turn: a row with two is a malformed row naming
    what the template said (its server would refuse the conversation too), not a traceback at tokenisation."""
    tok = family_tokenizer(base_tokenizer, FAMILIES["llama3.1"])
    with pytest.raises(MalformedRow, match=r"refuses this conversation \(This model only supports "
                                           r"single tool-calls at once!\)$"):
        check_renderable(tok, normalize_conversation(TWO_CALLS))


def test_engines_ask_a_server_to_keep_special_tokens(base_tokenizer):
    """The completion request itself asks vLLM/SGLang to keep special tokens in the text, with nothing put between
    two of them (vLLM's slow-tokenizer path would write a space there that re-tokenises differently)."""
    served = ServedAnswers(base_url="http://127.0.0.1:9/v1", model="target", tokenizer=base_tokenizer,
                           max_new_tokens=8, temperature=0.0, top_p=1.0, stop_ids={2}, concurrency=1)
    body = served.sampling["extra_body"]
    assert body["skip_special_tokens"] is False and body["spaces_between_special_tokens"] is False


def test_the_fixtures_are_the_published_templates():
    """The fixture files hold the bytes the README's sha256 lines name (an edit would test a template nobody serves)."""
    import hashlib

    listed = dict(line.split()[::-1] for line in (TEMPLATES / "README.md").read_text().splitlines()
                  if re.fullmatch(r"[0-9a-f]{64}  \S+\.jinja", line))
    assert sorted(listed) == sorted(f.template for f in FAMILIES.values())
    for name, digest in listed.items():
        assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == digest, name
