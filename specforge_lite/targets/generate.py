"""Batched generation with the target (KV cache, left padding): answers for regenerated training data."""

from __future__ import annotations

from typing import Any

import torch


class HFGenerator:
    """``generate(conversations) -> answers``: one assistant answer per conversation, from the target."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 stop_ids: set[int] | None = None):
        """Sampling draws from torch's global generator: the caller seeds it (per shard, in regenerate)."""
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop_ids = sorted(stop_ids or {tokenizer.eos_token_id})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.tokens_generated = 0

    @torch.no_grad()
    def __call__(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        tok = self.tokenizer
        prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
        encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
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
        answers = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.stop_ids), len(row))
            self.tokens_generated += min(cut + 1, len(row))
            answers.append(tok.decode(row[:cut], skip_special_tokens=True).strip())
        return answers
