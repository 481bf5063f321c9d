"""Training-time test (TTT): the EAGLE3 attention pattern and the unrolled draft forward.

At unroll step k a query at row t (which stands for sequence position t + k) attends to
* the step-0 keys of rows 0..t (causal): the context the target's own states describe, and
* the keys of steps 1..k at row t itself: the draft's own earlier guesses on this chain.
This is exactly what a server's draft KV cache holds when it drafts k tokens after position t.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import repeat_kv


class TTTCache:
    """Keys/values per unroll step: step 0 over all rows, later steps only at the query rows."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys.append(k)
        self.values.append(v)

    def __len__(self) -> int:
        return len(self.keys)


def ttt_attention(q: torch.Tensor, cache: TTTCache, q_offset: int, scale: float) -> torch.Tensor:
    """q [B, h, Tq, d]; the query rows are rows ``q_offset .. q_offset+Tq-1`` of the step-0 keys.

    Scores against step-0 keys are causal; each later step contributes one same-row score.
    """
    groups = q.shape[1] // cache.keys[0].shape[1]
    k0, v0 = repeat_kv(cache.keys[0], groups), repeat_kv(cache.values[0], groups)
    T0, Tq = k0.shape[-2], q.shape[-2]
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    rows = torch.arange(Tq, device=q.device) + q_offset
    cols = torch.arange(T0, device=q.device)
    scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    extra_k = [repeat_kv(k, groups) for k in cache.keys[1:]]
    extra_v = [repeat_kv(v, groups) for v in cache.values[1:]]
    if extra_k:
        same_row = torch.stack([(q * k).sum(-1) for k in extra_k], dim=-1) * scale  # [B, h, Tq, steps]
        scores = torch.cat([scores, same_row], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :T0], v0)
    for j, v in enumerate(extra_v):
        out = out + probs[..., T0 + j, None] * v
    return out


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end back to x's length."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)
