"""Greedy chain speculative decoding with a trained draft: the server's algorithm, in plain PyTorch.

Each round the draft proposes k tokens from the target's aux states of the committed context, the
target verifies them in one cached forward, and the longest agreeing prefix plus the target's own next
token are committed. With greedy verification the output equals the target's greedy decoding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..draft.ttt import TTTCache


@dataclass
class Generation:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification round


def _new_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _croppable(cache) -> bool:
    """Plain KV layers can drop their last entries; sliding-window and recurrent (linear-attention)
    layers cannot roll back, so rejected drafts are undone by restoring a snapshot and replaying."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", []))


def _verify(target, cache, verify: torch.Tensor):
    """The target's cached forward over ``[next_token] + proposals``: aux states, logits, and the snapshot
    that undoing rejected drafts needs when the cache cannot crop (None when it can)."""
    snapshot = None if _croppable(cache) else copy.deepcopy(cache)
    aux_new, logits = target.forward_cached(verify, cache)
    return aux_new, logits, snapshot


def _keep(target, cache, snapshot, verify: torch.Tensor, kept: int, context_len: int):
    """The cache holding only the first ``kept`` verified tokens: crop the rejected drafts' entries, or go
    back to the snapshot and replay what was kept."""
    if snapshot is None:
        cache.crop(context_len - cache.get_seq_length())
        return cache
    if kept < verify.shape[1]:
        target.forward_cached(verify[:, :kept], snapshot)
        return snapshot
    return cache


def _cut(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                    inputs: dict | None = None) -> list[int]:
    """Plain greedy decoding with a KV cache (the baseline speculative decoding must reproduce).
    ``inputs``: the prompt's modality inputs (a vision target's pixel_values, image_grid_thw)."""
    cache = _new_cache(target)
    _, logits = target.forward_cached(torch.tensor([prompt], device=target.device), cache, **(inputs or {}))
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        _, logits = target.forward_cached(torch.tensor([[out[-1]]], device=target.device), cache)
        out.append(int(logits[0, -1].argmax()))
    return _cut(out, max_new_tokens, stop_ids)


@torch.no_grad()
def draft_chain(draft, aux_ctx: list[torch.Tensor], context: list[int], next_token: int, k: int) -> list[int]:
    """k greedy draft tokens after ``context + [next_token]`` (target ids)."""
    device = aux_ctx[0].device
    n = len(context)
    hidden = draft.project_aux(aux_ctx)  # row t: the target's state at position t
    tokens = torch.tensor([context[1:] + [next_token]], device=device)  # row t: token t + 1
    cache = TTTCache()
    h = draft.step(tokens, hidden, torch.arange(n, device=device)[None], cache)[:, -1:]
    proposals = []
    for j in range(k):
        d = int(draft.draft_to_target(draft.compute_logits(h)[0, -1].argmax()))
        proposals.append(d)
        if j + 1 < k:  # step j+1 at row n-1 stands for position n-1+(j+1)
            h = draft.step(torch.tensor([[d]], device=device), h, torch.tensor([[n + j]], device=device), cache,
                           q_offset=n - 1)
    return proposals


@torch.no_grad()
def speculative_generate(target, draft, prompt: list[int], max_new_tokens: int, k: int, stop_ids: set[int],
                         inputs: dict | None = None) -> Generation:
    """``inputs``: the prompt's modality inputs, taken by the prefill (images sit in the prompt only)."""
    cache = _new_cache(target)
    aux_ctx, logits = target.forward_cached(torch.tensor([prompt], device=target.device), cache, **(inputs or {}))
    context = list(prompt)
    next_token = int(logits[0, -1].argmax())
    out = [next_token]
    accepted: list[int] = []
    while len(out) < max_new_tokens and next_token not in stop_ids:
        proposals = draft_chain(draft, aux_ctx, context, next_token, k)
        verify = torch.tensor([[next_token] + proposals], device=target.device)
        aux_new, vlogits, snapshot = _verify(target, cache, verify)
        greedy = vlogits[0].argmax(-1).tolist()  # greedy[i]: the target's token after verify[:i+1]
        a = 0
        while a < k and proposals[a] == greedy[a]:
            a += 1
        accepted.append(a)
        context += [next_token] + proposals[:a]
        aux_ctx = [torch.cat([c, new[:, : a + 1]], dim=1) for c, new in zip(aux_ctx, aux_new)]
        cache = _keep(target, cache, snapshot, verify, a + 1, len(context))
        next_token = greedy[a]
        out += proposals[:a] + [next_token]
        if any(t in stop_ids for t in proposals[:a]):
            break
    return Generation(_cut(out, max_new_tokens, stop_ids), accepted)


