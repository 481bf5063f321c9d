"""The target's answers for regenerated training data, from three engines (``data.generation.engine``):

* ``lean``: continuous batching over our lean forward (targets/lean/decode.py). A finished row leaves
  the batch at once and a waiting prompt takes its slot, so no compute goes to rows that already stopped.
* ``hf``: transformers' ``generate`` on batches of prompts (left padding, KV cache): every family, but a
  batch runs until its longest answer ends and the rows that stopped earlier keep computing.
* ``openai``: a serving engine (vLLM, SGLang) through its OpenAI-compatible completions endpoint, with
  ``concurrency`` requests in flight. The prompt goes as token ids rendered here with the same chat
  template as the other engines, so the server sees exactly the prompt they would.

Each counts what it computed, so the share spent on padding or past the end of an answer is reported.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator

import torch

from ..data.chat import generation_prompt_ids


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
            answers.append(tok.decode(row[:cut], skip_special_tokens=True).strip())
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
            yield key, self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

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
    giving it (a server started on first use)."""

    def __init__(self, base_url: str | Callable[[], str], model: str, tokenizer: Any, max_new_tokens: int,
                 temperature: float, top_p: float, stop_ids: set[int], concurrency: int, timeout: float = 3600):
        self.base_url, self.model, self.tokenizer = base_url, model, tokenizer
        self.sampling = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                         "stop_token_ids": sorted(stop_ids), "skip_special_tokens": True}
        self.concurrency, self.timeout = concurrency, timeout
        self.tokens_generated = self.prompt_tokens = self.prompt_pad_tokens = 0  # (prompts are never padded)

    def stream(self, queue) -> Iterator[tuple[Any, str]]:
        url = (self.base_url() if callable(self.base_url) else self.base_url).rstrip("/") + "/completions"
        with ThreadPoolExecutor(self.concurrency) as pool:
            pending: dict = {}
            while len(queue) or pending:
                while len(queue) and len(pending) < self.concurrency:
                    key, prompt, seed = queue.pop()
                    ids = encode_prompt(self.tokenizer, prompt)
                    self.prompt_tokens += len(ids)
                    pending[pool.submit(self._complete, url, ids, seed)] = key
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    text, tokens = future.result()
                    self.tokens_generated += tokens
                    yield pending.pop(future), text.strip()

    def _complete(self, url: str, ids: list[int], seed: int) -> tuple[str, int]:
        body = json.dumps({"model": self.model, "prompt": ids, "seed": seed, **self.sampling}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            if e.code == 400 and "context length" in detail:
                return "", 0  # a prompt longer than the server's context: an empty answer, counted as one
            raise RuntimeError(f"the server at {url} refused a completion ({e.code}: "
                               f"{detail[:500]}); check data.generation.server_url and "
                               f"server_model (the name the server serves)") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"no answer from {url} ({e}): is the server running? (data.generation.server_url)"
                               ) from None
        return reply["choices"][0]["text"], int(reply.get("usage", {}).get("completion_tokens", 0))
