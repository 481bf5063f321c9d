"""The target's answers for regenerated training data, from three engines (``data.generation.engine``):

* ``lean``: continuous batching over our lean forward (targets/lean/decode.py). A finished row leaves
  the batch at once and a waiting prompt takes its slot, so no compute goes to rows that already stopped.
* ``hf``: transformers' ``generate`` on batches of prompts (left padding, KV cache): every family, but a
  batch runs until its longest answer ends and the rows that stopped earlier keep computing.
* ``openai``: a serving engine (vLLM, SGLang) through its OpenAI-compatible completions endpoint, with
  ``concurrency`` requests in flight, retried with backoff by the openai package's client. The prompt goes
  as token ids rendered here with the same chat template as the other engines, so the server sees exactly
  the prompt they would.

Each counts what it computed, so the share spent on padding or past the end of an answer is reported.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

import torch

from ..data.chat import generation_prompt_ids
from ..data.regenerate import FailedAnswer
from ..errors import UserError


def answer_text(tokenizer: Any, tokens: list[int], stop_ids=()) -> str:
    """An answer's text: its token ids up to the first stop token, decoded with the special tokens kept. A chat
    template's own markup is special tokens the target writes (Llama 3.1's ``<|python_tag|>``, Mistral's
    ``[TOOL_CALLS]``, Gemma 4's ``<|tool_call>``): skipped, the draft would train on text the served target never
    emits, and kept, the answer re-tokenises to the ids it emitted. The stop token is not part of it: the template
    writes the turn's end."""
    stops = set(stop_ids)
    cut = next((j for j, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=False).strip()


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a prompt: a conversation, rendered for the assistant to answer next, or a text taken
    as it is (a chat template's user-turn prefix, continued by the target into a request)."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return generation_prompt_ids(tokenizer, prompt)


class HFGenerator:
    """``generate(prompts) -> answers``: one answer per prompt (encode_prompt), from the target."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 stop_ids: set[int] | None = None):
        """Sampling draws from torch's global generator: the caller seeds it (per batch, in regenerate)."""
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop_ids = sorted(stop_ids or {tokenizer.eos_token_id})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.tokens_generated = 0  # answer tokens, the stop token included
        self.decode_rows = 0  # row-steps the decoding computed: answers, plus rows that had already stopped
        self.prompt_tokens = self.prompt_pad_tokens = 0

    @torch.no_grad()
    def __call__(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        tok = self.tokenizer
        encoded = [encode_prompt(tok, p) for p in conversations]
        width = max(len(e) for e in encoded)
        device = next(self.model.parameters()).device
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):  # left padding: every row's next token is at the same column
            ids[i, width - len(e):] = torch.tensor(e)
            mask[i, width - len(e):] = 1
        sampling = self.temperature > 0
        out = self.model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=self.max_new_tokens,
            do_sample=sampling, temperature=self.temperature if sampling else None,
            top_p=self.top_p if sampling else None, top_k=None, eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id, use_cache=True,
        )
        new = out[:, width:]
        self.decode_rows += new.numel()
        self.prompt_tokens += sum(len(e) for e in encoded)
        self.prompt_pad_tokens += ids.numel() - sum(len(e) for e in encoded)
        answers = []
        for row in new.tolist():
            cut = next((j for j, t in enumerate(row) if t in self.stop_ids), len(row))
            self.tokens_generated += min(cut + 1, len(row))
            answers.append(answer_text(tok, row[:cut]))
        return answers


class LeanAnswers:
    """The continuous-batching decoder as an answer stream over conversations: ``stream(queue)`` takes
    ``(key, messages, seed)`` and yields ``(key, answer text)``."""

    def __init__(self, decoder: Any, tokenizer: Any):
        self.decoder, self.tokenizer = decoder, tokenizer
        self.prompt_tokens = 0
        self.prompt_pad_tokens = 0  # prompts are never padded

    @property
    def tokens_generated(self) -> int:
        return self.decoder.tokens_generated

    @property
    def decode_rows(self) -> int:
        return self.decoder.decode_rows

    def stream(self, queue) -> Iterator[tuple[Any, str]]:
        encoded = _Encoded(queue, self._encode)
        for key, tokens in self.decoder.stream(encoded):
            yield key, answer_text(self.tokenizer, tokens)  # (the decoder leaves the stop token out)

    def _encode(self, messages) -> list[int]:
        ids = encode_prompt(self.tokenizer, messages)
        self.prompt_tokens += len(ids)
        return ids


class _Encoded:
    """A view of a prompt queue whose conversations come out as token ids (encoded when taken)."""

    def __init__(self, queue, encode: Callable[[Any], list[int]]):
        self.queue, self.encode = queue, encode

    def __len__(self) -> int:
        return len(self.queue)

    def pop(self) -> tuple[Any, list[int], int]:
        key, messages, seed = self.queue.pop()
        return key, self.encode(messages), seed


class ServedAnswers:
    """An OpenAI-compatible server as an answer stream: ``stream(queue)`` keeps up to ``concurrency``
    completion requests in flight (token-id prompts, the server's own continuous batching does the rest)
    and yields ``(key, answer text)`` as they finish. ``base_url``: ``http://host:port/v1``, or a callable
    giving it (a server started on first use).

    The openai package's client sends them: each request is retried ``max_retries`` times (connection errors,
    timeouts, HTTP 408/409/429/5xx) with exponential backoff, each try given ``timeout`` seconds. A request
    that still fails yields a FailedAnswer with the reason (regeneration counts and names it); a server that
    refuses the settings themselves (no such model, no access) stops at once with the fix."""

    def __init__(self, base_url: str | Callable[[], str], model: str, tokenizer: Any, max_new_tokens: int,
                 temperature: float, top_p: float, stop_ids: set[int], concurrency: int, timeout: float = 600,
                 max_retries: int = 8):
        self.base_url, self.model, self.tokenizer = base_url, model, tokenizer
        self.sampling = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                         # the text as answer_text makes it: special tokens kept, none spaced apart (the server
                         # leaves the stop token out)
                         "extra_body": {"stop_token_ids": sorted(stop_ids), "skip_special_tokens": False,
                                        "spaces_between_special_tokens": False}}
        self.concurrency, self.timeout, self.max_retries = concurrency, timeout, max_retries
        self.tokens_generated = self.prompt_tokens = self.prompt_pad_tokens = 0  # (prompts are never padded)

    def stream(self, queue) -> Iterator[tuple[Any, Any]]:
        url = (self.base_url() if callable(self.base_url) else self.base_url).rstrip("/")
        # One event loop, run here between answers: no thread per request, and the queue is only touched here.
        loop = asyncio.new_event_loop()
        client = self._client(url)
        pending: dict[asyncio.Task, Any] = {}
        try:
            while len(queue) or pending:
                while len(queue) and len(pending) < self.concurrency:
                    key, prompt, seed = queue.pop()
                    ids = encode_prompt(self.tokenizer, prompt)
                    self.prompt_tokens += len(ids)
                    pending[loop.create_task(self._complete(client, url, ids, seed))] = key
                done, _ = loop.run_until_complete(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
                for task in done:
                    yield pending.pop(task), task.result()
        finally:
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending))
            loop.run_until_complete(client.close())
            loop.close()

    def _client(self, url: str):
        import httpx2
        import openai

        # a kept-alive connection per request in flight (the client's default keeps 100)
        limits = httpx2.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        return openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=self.max_retries, timeout=self.timeout,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits))

    async def _complete(self, client, url: str, ids: list[int], seed: int, tried: int = 0) -> str | FailedAnswer:
        import json

        import openai

        try:
            reply = await client.completions.create(model=self.model, prompt=ids, seed=seed, **self.sampling)
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as e:
            raise UserError(f"the server at {url} refused a completion ({e.status_code}: {_said(e)}); check "
                            "data.generation.server_url and server_model (the name the server serves)") from None
        except openai.BadRequestError as e:
            if "context length" in e.message:
                return ""  # a prompt longer than the server's context: an empty answer, counted as one
            return FailedAnswer(f"HTTP 400: {_said(e)}")
        except openai.APIStatusError as e:
            retried = e.status_code in (408, 409, 429) or e.status_code >= 500  # what the client retries
            return FailedAnswer(f"HTTP {e.status_code}{f' after {self.max_retries} retries' if retried else ''}: "
                                f"{_said(e)}")
        except openai.APITimeoutError:
            return FailedAnswer(f"no answer within {self.timeout:g} s, {self.max_retries} retries")
        except openai.APIConnectionError as e:
            return FailedAnswer(f"connection failed after {self.max_retries} retries: {_short(str(e.__cause__ or e))}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # a 200 whose body is cut short
            broken = f"with a body that is not JSON ({_short(str(e), 80)})"
        else:
            choices = getattr(reply, "choices", None)
            text = getattr(choices[0], "text", None) if isinstance(choices, list) and choices else None
            if isinstance(text, str):
                self.tokens_generated += getattr(getattr(reply, "usage", None), "completion_tokens", 0) or 0
                return text.strip()
            broken = (f"with a body that is not a completion ({_short(reply, 80)!r})" if isinstance(reply, str) else
                      "without a completion (an empty choices list)" if choices == [] else "without a completion text")
        if tried < self.max_retries:  # a 200 holding no answer: retried as the client retries a dropped connection
            await asyncio.sleep(min(0.5 * 2 ** tried, 8.0))
            return await self._complete(client, url, ids, seed, tried + 1)
        return FailedAnswer(f"HTTP 200 {broken} from {url}, after {self.max_retries} retries")


def _said(error) -> str:
    """What the server said in an error reply (its JSON's message, else the client's summary)."""
    body = error.body
    return _short(body.get("message") if isinstance(body, dict) and body.get("message") else error.message)


def _short(text: str, width: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"
