"""Greedy chain speculative decoding with a trained draft: the server's algorithm, in plain PyTorch.

Each round the draft proposes k tokens from the target's aux states of the committed context, the
target verifies them in one cached forward, and the longest agreeing prefix plus the target's own next
token are committed. With greedy verification the output equals the target's greedy decoding.

Both models keep a KV cache across rounds, as servers do: the target its own, the draft the step-0 keys
of the committed context (its method's drafting, e.g. EAGLE3's in methods/eagle3/drafting.py), so a round costs
the draft only the rows committed since the last one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..methods import draft_method


@dataclass
class Generation:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification round
    contexts: list[int] = field(default_factory=list)  # context length (tokens) each round drafted after
    # per round, the draft's probability of each token it proposed (greedy chain decoding; else empty)
    confidences: list[list[float]] = field(default_factory=list)


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
def speculative_generate(target, draft, prompt: list[int], max_new_tokens: int, k: int, stop_ids: set[int],
                         inputs: dict | None = None) -> Generation:
    """``inputs``: the prompt's modality inputs, taken by the prefill (images sit in the prompt only)."""
    cache = _new_cache(target)
    aux_new, logits = target.forward_cached(torch.tensor([prompt], device=target.device), cache, **(inputs or {}))
    context, drafted = list(prompt), draft_method(draft.spec.method).drafting(draft)
    next_token = int(logits[0, -1].argmax())
    gen = Generation([next_token])
    while len(gen.tokens) < max_new_tokens and next_token not in stop_ids:
        proposals = drafted.propose(aux_new, context, next_token, k)
        verify = torch.tensor([[next_token] + proposals], device=target.device)
        aux_verified, vlogits, snapshot = _verify(target, cache, verify)
        greedy = vlogits[0].argmax(-1).tolist()  # greedy[i]: the target's token after verify[:i+1]
        a = 0
        while a < k and proposals[a] == greedy[a]:
            a += 1
        gen.accepted.append(a)
        gen.contexts.append(len(context))
        gen.confidences.append(list(getattr(drafted, "confidences", []))[:k])
        context += [next_token] + proposals[:a]
        aux_new = [new[:, : a + 1] for new in aux_verified]
        cache = _keep(target, cache, snapshot, verify, a + 1, len(context))
        next_token = greedy[a]
        gen.tokens += proposals[:a] + [next_token]
        if any(t in stop_ids for t in proposals[:a]):
            break
    gen.tokens = _cut(gen.tokens, max_new_tokens, stop_ids)
    return gen


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
    aux_new, logits = target.forward_cached(torch.tensor([prompt], device=device), cache, **(inputs or {}))
    V = logits.shape[-1]
    context, drafted = list(prompt), draft_method(draft.spec.method).drafting(draft)
    next_token = sample(torch.softmax(logits[0, -1].float() / temperature, -1))
    gen = Generation([next_token])

    def drawn(h: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = _draft_probs(draft, h, V, temperature)
        return sample(q), q

    while len(gen.tokens) < max_new_tokens and next_token not in stop_ids:
        n = len(context)
        proposals, qs = drafted.propose_sampled(aux_new, context, next_token, k, drawn)
        verify = torch.tensor([[next_token] + proposals], device=device)
        aux_verified, vlogits, snapshot = _verify(target, cache, verify)
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
        gen.accepted.append(a)
        gen.contexts.append(n)
        context += [next_token] + proposals[:a]
        aux_new = [new[:, : a + 1] for new in aux_verified]
        cache = _keep(target, cache, snapshot, verify, a + 1, len(context))
        next_token = replacement if replacement is not None else sample(ps[k])
        gen.tokens += proposals[:a] + [next_token]
        if any(t in stop_ids for t in proposals[:a]):
            break
    gen.tokens = _cut(gen.tokens, max_new_tokens, stop_ids)
    return gen


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


def _length_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def context_buckets(edges: list[int]) -> list[tuple[str, int, float]]:
    """(label, lowest, highest exclusive) per context-length bucket split at ``edges``: [1024, 4096] gives
    <1k, 1k-4k, >=4k."""
    edges = sorted(set(int(e) for e in edges))
    bounds = [0, *edges, float("inf")]
    labels = ([f"<{_length_label(edges[0])}"] if edges else ["all"]) + \
        [f"{_length_label(lo)}-{_length_label(hi)}" for lo, hi in zip(edges, edges[1:])] + \
        ([f">={_length_label(edges[-1])}"] if edges else [])
    return [(label, lo, hi) for label, lo, hi in zip(labels, bounds, bounds[1:])]


def acceptance_by_context_length(accepted_per_round: list[int], contexts: list[int], k: int,
                                 edges: list[int]) -> dict[str, dict]:
    """``acceptance_summary`` of the rounds in each context-length bucket (every bucket listed, empty ones
    with 0 rounds), so a draft's acceptance at the lengths it is served at can be read off."""
    out = {}
    for label, lo, hi in context_buckets(edges):
        rounds = [a for a, n in zip(accepted_per_round, contexts) if lo <= n < hi]
        out[label] = acceptance_summary(rounds, k) if rounds else {"rounds": 0, "mean_acceptance_length": None}
    return out