@torch.no_grad()
def _draft_probs(draft, h: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """The draft's distribution over the TARGET vocabulary [V] at the last row of ``h`` (zero outside the
    draft vocabulary), at the sampling temperature."""
    logits = draft.compute_logits(h)[0, -1].float() / temperature
    probs = torch.zeros(vocab_size, device=logits.device)
    probs[draft.draft_vocab_ids()] = torch.softmax(logits, -1)
    return probs


@torch.no_grad()
def speculative_sample(target, draft, prompt: list[int], max_new_tokens: int, k: int, stop_ids: set[int],
                       temperature: float, generator: torch.Generator, inputs: dict | None = None) -> Generation:
    """Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the draft samples k tokens from
    q, the target scores them in one forward; token i is kept with probability min(1, p/q), the first
    rejected one is replaced by a sample from norm(max(0, p - q)), and when all k are kept one more comes
    from p. The output is distributed exactly as sampling from the target at ``temperature``."""
    device = target.device

    def sample(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))

    cache = _new_cache(target)
    aux_ctx, logits = target.forward_cached(torch.tensor([prompt], device=device), cache, **(inputs or {}))
    V = logits.shape[-1]
    context = list(prompt)
    next_token = sample(torch.softmax(logits[0, -1].float() / temperature, -1))
    out, accepted = [next_token], []
    while len(out) < max_new_tokens and next_token not in stop_ids:
        n = len(context)
        hidden = draft.project_aux(aux_ctx)
        dcache = TTTCache()
        h = draft.step(torch.tensor([context[1:] + [next_token]], device=device), hidden,
                       torch.arange(n, device=device)[None], dcache)[:, -1:]
        proposals, qs = [], []
        for j in range(k):
            q = _draft_probs(draft, h, V, temperature)
            d = sample(q)
            proposals.append(d)
            qs.append(q)
            if j + 1 < k:
                h = draft.step(torch.tensor([[d]], device=device), h, torch.tensor([[n + j]], device=device), dcache,
                               q_offset=n - 1)
        verify = torch.tensor([[next_token] + proposals], device=device)
        aux_new, vlogits, snapshot = _verify(target, cache, verify)
        ps = torch.softmax(vlogits[0].float() / temperature, -1)  # ps[i]: the target after verify[:i+1]
        a, replacement = 0, None
        while a < k:
            p_x, q_x = float(ps[a, proposals[a]]), float(qs[a][proposals[a]])
            if float(torch.rand((), generator=generator)) < min(1.0, p_x / max(q_x, 1e-30)):
                a += 1
                continue
            residual = (ps[a] - qs[a]).clamp(min=0)
            replacement = sample(residual / residual.sum() if float(residual.sum()) > 0 else ps[a])
            break
        accepted.append(a)
        context += [next_token] + proposals[:a]
        aux_ctx = [torch.cat([c, new[:, : a + 1]], dim=1) for c, new in zip(aux_ctx, aux_new)]
        cache = _keep(target, cache, snapshot, verify, a + 1, len(context))
        next_token = replacement if replacement is not None else sample(ps[k])
        out += proposals[:a] + [next_token]
        if any(t in stop_ids for t in proposals[:a]):
            break
    return Generation(_cut(out, max_new_tokens, stop_ids), accepted)


def acceptance_summary(accepted_per_round: list[int], k: int) -> dict:
    """Mean acceptance length (1 + accepted drafts per round) and how often each position was accepted."""
    rounds = len(accepted_per_round)
    if rounds == 0:
        return {"mean_acceptance_length": float("nan"), "per_position_acceptance": [], "rounds": 0}
    per_pos = [sum(a > i for a in accepted_per_round) / rounds for i in range(k)]
    conditional = [per_pos[i] / (per_pos[i - 1] if i else 1.0) if (per_pos[i - 1] if i else 1.0) > 0 else 0.0
                   for i in range(k)]
    return {"mean_acceptance_length": 1.0 + sum(accepted_per_round) / rounds,
            "per_position_acceptance": per_pos, "per_position_conditional_acceptance": conditional,
            "rounds": rounds}
